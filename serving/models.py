"""Serving nodes and what they hold."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class AgentPing(models.Model):
    """A worker's answer to `agent_ping`: proof that some worker consumes a queue and reaches the database."""

    token = models.CharField(max_length=64, unique=True)
    queue = models.CharField(max_length=200)
    hostname = models.CharField(max_length=200)
    answered_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.hostname} on {self.queue}"
