"""Where a revision lives: weighted rendezvous (highest-random-weight) hashing over a base model's nodes.

Each (revision, node) pair gets a pseudo-random number u in (0, 1) from a hash of both names, and the node's
score is `weight / -ln(u)` with the node's `cpu_slots` as its weight. A revision's nodes, best score first,
are its preference order: its home is the first that has room. Because a pair's score depends on nothing
else, a node joining takes over only the revisions for which it now scores best (about w / W of them, its
share of the total weight) and a node leaving hands on only its own; every other revision keeps its home.
A node coming back scores exactly as before, so it gets back what it had, without reshuffling the rest.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol, TypeVar

_SPAN = float(2**64)


class Weighted(Protocol):
    name: str
    cpu_slots: int


def score(key: str, node: Weighted) -> float:
    """The node's weighted random score for `key` (higher is preferred); 0 for a node without slots."""
    if node.cpu_slots <= 0:
        return 0.0
    digest = hashlib.blake2b(f"{key}\x00{node.name}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 0.5) / _SPAN  # strictly inside (0, 1)
    return node.cpu_slots / -math.log(u)


N = TypeVar("N", bound=Weighted)


def preference(key: str, nodes: Sequence[N]) -> list[N]:
    """`nodes` in `key`'s order of preference: its home first (ties, all but impossible, by name)."""
    return sorted(nodes, key=lambda node: (-score(key, node), node.name))
