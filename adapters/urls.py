from django.urls import include, path

from adapters import apis, downloads, evaluation_apis, run_apis, upload_apis

revision = [  # below adapters/<name>/revisions/<number>/
    path("", apis.RevisionDetailApi.as_view(), name="revision-detail"),
    path("request-approval/", apis.RevisionRequestApprovalApi.as_view(), name="revision-request-approval"),
    path("approve/", apis.RevisionApproveApi.as_view(), name="revision-approve"),
    path("reject/", apis.RevisionRejectApi.as_view(), name="revision-reject"),
    path("retry/", apis.RevisionRetryApi.as_view(), name="revision-retry"),
    path("evaluation/", evaluation_apis.RevisionEvaluationApi.as_view(), name="revision-evaluation"),
]

adapter = [  # below adapters/<name>/
    path("revisions/", apis.RevisionListRegisterApi.as_view(), name="revisions"),
    path("revisions/<int:number>/", include(revision)),
    # Training runs (adapters/runs.py).
    path("runs/", run_apis.RunListApi.as_view(), name="runs"),
    path("runs/<str:run>/", run_apis.RunDetailApi.as_view(), name="run-detail"),
    path("evaluation-suites/", evaluation_apis.EvaluationSuiteListUploadApi.as_view(), name="evaluation-suites"),
    path(
        "evaluation-suites/<int:version>/",
        evaluation_apis.EvaluationSuiteDetailApi.as_view(),
        name="evaluation-suite-detail",
    ),
    path("evaluation-policy/", evaluation_apis.EvaluationPolicyApi.as_view(), name="evaluation-policy"),
    # Resumable uploads (adapters/uploads.py).
    path("uploads/", upload_apis.UploadSessionListCreateApi.as_view(), name="uploads"),
    path("uploads/<str:upload_id>/", upload_apis.UploadSessionDetailApi.as_view(), name="upload"),
    path("uploads/<str:upload_id>/parts/<int:number>/", upload_apis.UploadPartApi.as_view(), name="upload-part"),
    path("uploads/<str:upload_id>/complete/", upload_apis.UploadCompleteApi.as_view(), name="upload-complete"),
]

# Adapters themselves (list, create, detail) and their aliases are routed by serving.urls.
urlpatterns = [
    path("base-models/", apis.BaseModelListApi.as_view(), name="base-models"),
    # A revision's exported files, by the expiring link the API or dashboard made (adapters/downloads.py).
    path("downloads/<str:token>/", downloads.export_file, name="download"),
    path("adapters/<str:name>/", include(adapter)),
]
