from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from mint_site import health, metrics

handler404 = "mint_site.errors.json_404"
handler500 = "mint_site.errors.json_500"

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/v1/", include("tenants.urls")),
    path("api/v1/", include("adapters.urls")),
    path("api/v1/", include("serving.urls")),
    path("api/v1/", include("webhooks.urls")),
    path("", include("frontend.urls")),  # the dashboard; last, so the routes above win
]
