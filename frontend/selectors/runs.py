"""Reads for the adapter page's training-runs panel: the adapter's runs, one run's steps with their metrics (for
the reward curve and its table), and the parent chain of the run's newest step. Three queries, in the panel's own
fragment (`?fragment=runs`), so the page itself costs none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters import runs as adapter_runs
from adapters.models import Adapter, AdapterRevision

# Charted metrics, at most this many, the reward first: what an RL loop watches (the rest are in the table).
CHARTED = 4
PREFERRED = ("reward", "mean_reward", "reward_mean", "return", "score", "accuracy", "loss", "kl")


@dataclass(frozen=True)
class RunsPanel:
    runs: list[dict[str, Any]]
    run: str  # the run shown ("" when the adapter has none)
    steps: list[AdapterRevision]
    metrics: list[str]  # the run's numeric metrics, charted first
    chain: list[dict[str, Any]]  # the newest step's parent chain, newest first
    truncated: bool  # the run has more steps than one page: the newest are left out

    @property
    def charted(self) -> list[str]:
        return self.metrics[:CHARTED]

    @property
    def rows(self) -> list[tuple[AdapterRevision, list[Any]]]:
        """Each step with its metrics' values in `metrics` order (None where it reported none), for the table."""
        return [(s, [(s.metrics or {}).get(name) for name in self.metrics]) for s in self.steps]

    def chart_json(self) -> dict[str, Any]:
        """The curves as runs.js draws them: x the training step (the revision number when none), one list per
        metric (null where a step did not report it)."""
        numeric = [adapter_runs.numeric_metrics(s.metrics or {}) for s in self.steps]
        return {
            "run": self.run,
            "x": [s.training_step if s.training_step is not None else s.number for s in self.steps],
            "revisions": [f"r{s.number}" for s in self.steps],
            "metrics": {name: [m.get(name) for m in numeric] for name in self.charted},
        }


def _order(names: set[str]) -> list[str]:
    preferred = [n for n in PREFERRED if n in names]
    return preferred + sorted(names - set(preferred))


def runs_panel(*, adapter: Adapter, run: str = "") -> RunsPanel:
    """The panel for `run` (default: the run pushed to last); an unknown run shows the list and no steps."""
    listed = adapter_runs.run_list(adapter=adapter)
    names = [r["run"] for r in listed]
    chosen = run if run in names else (names[0] if names else "")
    if not chosen:
        return RunsPanel(listed, "", [], [], [], False)
    page = adapter_runs.run_revisions(adapter=adapter, run=chosen)
    total = next(r["revisions"] for r in listed if r["run"] == chosen)
    metrics = _order({k for s in page for k in adapter_runs.numeric_metrics(s.metrics or {})})
    newest = max(page, key=lambda s: s.number) if page else None
    chain = adapter_runs.parent_chain(revision=newest) if newest is not None else []
    return RunsPanel(listed, chosen, page, metrics, chain, truncated=total > len(page))
