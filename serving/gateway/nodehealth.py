"""What one gateway process has seen of each node: connection failures, so that failover does not wait.

The heartbeat (serving/tasks.py, every MINT_HEARTBEAT_S) is what takes a dead node out of routing for
every process. Between a node's death and that beat, requests to it fail to connect or are cut before any
byte comes back (`NoAnswer`); the proxy sends each such request to another ready replica at once
(serving/gateway/proxy.py). This object remembers the failure for MINT_GATEWAY_NODE_SUSPECT_S, so the
next requests go to the other replicas first instead of paying a failed attempt each, and asks the control
plane to probe the node now (`report`, at most once per node per that window in this process; the control
plane also folds reports of every process into one probe), so the node leaves routing everywhere, and its
single-replica revisions are placed elsewhere, without waiting for the next beat.

A suspect node is only tried last, never excluded: with no other replica it is still tried, and the
first answer it gives clears the suspicion.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from django.conf import settings


class NodeHealth:
    """Per node name: when this process last failed to reach it. Cheap enough for every request."""

    def __init__(self, report: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._report = report
        self._clock = clock
        self._failed_at: dict[str, float] = {}
        self._reported_at: dict[str, float] = {}

    @staticmethod
    def window() -> float:
        return float(settings.MINT_GATEWAY_NODE_SUSPECT_S)

    def suspect(self, node_name: str) -> bool:
        """Whether the node failed to answer within the window (try it after the others)."""
        failed_at = self._failed_at.get(node_name)
        if failed_at is None:
            return False
        if self._clock() - failed_at > self.window():
            del self._failed_at[node_name]
            return False
        return True

    def any_suspect(self) -> bool:
        return bool(self._failed_at)

    def failed(self, node_name: str) -> None:
        """A request found the node unreachable: suspect it, and report it unless reported in the window."""
        now = self._clock()
        self._failed_at[node_name] = now
        reported_at = self._reported_at.get(node_name)
        if reported_at is None or now - reported_at > self.window():
            self._reported_at[node_name] = now
            self._report(node_name)

    def answered(self, node_name: str) -> None:
        """The node answered a request: it is reachable again."""
        if self._failed_at:
            self._failed_at.pop(node_name, None)
