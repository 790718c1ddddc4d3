"""What the API answers, as dataclasses. Each keeps the whole JSON body in `raw` (fields added to the
server later are there before the SDK names them) and is built with `from_json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T", bound="Model")

# The revision lifecycle in order; `failed` and `rejected` end it off this line.
STATE_ORDER = ("registered", "validated", "exported", "pending_approval", "approved")
TERMINAL_STATES = frozenset({"failed", "rejected", "approved"})


@dataclass
class Model:
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls: type[T], data: dict) -> T:
        names = {f.name for f in dataclasses.fields(cls)} - {"raw"}
        values = {name: data.get(name) for name in names if name in data}
        values.update(cls._nested(data))
        return cls(raw=data, **values)

    @classmethod
    def _nested(cls, data: dict) -> dict:
        return {}

    def as_json(self) -> dict:
        return self.raw


def revision_number(revision: int | str) -> int:
    """3, "3" or "r3" as 3."""
    text = str(revision).strip().lower().removeprefix("r")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"Name a revision as a number or r<number> (e.g. 3 or r3), not {revision!r}.")
    return int(text)


@dataclass
class Failure(Model):
    code: str = ""
    reason: str = ""
    retryable: bool = False
    duplicate_of: str | None = None


@dataclass
class Approval(Model):
    decision: str = ""
    decided_by: str | None = None
    comment: str = ""
    decided_at: str | None = None


@dataclass
class Revision(Model):
    """One adapter revision (`r<number>`). `adapter` is filled in by the client (the body does not name it)."""

    number: int = 0
    revision: str = ""
    state: str = ""
    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] | None = None
    training_step: int | None = None
    parent: str | None = None
    run: str = ""
    metrics: dict = field(default_factory=dict)
    prewarm: bool = False
    size_bytes: int | None = None
    sha256: str | None = None
    registered_by: str | None = None
    created_at: str | None = None
    validated_at: str | None = None
    exported_at: str | None = None
    decided_at: str | None = None
    updated_at: str | None = None
    failure: Failure | None = None
    stalled: bool = False
    stalled_since: str | None = None
    stalled_reason: str | None = None
    export_uri: str | None = None
    policy_record: dict | None = None
    approvals: list[Approval] = field(default_factory=list)
    adapter: str | None = None

    @classmethod
    def _nested(cls, data: dict) -> dict:
        failure = data.get("failure")
        return {
            "failure": Failure.from_json(failure) if isinstance(failure, dict) else None,
            "approvals": [Approval.from_json(a) for a in data.get("approvals") or []],
        }

    @property
    def label(self) -> str:
        return self.revision or f"r{self.number}"

    @property
    def failure_code(self) -> str:
        return self.failure.code if self.failure else ""

    @property
    def failure_reason(self) -> str:
        return self.failure.reason if self.failure else ""

    def reached(self, state: str) -> bool:
        """Whether the revision is at `state` or past it on the lifecycle's line."""
        if self.state == state:
            return True
        if state in STATE_ORDER and self.state in STATE_ORDER:
            return STATE_ORDER.index(self.state) >= STATE_ORDER.index(state)
        # Rejected comes after pending approval, off the line to approved.
        return self.state == "rejected" and state in STATE_ORDER[:4]


@dataclass
class RunStep(Model):
    """One revision of a training run, as the runs API lists them (in step order): its metrics and parent."""

    revision: str = ""
    number: int = 0
    training_step: int | None = None
    state: str = ""
    parent: str | None = None
    metrics: dict = field(default_factory=dict)
    created_at: str | None = None


@dataclass
class Alias(Model):
    """What an alias serves (`revision`), what it wants (`desired_revision`) and why it waits (`pending`)."""

    name: str = ""
    revision: str | None = None
    desired_revision: str | None = None
    desired_placements: list[dict] = field(default_factory=list)
    pending: dict | None = None
    rollback_pending: bool | None = None
    canary: dict | None = None
    updated_by: str | None = None
    updated_at: str | None = None
    already_live: bool | None = None

    @property
    def phase(self) -> str | None:
        return (self.pending or {}).get("phase")

    @property
    def reason(self) -> str | None:
        return (self.pending or {}).get("reason")


