"""WebSocket consumers for the dashboard."""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from mint_site.events import PLATFORM_GROUP, tenant_group
from tenants import selectors
from tenants.auth import SESSION_TENANT_KEY

# What of another tenant's event a staff connection may see: the node and its capacity, not the tenant's names.
ANONYMOUS_FIELDS = ("type", "id", "state", "at", "node")
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403


class LiveEventsConsumer(AsyncJsonWebsocketConsumer):
    """`ws/live/`: the live events of one tenant (`?tenant=<slug>`, the session's, or the only one), plus
    the platform's for staff. Refuses anonymous users (4401) and non-members (4403)."""

    groups_joined: list[str]
    tenant_id: int | None = None

    async def connect(self) -> None:
        self.groups_joined = []
        self.seen: deque[tuple] = deque(maxlen=256)
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        named, tenant_id = await self._tenant(user)
        if tenant_id is None and (named or not user.is_staff):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        groups = ([tenant_group(tenant_id)] if tenant_id is not None else []) + (
            [PLATFORM_GROUP] if user.is_staff else []
        )
        self.tenant_id = tenant_id
        for group in groups:
            await self.channel_layer.group_add(group, self.channel_name)
            self.groups_joined.append(group)
        await self.accept()  # once accepted, no event is missed

    @database_sync_to_async
    def _tenant(self, user) -> tuple[bool, int | None]:
        """Whether a tenant was named, and the id of the one this connection follows (None: not a member).

        Staff who name no tenant and have no single membership follow the platform group only.
        """
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        session = self.scope.get("session")
        named = (query.get("tenant") or [None])[0] or (session.get(SESSION_TENANT_KEY) if session else None)
        choice = selectors.choose_tenant(user=user, named=named)
        return bool(choice.named), choice.membership.tenant_id if choice.membership else None

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)
        self.groups_joined = []

    async def receive_json(self, content: Any, **kwargs) -> None:
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    async def live_event(self, message: dict[str, Any]) -> None:
        """Forward an event. Staff get every tenant's events through the platform group: another tenant's
        reach them without its names (capacity only), and an event that came through both groups goes once."""
        event = message["event"]
        tenant_id = message.get("tenant_id")
        if tenant_id is not None and tenant_id != self.tenant_id:
            event = {name: event[name] for name in ANONYMOUS_FIELDS if name in event}
        key = (event.get("type"), event.get("id"), event.get("state"), event.get("at"))
        if key in self.seen:
            return
        self.seen.append(key)
        await self.send_json(event)
