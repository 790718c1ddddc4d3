"""Upstream slots per serving node, shared fairly between tenants.

Each node has MINT_GATEWAY_NODE_SLOTS slots in this gateway process (at most MINT_GATEWAY_MAX_CONNECTIONS,
so the connection pool itself never makes a request wait): a request to a node holds one from before it is
sent until the node's answer is closed (a stream until it ends). While the node has a free slot a request
takes it at once. When all are taken the request waits, in a queue of its tenant, and every slot that frees
goes straight to the head of the queue of the waiting tenant that holds the fewest slots on that node (ties:
the longest waiting). So a tenant holding more than its fair share (slots ÷ tenants using the node) cannot
keep others waiting behind it: every slot it frees goes to a tenant with fewer until the shares are level,
and its own new requests queue behind theirs. A request waits at most MINT_GATEWAY_NODE_WAIT_S, then gets 503
`node_busy` with `Retry-After: 1` (a 503, not a 429: the node is full, whoever filled it; clients retry both).
Slots are counted per gateway process; a tenant's plan cap on requests in flight (serving/gateway/inflight.py)
bounds how much of every process's slots one tenant can hold at all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from serving.gateway import GatewayError


class NodeBusy(GatewayError):
    def __init__(self) -> None:
        super().__init__(
            503,
            "node_busy",
            "The serving node is busy with other requests; retry shortly.",
            headers={"Retry-After": "1"},
        )


class _Waiter:
    __slots__ = ("future", "order", "tenant")

    def __init__(self, tenant: int, order: int, future: asyncio.Future[Slot]) -> None:
        self.tenant = tenant
        self.order = order
        self.future = future


class _Node:
    __slots__ = ("held", "order", "queues", "used")

    def __init__(self) -> None:
        self.used = 0
        self.held: dict[int, int] = {}  # tenant id → slots held
        self.queues: dict[int, deque[_Waiter]] = {}  # tenant id → its requests waiting, oldest first
        self.order = 0  # arrival number of the next waiter


class Slot:
    """One upstream slot on a node, held by a tenant until `release()` (idempotent)."""

    __slots__ = ("_also", "_node", "_owner", "tenant")

    def __init__(self, owner: FairSlots, node: _Node, tenant: int) -> None:
        self._owner = owner
        self._node = node
        self.tenant = tenant
        self._also: Callable[[], None] | None = None

    def joined(self, also: Callable[[], None]) -> Callable[[], None]:
        """`release`, which then also calls `also` (the proxy's other per-request bookkeeping)."""
        self._also = also
        return self.release

    def release(self) -> None:
        node = self._node
        if node is None:
            return
        self._node = None
        if self._also is not None:
            self._also()
        self._owner._free(node, self.tenant)


class FairSlots:
    """Every node's slots in this process; see the module docstring."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self._capacity = capacity
        self._nodes: dict[str, _Node] = {}

    def _node(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            node = self._nodes[name] = _Node()
        return node

    def full(self, name: str) -> bool:
        node = self._nodes.get(name)
        return node is not None and (node.used >= self._capacity() or bool(node.queues))

    def held(self, name: str, tenant: int) -> int:
        node = self._nodes.get(name)
        return node.held.get(tenant, 0) if node is not None else 0

    def waiting(self, name: str) -> int:
        node = self._nodes.get(name)
        return sum(len(q) for q in node.queues.values()) if node is not None else 0

    def try_take(self, name: str, tenant: int) -> Slot | None:
        """A free slot at once, or None when the node's are all taken (or others already wait for one)."""
        node = self._node(name)
        if node.used >= self._capacity() or node.queues:
            return None
        return self._give(node, tenant)

    async def take(self, name: str, tenant: int, *, wait_s: float) -> Slot:
        """A slot, waiting for one in the tenant's queue for at most `wait_s`; `NodeBusy` past that."""
        slot = self.try_take(name, tenant)
        if slot is not None:
            return slot
        node = self._node(name)
        waiter = _Waiter(tenant, node.order, asyncio.get_running_loop().create_future())
        node.order += 1
        node.queues.setdefault(tenant, deque()).append(waiter)
        try:
            async with asyncio.timeout(wait_s):
                return await waiter.future
        except BaseException as exc:
            handed = waiter.future.done() and not waiter.future.cancelled()
            if handed and isinstance(exc, TimeoutError):
                return waiter.future.result()  # handed over just as the wait ran out: take it after all
            if handed:
                waiter.future.result().release()  # cancelled as it was handed over: pass it on
            else:
                self._forget(node, waiter)
            if isinstance(exc, TimeoutError):
                raise NodeBusy() from None
            raise

    def _give(self, node: _Node, tenant: int) -> Slot:
        node.used += 1
        node.held[tenant] = node.held.get(tenant, 0) + 1
        return Slot(self, node, tenant)

    def _free(self, node: _Node, tenant: int) -> None:
        held = node.held.get(tenant, 0) - 1
        if held > 0:
            node.held[tenant] = held
        else:
            node.held.pop(tenant, None)
        node.used -= 1
        if not node.queues:
            return
        capacity = self._capacity()
        while node.queues and node.used < capacity:
            waiter = self._next(node)
            if waiter is None:
                break
            waiter.future.set_result(self._give(node, waiter.tenant))

    @staticmethod
    def _next(node: _Node) -> _Waiter | None:
        """The waiter who gets the next free slot: the head of the queue of the waiting tenant holding fewest."""
        best: _Waiter | None = None
        best_key: tuple[int, int] | None = None
        for tenant, queue in list(node.queues.items()):
            while queue and queue[0].future.done():  # given up already (cancelled as it waited)
                queue.popleft()
            if not queue:
                del node.queues[tenant]
                continue
            key = (node.held.get(tenant, 0), queue[0].order)
            if best_key is None or key < best_key:
                best, best_key = queue[0], key
        if best is not None:
            queue = node.queues[best.tenant]
            queue.popleft()
            if not queue:
                del node.queues[best.tenant]
        return best

    @staticmethod
    def _forget(node: _Node, waiter: _Waiter) -> None:
        queue = node.queues.get(waiter.tenant)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(waiter)
        if not queue:
            del node.queues[waiter.tenant]