@dataclass
class Adapter(Model):
    name: str = ""
    base_model: str = ""
    description: str = ""
    created_at: str | None = None
    revision_counter: int | None = None
    replicas: int | None = None
    replica_count: int | None = None
    aliases: list[Alias] = field(default_factory=list)
    latest_revisions: list[Revision] = field(default_factory=list)

    @classmethod
    def _nested(cls, data: dict) -> dict:
        name = data.get("name")
        revisions = [Revision.from_json(r) for r in data.get("latest_revisions") or []]
        for revision in revisions:
            revision.adapter = name
        return {"aliases": [Alias.from_json(a) for a in data.get("aliases") or []], "latest_revisions": revisions}

    def alias(self, name: str = "production") -> Alias | None:
        return next((a for a in self.aliases if a.name == name), None)


@dataclass
class AuditEvent(Model):
    id: int = 0
    at: str | None = None
    actor: str | None = None
    action: str = ""
    target: str = ""
    before: Any = None
    after: Any = None


@dataclass
class WhoAmI(Model):
    tenant: str = ""
    principal: str = ""
    role: str | None = None
    scopes: list[str] | None = None
    capabilities: list[str] = field(default_factory=list)


@dataclass
class BaseModelInfo(Model):
    name: str = ""
    architecture: str = ""
    max_lora_rank: int | None = None
    num_layers: int | None = None
    num_experts: int | None = None


@dataclass
class EvaluationSuite(Model):
    version: int = 0
    case_count: int = 0
    size_bytes: int = 0
    uploaded_by: str | None = None
    created_at: str | None = None
    cases: list[dict] | None = None


@dataclass
class Evaluation(Model):
    id: int | None = None
    revision: str = ""
    suite: int | None = None
    state: str = ""
    score: float | None = None
    cases_passed: int | None = None
    cases: int | None = None
    baseline_revision: str | None = None
    baseline_score: float | None = None
    delta: float | None = None
    reason: str | None = None
    case_results: list[dict] | None = None
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None


@dataclass
class EvaluationPolicy(Model):
    min_score: float | None = None
    no_regression: bool = False


@dataclass
class Usage(Model):
    """A usage answer: `rows` (one dict per group: its `columns`, then the counts) and `totals`."""

    tenant: str | None = None
    period: str = ""
    kind: str = ""
    group_by: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    totals: dict = field(default_factory=dict)
    truncated: bool = False

    @property
    def start(self) -> str | None:
        return self.raw.get("from")

    @property
    def end(self) -> str | None:
        return self.raw.get("to")


@dataclass
class UploadSession(Model):
    """A resumable upload: `parts` parts of `part_size` bytes (the last one shorter); `received` the parts held."""

    id: str = ""
    part_size: int = 0
    parts: int = 0
    received: list[int] = field(default_factory=list)
    state: str = ""
    size: int | None = None
    sha256: str | None = None
    filename: str | None = None

    @classmethod
    def _nested(cls, data: dict) -> dict:
        return {"id": str(data.get("id", "")), "received": [int(n) for n in data.get("received") or []]}

    def missing(self) -> list[int]:
        held = set(self.received)
        return [n for n in range(1, self.parts + 1) if n not in held]


@dataclass
class ApiKey(Model):
    """An API key as its tenant's owners see it (`Session.api_keys()`); `token` only in `create_key`'s answer, once."""

    name: str = ""
    prefix: str = ""
    scopes: list[str] = field(default_factory=list)
    state: str = ""
    created_by: str | None = None
    created_at: str | None = None
    last_used_at: str | None = None
    expires_at: str | None = None
    revoked_at: str | None = None
    adapters: list[str] = field(default_factory=list)
    max_tokens_per_minute: int | None = None
    monthly_token_budget: int | None = None
    token: str | None = field(default=None, repr=False)
