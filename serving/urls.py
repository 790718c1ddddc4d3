from django.urls import include, path

from serving import apis, node_apis, retire_apis, usage_apis

revision = [  # below adapters/<name>/revisions/<number>/; the rest of a revision's routes are in adapters.urls
    path("archive/", retire_apis.RevisionArchiveApi.as_view(), name="revision-archive"),
    path("restore/", retire_apis.RevisionRestoreApi.as_view(), name="revision-restore"),
    path("keep/", retire_apis.RevisionKeepApi.as_view(), name="revision-keep"),
    path("download/", retire_apis.RevisionDownloadApi.as_view(), name="revision-download"),
    path("lineage/", retire_apis.RevisionLineageApi.as_view(), name="revision-lineage"),
]

adapter = [  # below adapters/<name>/
    path("", apis.AdapterDetailApi.as_view(), name="adapter-detail"),
    path("activate/", apis.AdapterActivateApi.as_view(), name="adapter-activate"),
    path("cancel/", apis.AdapterCancelApi.as_view(), name="adapter-cancel"),
    path("reserve/", apis.AdapterReserveApi.as_view(), name="adapter-reserve"),
    path("rollback/", apis.AdapterRollbackApi.as_view(), name="adapter-rollback"),
    path("promote/", apis.AdapterPromoteApi.as_view(), name="adapter-promote"),
    path("abort/", apis.AdapterAbortApi.as_view(), name="adapter-abort"),
    # The rest of an adapter's life (serving/retire_apis.py).
    path("deactivate/", retire_apis.AdapterDeactivateApi.as_view(), name="adapter-deactivate"),
    path("retention/", retire_apis.AdapterRetentionApi.as_view(), name="adapter-retention"),
    path("diff/", retire_apis.AdapterDiffApi.as_view(), name="adapter-diff"),
    path("revisions/<int:number>/", include(revision)),
]

urlpatterns = [
    path("adapters/", apis.AdapterListCreateApi.as_view(), name="adapters"),
    path("adapters/<str:name>/", include(adapter)),
    path("nodes/", node_apis.ServingNodeListCreateApi.as_view(), name="nodes"),
    path("nodes/<str:name>/drain/", node_apis.ServingNodeDrainApi.as_view(), name="node-drain"),
    path("nodes/<str:name>/undrain/", node_apis.ServingNodeUndrainApi.as_view(), name="node-undrain"),
    path("usage/", usage_apis.UsageApi.as_view(), name="usage"),
]
