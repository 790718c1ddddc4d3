"""Reading /metrics in tests the way the Prometheus scraper does: with the metrics bearer token."""

from __future__ import annotations

from django.test import override_settings

METRICS_TOKEN = "test-metrics-token-0123456789abcdef"


def scrape_metrics(client) -> str:
    """The exposition text of /metrics, read with the scraper's token (checking that it was served)."""
    with override_settings(MINT_METRICS_TOKEN=METRICS_TOKEN):
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}")
    assert response.status_code == 200, response.content
    return response.content.decode()
