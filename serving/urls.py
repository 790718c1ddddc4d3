from django.urls import path

from serving import apis

urlpatterns = [
    path("adapters/", apis.AdapterListCreateApi.as_view(), name="adapters"),
    path("adapters/<str:name>/", apis.AdapterDetailApi.as_view(), name="adapter-detail"),
    path("adapters/<str:name>/activate/", apis.AdapterActivateApi.as_view(), name="adapter-activate"),
    path("adapters/<str:name>/cancel/", apis.AdapterCancelApi.as_view(), name="adapter-cancel"),
    path("adapters/<str:name>/rollback/", apis.AdapterRollbackApi.as_view(), name="adapter-rollback"),
    path("adapters/<str:name>/promote/", apis.AdapterPromoteApi.as_view(), name="adapter-promote"),
    path("adapters/<str:name>/abort/", apis.AdapterAbortApi.as_view(), name="adapter-abort"),
    path("nodes/", apis.ServingNodeListCreateApi.as_view(), name="nodes"),
    path("nodes/<str:name>/drain/", apis.ServingNodeDrainApi.as_view(), name="node-drain"),
    path("nodes/<str:name>/undrain/", apis.ServingNodeUndrainApi.as_view(), name="node-undrain"),
    path("usage/", apis.UsageApi.as_view(), name="usage"),
]
