from __future__ import annotations

import logging

from celery import shared_task

from serving.models import AgentPing

log = logging.getLogger(__name__)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def agent_ping(self, *, token: str) -> None:
    """Record which worker took this task from which queue. Idempotent per token."""
    delivery = self.request.delivery_info or {}
    queue = delivery.get("routing_key") or delivery.get("exchange") or "?"
    _, created = AgentPing.objects.get_or_create(
        token=token, defaults={"queue": queue, "hostname": self.request.hostname or "?"}
    )
    if not created:
        log.info("agent_ping %s already answered", token)
