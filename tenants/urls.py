from django.urls import path

from tenants import apis

urlpatterns = [
    path("", apis.WhoAmIApi.as_view(), name="api-root"),
    path("keys/", apis.ApiKeyListCreateApi.as_view(), name="api-keys"),
    path("keys/<str:prefix>/", apis.ApiKeyRevokeApi.as_view(), name="api-key-detail"),
    path("audit/", apis.AuditEventListApi.as_view(), name="audit-events"),
]
