from django.urls import path

from tenants import apis, session_apis

urlpatterns = [
    path("", apis.WhoAmIApi.as_view(), name="api-root"),
    path("session/", session_apis.SessionApi.as_view(), name="api-session"),
    path("keys/", apis.ApiKeyListCreateApi.as_view(), name="api-keys"),
    path("keys/<str:prefix>/", apis.ApiKeyRevokeApi.as_view(), name="api-key-detail"),
    path("audit/", apis.AuditEventListApi.as_view(), name="audit-events"),
]
