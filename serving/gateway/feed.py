"""The gateway follows the platform's live events, so routes change when the catalog does.

Without this, a gateway process sees an alias flip, a placement becoming ready or a node
going down only when its cached route expires (MINT_GATEWAY_CACHE_S), and the first request
for an adapter that just went live pays for resolving its route. Following the `platform`
group of the channel layer (the same events the dashboard gets, sent after commit), each
process drops the routes an event touches at once and resolves the live ones again before
anyone asks. While the feed is connected, routes are kept for MINT_GATEWAY_FOLLOWED_CACHE_S (they are
refreshed by events), and one past that is still served, up to MINT_GATEWAY_FOLLOWED_STALE_S, while it is
resolved again beside the request; when it is not, for MINT_GATEWAY_CACHE_S, as without it. Events are
applied in the order they arrive, one at a time, so a route is never overwritten by an
older state of the catalog.

Keys too: `api_key.changed` (a key revoked; a member added, re-roled or removed; a person
deactivated; a tenant suspended) drops the cached keys of that tenant, or that one key, so
every gateway process refuses a revoked key, or narrows a key, on its next request rather
than at the end of MINT_GATEWAY_KEY_CACHE_S.

An event discards only the reloads of what it drops (serving/gateway/caches.py): one tenant's flips or key
events, however many, never keep another tenant's routes or keys from refreshing in the background. A
`node.state` event and (re)joining the group drop every tenant's routes, and their reloads with them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from channels.layers import get_channel_layer

from mint_site.events import PLATFORM_GROUP
from serving.gateway import auth, resolve
from serving.models import Alias
from tenants.services import API_KEY_CHANGED


class FeedState(auth.KeyState, resolve.RouteState, Protocol):
    """What following events changes in the gateway's state: its keys and routes, and whether it follows."""

    following: bool  # routes are kept longer while events keep them fresh


log = logging.getLogger(__name__)

# Join the group again this often, events or not: channels_redis forgets group members after a day, and a
# Redis flushed without a restart (the connection survives) forgets them at once. A lost membership then costs
# at most this long of missed events, during which routes still expire after MINT_GATEWAY_FOLLOWED_CACHE_S.
_REJOIN_S = 60.0
_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
# Routing-relevant events: for one tenant's adapter, or (node.state) for every tenant.
_ADAPTER_EVENTS = ("alias.flip", "alias.state", "adapter.state", "placement.state", "revision.state", "canary.state")


def routes_touched(
    state: resolve.RouteState, tenant_id: int | None, event: dict[str, Any]
) -> list[tuple[int, resolve.ModelRef]]:
    """Drop what an event makes stale; return the routes worth resolving again now."""
    kind = event.get("type")
    if kind == "node.state":
        return resolve.invalidate(state)  # a node's routes may belong to any tenant
    if kind not in _ADAPTER_EVENTS or tenant_id is None or not event.get("adapter"):
        return []
    adapter = event["adapter"]
    dropped = resolve.invalidate(state, tenant_id=tenant_id, adapter=adapter)
    if kind == "placement.state" and event.get("state") == "ready":
        state.cold.ready()  # requests held for a load read their routes again now
    if kind in ("alias.flip", "canary.state"):  # a canary started or ended: its alias's split changed
        alias = event.get("alias") or Alias.PRODUCTION
        # The name callers use for a live alias, cached or not: its first request finds it resolved.
        ref = resolve.ModelRef(adapter=adapter, alias=None if alias == Alias.PRODUCTION else alias)
        if (tenant_id, ref) not in dropped:
            dropped.append((tenant_id, ref))
    return dropped


def keys_touched(state: auth.KeyState, tenant_id: int | None, event: dict[str, Any]) -> int:
    """Drop the cached keys an `api_key.changed` event concerns (one key, or a tenant's); return how many.

    Nothing is loaded again here: the next request with such a key authenticates it from the database.
    """
    if event.get("type") != API_KEY_CHANGED or tenant_id is None:
        return 0
    return auth.forget_keys(state, tenant_id=tenant_id, key_id=event.get("key"))


async def on_message(state: FeedState, message: dict[str, Any]) -> None:
    event = message.get("event") or {}
    keys_touched(state, message.get("tenant_id"), event)
    keys = routes_touched(state, message.get("tenant_id"), event)
    if keys:
        await resolve.prefetch(state, keys)


async def follow(state: FeedState, layer=None) -> None:
    """Receive the platform group's events for as long as the process serves; reconnects with backoff."""
    layer = layer or get_channel_layer()
    if layer is None:
        return
    failures = 0
    while True:
        try:
            channel = await layer.new_channel("gateway.")
            await layer.group_add(PLATFORM_GROUP, channel)
            joined = time.monotonic()
            # Routes and keys cached before joining may have missed events: resolve them again from now on.
            resolve.invalidate(state)
            auth.forget_keys(state)
            state.following = True
            failures = 0
            while True:
                try:
                    # Waiting past the rejoin time ends the wait: a lost membership would receive nothing ever.
                    async with asyncio.timeout(max(0.0, joined + _REJOIN_S - time.monotonic())):
                        message = await layer.receive(channel)
                except TimeoutError:
                    message = None
                if message is not None:
                    try:
                        await on_message(state, message)
                    except Exception:
                        log.exception("gateway feed: event %r not applied", message.get("event"))
                if time.monotonic() - joined > _REJOIN_S:
                    await layer.group_add(PLATFORM_GROUP, channel)
                    joined = time.monotonic()
        except asyncio.CancelledError:
            state.following = False
            raise
        except Exception as exc:
            state.following = False
            resolve.invalidate(state)  # events may have been missed: back to the short TTL
            delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
            failures += 1
            log.warning("gateway feed: channel layer unavailable (%s); retrying in %.1f s", exc, delay)
            await asyncio.sleep(delay)
