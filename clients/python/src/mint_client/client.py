"""`Client`: typed calls on MinT's `/api/v1/` for training pipelines.

from mint_client import Client
mint = Client()                                   # MINT_BASE_URL, MINT_API_KEY
r = mint.register("support-bot", "out/checkpoint-1200", training_step=1200)
r = mint.wait_for("support-bot", r.number)        # exported, or RevisionFailed with the server's reason
mint.request_approval("support-bot", r.number)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from mint_client import artifacts
from mint_client._http import Http, same_origin
from mint_client.errors import (
    ConfigurationError,
)
from mint_client.lifecycle import LifecycleMixin
from mint_client.models import (
    Adapter,
    Alias,
    AuditEvent,
    BaseModelInfo,
    Evaluation,
    EvaluationPolicy,
    EvaluationSuite,
    Model,
    Revision,
    RunStep,
    Usage,
    WhoAmI,
    revision_number,
)
from mint_client.routes import ROUTES
from mint_client.sampling import SamplingMixin
from mint_client.uploads import Progress, UploadsMixin
from mint_client.waiting import WaitingMixin

M = TypeVar("M", bound=Model)
DEFAULT_UPLOAD_THRESHOLD = 64 * 1024 * 1024


class Client(UploadsMixin, WaitingMixin, SamplingMixin, LifecycleMixin):
    """A MinT API client acting with one API key (`mint_<prefix>_<secret>`).

    `base_url` and `api_key` default to MINT_BASE_URL and MINT_API_KEY. `retries` bounds the retries of
    one call (see mint_client._http); `upload_threshold` is the size from which `register` uploads in
    resumable parts. `transport` (an httpx transport) and `sleep` are for tests and special networks.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        upload_threshold: int = DEFAULT_UPLOAD_THRESHOLD,
        tenant: str | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        base_url = base_url or os.environ.get("MINT_BASE_URL")
        api_key = api_key or os.environ.get("MINT_API_KEY")
        missing = [name for name, value in (("MINT_BASE_URL", base_url), ("MINT_API_KEY", api_key)) if not value]
        if missing:
            raise ConfigurationError(
                f"No {' and no '.join(missing)}: pass base_url=/api_key= (CLI: --base-url/--api-key) or set "
                f"{' and '.join(missing)} (e.g. MINT_BASE_URL=http://127.0.0.1:8000 MINT_API_KEY=mint_…)."
            )
        if not base_url.startswith(("http://", "https://")):
            raise ConfigurationError(f"The base URL must start with http:// or https://, not {base_url!r}.")
        base_url = base_url.rstrip("/").removesuffix("/api/v1")
        self.base_url = base_url
        self.upload_threshold = upload_threshold
        self.sleep = sleep
        self._http = Http(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            max_backoff=max_backoff,
            transport=transport,
            sleep=sleep,
            headers={"X-Mint-Tenant": tenant} if tenant else None,
        )

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def retries(self) -> int:
        return self._http.retries

    def _call(self, route: str, *, params: dict | None = None, **kwargs: Any) -> httpx.Response:
        spec = ROUTES[route]
        path_params = {
            k: kwargs.pop(k) for k in list(kwargs) if k in ("name", "number", "version", "upload_id", "part", "run")
        }
        return self._http.request(spec.method, spec.url(**path_params), params=params, **kwargs)

    def _json(self, route: str, **kwargs: Any) -> Any:
        response = self._call(route, **kwargs)
        return response.json() if response.content else None

    def _pages(
        self, route: str, model: type[M], *, params: dict | None = None, adapter: str | None = None, **path: Any
    ) -> Iterator[M]:
        """Every item of a paginated list, following the server's `next` cursor links page by page."""
        spec = ROUTES[route]
        url: str | None = spec.url(**path)
        query = {k: v for k, v in (params or {}).items() if v is not None}
        while url:
            body = self._http.request("GET", url, params=query or None).json()
            items = body if isinstance(body, list) else body.get("results", [])
            for item in items:
                obj = model.from_json(item)
                if adapter is not None and hasattr(obj, "adapter"):
                    obj.adapter = adapter
                yield obj
            url = None if isinstance(body, list) else same_origin(body.get("next"), self.base_url)
            query = {}  # the cursor link carries the query

    def _revision(self, data: dict, adapter: str) -> Revision:
        revision = Revision.from_json(data)
        revision.adapter = adapter
        return revision

    # ------------------------------------------------------------------ who, base models, adapters

    def whoami(self) -> WhoAmI:
        """The key's tenant, principal, scopes and capabilities: a quick check that the key works."""
        return WhoAmI.from_json(self._json("whoami"))

    def base_models(self) -> list[BaseModelInfo]:
        return [BaseModelInfo.from_json(b) for b in self._json("base_models.list")]

    def adapters(self, *, page_size: int | None = None) -> Iterator[Adapter]:
        """The tenant's adapters, newest first (all pages)."""
        return self._pages("adapters.list", Adapter, params={"limit": page_size})

    def adapter(self, name: str) -> Adapter:
        """One adapter with its aliases (what each serves, wants, and why it waits) and latest revisions."""
        return Adapter.from_json(self._json("adapters.get", name=name))

    def create_adapter(self, name: str, base_model: str, description: str = "") -> Adapter:
        body = {"name": name, "base_model": base_model, "description": description}
        return Adapter.from_json(self._json("adapters.create", json=body))

    def set_replicas(self, adapter: str, replicas: int | None) -> Adapter:
        return Adapter.from_json(self._json("adapters.scale", name=adapter, json={"replicas": replicas}))

    # ------------------------------------------------------------------ revisions

    def revisions(
        self, adapter: str, *, state: str | list[str] | None = None, page_size: int | None = None
    ) -> Iterator[Revision]:
        """An adapter's revisions, newest first, over every page; `state` filters (one or several)."""
        if isinstance(state, (list, tuple)):
            state = ",".join(state)
        params = {"state": state, "limit": page_size}
        return self._pages("revisions.list", Revision, params=params, adapter=adapter, name=adapter)

    def revision(self, adapter: str, revision: int | str) -> Revision:
        """One revision with its state, failure, policy record and approvals."""
        data = self._json("revisions.get", name=adapter, number=revision_number(revision))
        return self._revision(data, adapter)

    def register(
        self,
        adapter: str,
        path: str | os.PathLike,
        *,
        training_step: int | None = None,
        parent: int | str | None = None,
        allow_duplicate: bool = False,
        progress: Progress | None = None,
        run: str | None = None,
        metrics: dict[str, Any] | None = None,
        prewarm: bool = False,
    ) -> Revision:
        """Register a revision from a PEFT adapter directory (adapter_config.json + .safetensors; other files
        are left out) or one archive (.tar, .tar.gz, .zip). Answers at once with the `registered` revision;
        validation and export follow on the server (`wait_for`).

        From `upload_threshold` bytes on, the upload goes in resumable parts (a directory packed into a .tar
        first) and a dropped connection resends only what is missing. Raises `ValidationError` for an upload
        that obviously is no adapter, `DuplicateRevision` for one the adapter already has.

        `run` and `metrics` record the training run and what was measured at this step (the runs API lists
        them); `prewarm` has the server place it on a node once exported, to be sampled (`push`, `sample`).
        """
        path = Path(path)
        meta = _register_fields(training_step, parent, allow_duplicate)
        meta |= {k: v for k, v in (("run", run), ("metrics", metrics)) if v}
        if prewarm:
            meta["prewarm"] = True
        if artifacts.is_archive(path):
            if path.stat().st_size >= self.upload_threshold:
                return self.upload(adapter, path, progress=progress, **meta)
            return self._register_multipart(adapter, [("archive", path)], meta, progress)
        files = artifacts.adapter_files(path)
        if sum(p.stat().st_size for p in files) >= self.upload_threshold:
            return self.upload(adapter, path, progress=progress, **meta)
        return self._register_multipart(adapter, [("files", p) for p in files], meta, progress)

    def _register_multipart(
        self, adapter: str, fields: list[tuple[str, Path]], meta: dict, progress: Progress | None
    ) -> Revision:
        total = sum(p.stat().st_size for _, p in fields)
        data = {
            k: ("true" if v is True else "false" if v is False else json.dumps(v) if isinstance(v, dict) else str(v))
            for k, v in meta.items()
        }

        def body() -> dict:
            done = [0]

            def report(n: int) -> None:
                done[0] += n
                progress(min(done[0], total), total)

            readers = [artifacts.CountingReader(p, report if progress else None) for _, p in fields]
            files = [
                (field, (p.name, reader, "application/octet-stream"))
                for (field, p), reader in zip(fields, readers, strict=True)
            ]
            return {"files": files, "data": data, "_closers": [r.close for r in readers]}

        response = self._call("revisions.register", name=adapter, body=body)
        return self._revision(response.json(), adapter)

    def request_approval(self, adapter: str, revision: int | str) -> Revision:
        """exported → pending_approval."""
        data = self._json("revisions.request_approval", name=adapter, number=revision_number(revision))
        return self._revision(data, adapter)

    def approve(self, adapter: str, revision: int | str, comment: str = "", override_reason: str = "") -> Revision:
        """pending_approval → approved (a deploy key of someone other than the registrant: `FourEyesRefused`).
        `override_reason` approves past the evaluation gate (`EvaluationGateRefused`), audited."""
        body = {"comment": comment, "override_reason": override_reason}
        data = self._json("revisions.approve", name=adapter, number=revision_number(revision), json=body)
        return self._revision(data, adapter)

    def reject(self, adapter: str, revision: int | str, comment: str) -> Revision:
        """pending_approval → rejected; `comment` says why (required by the server)."""
        data = self._json("revisions.reject", name=adapter, number=revision_number(revision), json={"comment": comment})
        return self._revision(data, adapter)

    def retry(self, adapter: str, revision: int | str) -> Revision:
        """failed → registered, for a failure of the platform (`failure.retryable`)."""
        data = self._json("revisions.retry", name=adapter, number=revision_number(revision))
        return self._revision(data, adapter)

    # ------------------------------------------------------------------ training runs

    def runs(self, adapter: str) -> list[dict]:
        """The adapter's training runs (name, revisions, first and last step, newest revision), newest first."""
        return self._json("runs.list", name=adapter)["runs"]

    def run(self, adapter: str, run: str) -> list[RunStep]:
        """A run's revisions in step order, with the metrics their trainer sent and their parents (all pages)."""
        steps: list[RunStep] = []
        offset: int | None = 0
        while offset is not None:
            body = self._json("runs.get", name=adapter, run=run, params={"offset": offset})
            steps += [RunStep.from_json(s) for s in body["revisions"]]
            offset = body.get("next_offset")
        return steps

    # ------------------------------------------------------------------ serving

    def activate(
        self, adapter: str, revision: int | str, alias: str | None = None, canary_percent: int | None = None
    ) -> Alias:
        """Set the alias's desired revision (it flips once ready: `wait_for_alias`), or start a canary."""
        body: dict[str, Any] = {"revision": f"r{revision_number(revision)}"}
        if alias:
            body["alias"] = alias
        if canary_percent is not None:
            body["canary_percent"] = canary_percent
        return Alias.from_json(self._json("adapters.activate", name=adapter, json=body))

    def rollback(self, adapter: str, revision: int | str | None = None, alias: str | None = None) -> Alias:
        """Back to the revision live before (or the approved `revision` given)."""
        body: dict[str, Any] = {}
        if revision is not None:
            body["revision"] = f"r{revision_number(revision)}"
        if alias:
            body["alias"] = alias
        return Alias.from_json(self._json("adapters.rollback", name=adapter, json=body))

    def cancel(self, adapter: str, alias: str | None = None) -> Alias:
        """Withdraw the alias's pending activation (409 `nothing_to_cancel` when none)."""
        return Alias.from_json(self._json("adapters.cancel", name=adapter, json={"alias": alias} if alias else {}))

    def promote(self, adapter: str, alias: str | None = None) -> Alias:
        """Flip the alias to its canary's revision."""
        return Alias.from_json(self._json("adapters.promote", name=adapter, json={"alias": alias} if alias else {}))

    def abort(self, adapter: str, alias: str | None = None, reason: str = "") -> Alias:
        """Drop the alias's canary: every request goes to the live revision."""
        body: dict[str, Any] = {"reason": reason}
        if alias:
            body["alias"] = alias
        return Alias.from_json(self._json("adapters.abort", name=adapter, json=body))

    # ------------------------------------------------------------------ audit, usage

    def audit(
        self, *, action: str | None = None, target: str | None = None, page_size: int | None = None
    ) -> Iterator[AuditEvent]:
        """The tenant's audit events, newest first, over every page."""
        params = {"action": action, "target": target, "limit": page_size}
        return self._pages("audit.list", AuditEvent, params=params)

    def usage(
        self,
        *,
        start: str | None = None,
        end: str | None = None,
        group_by: str | list[str] | None = None,
        adapter: str | None = None,
        kind: str | None = None,
    ) -> Usage:
        """Metered usage (`GET /api/v1/usage/`): ISO dates or date-times, `group_by` one or two dimensions."""
        if isinstance(group_by, (list, tuple)):
            group_by = ",".join(group_by)
        params = {"from": start, "to": end, "group_by": group_by, "adapter": adapter, "kind": kind}
        return Usage.from_json(self._json("usage.get", params={k: v for k, v in params.items() if v is not None}))

    # ------------------------------------------------------------------ evaluation gate

    def upload_evaluation_suite(self, adapter: str, suite: str | os.PathLike | bytes) -> EvaluationSuite:
        """Upload the next version of the adapter's suite: JSONL bytes or a path to a .jsonl file."""
        content = suite if isinstance(suite, bytes) else Path(suite).read_bytes()
        response = self._call(
            "evaluation_suites.upload", name=adapter, content=content, headers={"Content-Type": "application/jsonl"}
        )
        return EvaluationSuite.from_json(response.json())

    def evaluation_suites(self, adapter: str) -> Iterator[EvaluationSuite]:
        return self._pages("evaluation_suites.list", EvaluationSuite, name=adapter)

    def evaluation_suite(self, adapter: str, version: int) -> EvaluationSuite:
        return EvaluationSuite.from_json(self._json("evaluation_suites.get", name=adapter, version=version))

    def evaluation(self, adapter: str, revision: int | str) -> Evaluation:
        """The revision's evaluation on the newest suite (NotFound when it has none)."""
        return Evaluation.from_json(self._json("evaluation.get", name=adapter, number=revision_number(revision)))

    def request_evaluation(self, adapter: str, revision: int | str) -> Evaluation:
        return Evaluation.from_json(self._json("evaluation.request", name=adapter, number=revision_number(revision)))

    def evaluation_policy(self, adapter: str) -> EvaluationPolicy:
        return EvaluationPolicy.from_json(self._json("evaluation_policy.get", name=adapter))

    def set_evaluation_policy(
        self, adapter: str, *, min_score: float | None = None, no_regression: bool = False
    ) -> EvaluationPolicy:
        body = {"min_score": min_score, "no_regression": no_regression}
        return EvaluationPolicy.from_json(self._json("evaluation_policy.set", name=adapter, json=body))


def _register_fields(training_step: int | None, parent: int | str | None, allow_duplicate: bool) -> dict:
    meta: dict[str, Any] = {}
    if training_step is not None:
        meta["training_step"] = int(training_step)
    if parent is not None:
        meta["parent"] = revision_number(parent)
    if allow_duplicate:
        meta["allow_duplicate"] = True
    return meta
