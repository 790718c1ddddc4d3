from django.urls import path

from serving import apis

urlpatterns = [
    path("nodes/", apis.ServingNodeListCreateApi.as_view(), name="nodes"),
]
