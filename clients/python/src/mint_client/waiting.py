"""Waiting by polling (there is no key-authenticated event stream): for a revision's state, an alias's flip."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from mint_client.errors import ActivationFailed, RevisionFailed, RevisionRejected, WaitTimeout
from mint_client.models import Alias, Revision, revision_number


class WaitingMixin:
    """Client methods that poll with backoff; uses the client's `revision`, `adapter` and `sleep`."""

    def wait_for(
        self,
        adapter: str,
        revision: int | str,
        state: str = "exported",
        *,
        timeout: float = 600.0,
        interval: float = 0.5,
        max_interval: float = 5.0,
        on_poll: Callable[[Revision], None] | None = None,
        show_progress: bool = False,
    ) -> Revision:
        """Poll the revision until it reaches `state` (or a later one on the lifecycle's line) and return it.

        Raises `RevisionFailed` (the server's `failure_code` and `failure_reason`) when it fails,
        `RevisionRejected` when it is rejected on the way to `approved`, `WaitTimeout` after `timeout` s.
        """
        number = revision_number(revision)
        deadline = time.monotonic() + timeout
        delay = interval
        with _status(show_progress, f"{adapter} r{number}: waiting for {state}") as status:
            while True:
                current = self.revision(adapter, number)
                if status is not None:
                    waited = time.monotonic() - (deadline - timeout)
                    stalled = f"; stalled: {current.stalled_reason}" if current.stalled else ""
                    status.update(
                        f"{adapter} {current.label}: {current.state} (waiting for {state}, {waited:.0f} s){stalled}"
                    )
                if on_poll is not None:
                    on_poll(current)
                if current.state == "failed" and state != "failed":
                    raise RevisionFailed(
                        f"{adapter} {current.label} failed: {current.failure_code}: {current.failure_reason}",
                        revision=current,
                        failure_code=current.failure_code,
                        failure_reason=current.failure_reason,
                    )
                if current.state == "rejected" and state == "approved":
                    raise RevisionRejected(f"{adapter} {current.label} was rejected.", detail=current.raw)
                if current.reached(state):
                    return current
                if time.monotonic() + delay > deadline:
                    raise WaitTimeout(
                        f"{adapter} {current.label} is still {current.state} after {timeout:g} s (waiting for {state})"
                        + (f"; stalled: {current.stalled_reason}" if current.stalled else "")
                        + ".",
                        detail={"state": current.state},
                    )
                self.sleep(delay)
                delay = min(max_interval, delay * 1.5)

    def wait_for_alias(
        self,
        adapter: str,
        revision: int | str,
        alias: str = "production",
        *,
        canary: bool = False,
        timeout: float = 600.0,
        interval: float = 0.5,
        max_interval: float = 5.0,
        on_poll: Callable[[Alias], None] | None = None,
        show_progress: bool = False,
    ) -> Alias:
        """Poll the adapter until `alias` serves `revision` (activation flips only once it is ready), or with
        `canary=True` until the alias's canary of that revision routes its share. Raises `ActivationFailed`
        when its placement failed or the activation was withdrawn, `WaitTimeout` after `timeout` s."""
        label = f"r{revision_number(revision)}"
        started = time.monotonic()
        deadline = started + timeout
        delay = interval
        with _status(show_progress, f"{adapter}:{alias}: waiting for {label}") as status:
            while True:
                found = self.adapter(adapter).alias(alias)
                if found is not None:
                    if on_poll is not None:
                        on_poll(found)
                    if status is not None:
                        status.update(_alias_progress(adapter, alias, label, found, time.monotonic() - started))
                    if canary:
                        c = found.canary or {}
                        if c.get("revision") == label and c.get("routing"):
                            return found
                    elif found.revision == label:
                        return found
                    if found.phase == "failed":
                        raise ActivationFailed(
                            f"{adapter}:{alias} will not serve {label}: {found.reason}", detail=found.pending
                        )
                    if not canary and found.desired_revision != label:
                        raise ActivationFailed(
                            f"{adapter}:{alias} no longer wants {label} (desired: {found.desired_revision}).",
                            detail=found.raw,
                        )
                if time.monotonic() + delay > deadline:
                    why = f" ({found.reason})" if found is not None and found.reason else ""
                    raise WaitTimeout(f"{adapter}:{alias} does not serve {label} after {timeout:g} s{why}.")
                self.sleep(delay)
                delay = min(max_interval, delay * 1.5)


def _alias_progress(adapter: str, alias: str, label: str, found: Alias, waited: float) -> str:
    """One line of a wait for an alias: what it serves, the phase of what it waits for (and its place in the
    node's queue), for how long, and the server's reason."""
    pending = found.pending or {}
    phase = pending.get("phase") or ("live" if found.revision == label else "requested")
    position = pending.get("position")
    where = f" #{position} in {pending.get('node') or 'the'} queue" if position else ""
    reason = f": {pending['reason']}" if pending.get("reason") else ""
    return f"{adapter}:{alias} serves {found.revision or '-'}; {label} {phase}{where} ({waited:.0f} s){reason}"


def _status(show: bool, text: str) -> contextlib.AbstractContextManager:
    """A spinner with `text` on stderr while the block runs (its `update` changes the text), or None."""
    if not show:
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(text)
