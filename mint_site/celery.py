"""The Celery app: queue `control` for the control plane, `node.<name>` per serving node."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mint_site.settings")

CONTROL_QUEUE = "control"


def node_queue(node_name: str) -> str:
    """The queue the node agent of `node_name` consumes."""
    return f"node.{node_name}"


app = Celery("mint")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
