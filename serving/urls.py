from django.urls import path

from serving import apis, node_apis, retire_apis, usage_apis

urlpatterns = [
    path("adapters/", apis.AdapterListCreateApi.as_view(), name="adapters"),
    path("adapters/<str:name>/", apis.AdapterDetailApi.as_view(), name="adapter-detail"),
    path("adapters/<str:name>/activate/", apis.AdapterActivateApi.as_view(), name="adapter-activate"),
    path("adapters/<str:name>/cancel/", apis.AdapterCancelApi.as_view(), name="adapter-cancel"),
    path("adapters/<str:name>/reserve/", apis.AdapterReserveApi.as_view(), name="adapter-reserve"),
    path("adapters/<str:name>/rollback/", apis.AdapterRollbackApi.as_view(), name="adapter-rollback"),
    path("adapters/<str:name>/promote/", apis.AdapterPromoteApi.as_view(), name="adapter-promote"),
    path("adapters/<str:name>/abort/", apis.AdapterAbortApi.as_view(), name="adapter-abort"),
    # The rest of an adapter's life (serving/retire_apis.py).
    path("adapters/<str:name>/deactivate/", retire_apis.AdapterDeactivateApi.as_view(), name="adapter-deactivate"),
    path("adapters/<str:name>/retention/", retire_apis.AdapterRetentionApi.as_view(), name="adapter-retention"),
    path("adapters/<str:name>/diff/", retire_apis.AdapterDiffApi.as_view(), name="adapter-diff"),
    path(
        "adapters/<str:name>/revisions/<int:number>/archive/",
        retire_apis.RevisionArchiveApi.as_view(),
        name="revision-archive",
    ),
    path(
        "adapters/<str:name>/revisions/<int:number>/restore/",
        retire_apis.RevisionRestoreApi.as_view(),
        name="revision-restore",
    ),
    path(
        "adapters/<str:name>/revisions/<int:number>/keep/", retire_apis.RevisionKeepApi.as_view(), name="revision-keep"
    ),
    path(
        "adapters/<str:name>/revisions/<int:number>/download/",
        retire_apis.RevisionDownloadApi.as_view(),
        name="revision-download",
    ),
    path(
        "adapters/<str:name>/revisions/<int:number>/lineage/",
        retire_apis.RevisionLineageApi.as_view(),
        name="revision-lineage",
    ),
    path("nodes/", node_apis.ServingNodeListCreateApi.as_view(), name="nodes"),
    path("nodes/<str:name>/drain/", node_apis.ServingNodeDrainApi.as_view(), name="node-drain"),
    path("nodes/<str:name>/undrain/", node_apis.ServingNodeUndrainApi.as_view(), name="node-undrain"),
    path("usage/", usage_apis.UsageApi.as_view(), name="usage"),
]
