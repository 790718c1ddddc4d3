"""Reads for the dashboard's lifecycle pages: base models to create adapters on, an adapter's retention (and its dry
run), a revision's lineage, files and diff. Each takes an object already scoped to the viewer's tenant."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import QuerySet

from adapters import inspect
from adapters import selectors as adapter_selectors
from adapters.models import Adapter, AdapterRevision, BaseModel
from serving import services as serving_services

LINEAGE_BOX_W, LINEAGE_GAP = 84, 28


def base_models() -> QuerySet[BaseModel]:
    return adapter_selectors.base_model_list()


def adapters_missing(tenant, names: list[str]) -> list[str]:
    """Which of `names` are no adapter of the tenant (a key's allow-list names adapters exactly)."""
    found = set(Adapter.objects.filter(tenant=tenant, name__in=names).values_list("name", flat=True))
    return [n for n in names if n not in found]


def retention_of(adapter: Adapter) -> dict:
    """The policy in force and its dry run (what it would archive now, and why it keeps the rest)."""
    return serving_services.retention_preview(adapter=adapter)


def revision_numbers(adapter: Adapter, *, limit: int = 200) -> list[int]:
    """The adapter's newest revision numbers, for choosing one to compare with."""
    return list(
        AdapterRevision.objects.filter(adapter=adapter).order_by("-number").values_list("number", flat=True)[:limit]
    )


@dataclass(frozen=True)
class LineageBox:
    label: str
    number: int
    state: str
    x: int
    current: bool


@dataclass(frozen=True)
class Lineage:
    """The parent chain as a row of boxes, oldest on the left, the revision itself last; its children below."""

    boxes: list[LineageBox]
    children: list[dict]
    more: bool
    width: int

    @property
    def arrows(self) -> list[tuple[int, int]]:
        return [(b.x + LINEAGE_BOX_W, b.x + LINEAGE_BOX_W + LINEAGE_GAP) for b in self.boxes[:-1]]


def lineage_of(revision: AdapterRevision) -> Lineage:
    found = inspect.revision_lineage(revision)
    chain = [
        *reversed(found["ancestors"]),
        {"revision": revision.label, "number": revision.number, "state": revision.state},
    ]
    step = LINEAGE_BOX_W + LINEAGE_GAP
    boxes = [
        LineageBox(c["revision"], c["number"], c["state"], i * step, i == len(chain) - 1) for i, c in enumerate(chain)
    ]
    return Lineage(boxes, found["children"], found["more_ancestors"], len(boxes) * step)


def diff_of(a: AdapterRevision, b: AdapterRevision) -> dict:
    return inspect.revision_diff(a, b)
