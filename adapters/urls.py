from django.urls import path

from adapters import apis, downloads, evaluation_apis, run_apis, upload_apis

# Adapters themselves (list, create, detail) and their aliases are routed by serving.urls.
urlpatterns = [
    path("base-models/", apis.BaseModelListApi.as_view(), name="base-models"),
    # A revision's exported files, by the expiring link the API or dashboard made (adapters/downloads.py).
    path("downloads/<str:token>/", downloads.export_file, name="download"),
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
    # Training runs (adapters/runs.py).
    path("adapters/<str:name>/runs/", run_apis.RunListApi.as_view(), name="runs"),
    path("adapters/<str:name>/runs/<str:run>/", run_apis.RunDetailApi.as_view(), name="run-detail"),
    path(
        "adapters/<str:name>/revisions/<int:number>/evaluation/",
        evaluation_apis.RevisionEvaluationApi.as_view(),
        name="revision-evaluation",
    ),
    path(
        "adapters/<str:name>/evaluation-suites/",
        evaluation_apis.EvaluationSuiteListUploadApi.as_view(),
        name="evaluation-suites",
    ),
    path(
        "adapters/<str:name>/evaluation-suites/<int:version>/",
        evaluation_apis.EvaluationSuiteDetailApi.as_view(),
        name="evaluation-suite-detail",
    ),
    path(
        "adapters/<str:name>/evaluation-policy/",
        evaluation_apis.EvaluationPolicyApi.as_view(),
        name="evaluation-policy",
    ),
    # Resumable uploads (adapters/uploads.py).
    path("adapters/<str:name>/uploads/", upload_apis.UploadSessionListCreateApi.as_view(), name="uploads"),
    path("adapters/<str:name>/uploads/<str:upload_id>/", upload_apis.UploadSessionDetailApi.as_view(), name="upload"),
    path(
        "adapters/<str:name>/uploads/<str:upload_id>/parts/<int:number>/",
        upload_apis.UploadPartApi.as_view(),
        name="upload-part",
    ),
    path(
        "adapters/<str:name>/uploads/<str:upload_id>/complete/",
        upload_apis.UploadCompleteApi.as_view(),
        name="upload-complete",
    ),
]
