from django.urls import path

from adapters import apis

# Adapters themselves (list, create, detail) and their aliases are routed by serving.urls.
urlpatterns = [
    path("base-models/", apis.BaseModelListApi.as_view(), name="base-models"),
    path("adapters/<str:name>/revisions/", apis.RevisionListRegisterApi.as_view(), name="revisions"),
    path("adapters/<str:name>/revisions/<int:number>/", apis.RevisionDetailApi.as_view(), name="revision-detail"),
    path(
        "adapters/<str:name>/revisions/<int:number>/request-approval/",
        apis.RevisionRequestApprovalApi.as_view(),
        name="revision-request-approval",
    ),
    path(
        "adapters/<str:name>/revisions/<int:number>/approve/",
        apis.RevisionApproveApi.as_view(),
        name="revision-approve",
    ),
    path(
        "adapters/<str:name>/revisions/<int:number>/reject/", apis.RevisionRejectApi.as_view(), name="revision-reject"
    ),
    path("adapters/<str:name>/revisions/<int:number>/retry/", apis.RevisionRetryApi.as_view(), name="revision-retry"),
]
