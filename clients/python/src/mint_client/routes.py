"""Every REST route the SDK calls, in one place.

The test suite (tests/clients/test_routes.py) checks each against the server's OpenAPI schema, so a
route renamed on the server fails there rather than in a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

API = "/api/v1/"


@dataclass(frozen=True)
class Route:
    """One method and path template (`{name}` style, as in the OpenAPI schema)."""

    method: str
    path: str

    def url(self, **params: object) -> str:
        return self.path.format(**{k: _segment(v) for k, v in params.items()})


def _segment(value: object) -> str:
    return quote(str(value), safe="")


_A = API + "adapters/{name}/"
_R = _A + "revisions/{number}/"
_U = _A + "uploads/{upload_id}/"

ROUTES: dict[str, Route] = {
    "whoami": Route("GET", API),
    "base_models.list": Route("GET", API + "base-models/"),
    "adapters.list": Route("GET", API + "adapters/"),
    "adapters.create": Route("POST", API + "adapters/"),
    "adapters.get": Route("GET", _A),
    "adapters.scale": Route("PATCH", _A),
    "adapters.activate": Route("POST", _A + "activate/"),
    "adapters.cancel": Route("POST", _A + "cancel/"),
    "adapters.rollback": Route("POST", _A + "rollback/"),
    "adapters.promote": Route("POST", _A + "promote/"),
    "adapters.abort": Route("POST", _A + "abort/"),
    "adapters.update": Route("PATCH", _A),
    "adapters.delete": Route("DELETE", _A),
    "adapters.deactivate": Route("POST", _A + "deactivate/"),
    "adapters.retention.get": Route("GET", _A + "retention/"),
    "adapters.retention.set": Route("PATCH", _A + "retention/"),
    "adapters.diff": Route("GET", _A + "diff/"),
    "revisions.list": Route("GET", _A + "revisions/"),
    "revisions.register": Route("POST", _A + "revisions/"),
    "revisions.get": Route("GET", _R),
    "revisions.request_approval": Route("POST", _R + "request-approval/"),
    "revisions.approve": Route("POST", _R + "approve/"),
    "revisions.reject": Route("POST", _R + "reject/"),
    "revisions.retry": Route("POST", _R + "retry/"),
    "revisions.archive": Route("POST", _R + "archive/"),
    "revisions.restore": Route("POST", _R + "restore/"),
    "revisions.keep": Route("POST", _R + "keep/"),
    "revisions.download": Route("GET", _R + "download/"),
    "revisions.lineage": Route("GET", _R + "lineage/"),
    "runs.list": Route("GET", _A + "runs/"),
    "runs.get": Route("GET", _A + "runs/{run}/"),
    "evaluation.get": Route("GET", _R + "evaluation/"),
    "evaluation.request": Route("POST", _R + "evaluation/"),
    "evaluation_suites.list": Route("GET", _A + "evaluation-suites/"),
    "evaluation_suites.upload": Route("POST", _A + "evaluation-suites/"),
    "evaluation_suites.get": Route("GET", _A + "evaluation-suites/{version}/"),
    "evaluation_policy.get": Route("GET", _A + "evaluation-policy/"),
    "evaluation_policy.set": Route("PUT", _A + "evaluation-policy/"),
    "audit.list": Route("GET", API + "audit/"),
    # A person's session (mint_client.session.Session) and what only it may do: manage keys.
    "session.create": Route("POST", API + "session/"),
    "session.delete": Route("DELETE", API + "session/"),
    "keys.list": Route("GET", API + "keys/"),
    "keys.create": Route("POST", API + "keys/"),
    "keys.revoke": Route("DELETE", API + "keys/{prefix}/"),
    # … and manage people (owners).
    "members.list": Route("GET", API + "members/"),
    "members.role": Route("PATCH", API + "members/{username}/"),
    "members.remove": Route("DELETE", API + "members/{username}/"),
    "invitations.create": Route("POST", API + "invitations/"),
    "usage.get": Route("GET", API + "usage/"),
    # Resumable uploads (the contract in clients/python/README.md).
    "uploads.create": Route("POST", _A + "uploads/"),
    "uploads.get": Route("GET", _U),
    "uploads.put_part": Route("PUT", _U + "parts/{part}/"),
    "uploads.complete": Route("POST", _U + "complete/"),
    "uploads.delete": Route("DELETE", _U),
}
