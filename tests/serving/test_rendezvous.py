"""Stable placement: weighted rendezvous hashing moves only about a node's share of revisions when it joins
or leaves, and gives each node a share of homes in proportion to its slots."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from serving.services.rendezvous import preference

KEYS = [f"t{t}-a{a}-r{r}" for t in range(10) for a in range(20) for r in range(1, 51)]  # 10,000 revisions


@dataclass(frozen=True)
class Node:
    name: str
    cpu_slots: int


def homes(nodes: list[Node]) -> dict[str, str]:
    return {key: preference(key, nodes)[0].name for key in KEYS}


def moved(before: dict[str, str], after: dict[str, str]) -> float:
    return sum(before[k] != after[k] for k in KEYS) / len(KEYS)


def test_a_third_node_takes_about_a_third_and_moves_nothing_else():
    two = [Node("cpu-0", 16), Node("cpu-1", 16)]
    three = [*two, Node("cpu-2", 16)]
    before, after = homes(two), homes(three)

    share = moved(before, after)

    assert 0.75 / 3 <= share <= 1.25 / 3, share
    # Every revision that moved went to the new node: none moved between the old ones.
    assert all(after[k] == "cpu-2" for k in KEYS if before[k] != after[k])


def test_a_node_leaving_hands_on_only_its_own_and_coming_back_restores_them():
    nodes = [Node(f"cpu-{i}", 16) for i in range(4)]
    before = homes(nodes)
    without = homes([n for n in nodes if n.name != "cpu-3"])

    assert {k for k in KEYS if before[k] != without[k]} == {k for k in KEYS if before[k] == "cpu-3"}
    assert homes(nodes) == before


@pytest.mark.parametrize("slots", [(16, 16, 16), (8, 16, 32), (1, 1, 6)])
def test_homes_follow_the_nodes_slots(slots):
    nodes = [Node(f"cpu-{i}", s) for i, s in enumerate(slots)]

    counts = Counter(homes(nodes).values())

    for node in nodes:
        expected = node.cpu_slots / sum(slots)
        assert abs(counts[node.name] / len(KEYS) - expected) < 0.02, (node, counts)


def test_the_order_is_the_same_whatever_order_the_nodes_come_in():
    nodes = [Node(f"cpu-{i}", 8 + i) for i in range(5)]
    for key in KEYS[:200]:
        assert preference(key, nodes) == preference(key, list(reversed(nodes)))


def test_a_node_without_slots_is_last():
    nodes = [Node("empty", 0), Node("cpu-0", 1)]
    assert all(preference(key, nodes)[0].name == "cpu-0" for key in KEYS[:200])
