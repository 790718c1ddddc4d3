"""Downloading a revision's exported files: links that expire, made for a member (or key) who may read the revision.

On an S3 store a link is the store's own presigned URL (the bytes never pass through MinT). Elsewhere it is a MinT
URL, `/api/v1/downloads/<token>/`, whose token is signed with the site's secret and names the revision and file
and when it was made (django.core.signing): whoever holds it may fetch that one file until MINT_DOWNLOAD_LINK_S
have passed, and a changed token is refused. The link is the capability, as a presigned URL is, so it is made
only by the tenant API and the dashboard, which check who asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core import signing
from django.http import FileResponse, HttpRequest, JsonResponse
from django.urls import reverse
from django.utils import timezone
from storages.backends.s3 import S3Storage

from adapters import store
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from mint_site.errors import Conflict, error_body

_SALT = "mint.adapters.download"


@dataclass(frozen=True)
class Link:
    name: str
    size_bytes: int
    sha256: str
    url: str
    expires_at: datetime

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "url": self.url,
            "expires_at": self.expires_at.isoformat(),
        }


def download_links(*, revision: AdapterRevision, request: HttpRequest | None = None) -> list[Link]:
    """One expiring link per file of the revision's frozen export (the policy record's list, policy_record.json
    included). 409 `no_export` when it has none (not exported yet, or archived)."""
    record = revision.policy_record or {}
    files = record.get("files") or []
    if revision.state in (S.REGISTERED, S.VALIDATED, S.ARCHIVED) or not revision.export_uri or not files:
        raise Conflict(
            f"r{revision.number} has no exported files to download ({revision.state}).",
            code="no_export",
            detail={"state": revision.state},
        )
    lifetime = settings.MINT_DOWNLOAD_LINK_S
    expires = timezone.now() + timedelta(seconds=lifetime)
    storage = store.artifact_storage()
    links = []
    listed = {f["name"] for f in files}
    extra = [] if "policy_record.json" in listed else [{"name": "policy_record.json", "size_bytes": 0, "sha256": ""}]
    for entry in [*files, *extra]:
        name = entry["name"]
        path = f"{revision.export_uri}/{name}"
        if isinstance(storage, S3Storage):
            url = storage.url(path, expire=lifetime)
        else:
            token = signing.dumps({"r": revision.id, "f": name}, salt=_SALT, compress=True)
            url = reverse("download", kwargs={"token": token})
            if request is not None:
                url = request.build_absolute_uri(url)
        links.append(Link(name, int(entry.get("size_bytes") or 0), entry.get("sha256") or "", url, expires))
    return links


def _refused(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse(error_body(code, message), status=status)


def export_file(request: HttpRequest, token: str):
    """GET /api/v1/downloads/<token>/: the one file a download link names, while the link lasts."""
    if request.method not in ("GET", "HEAD"):
        return _refused(405, "method_not_allowed", "Use GET to download a file.")
    try:
        payload = signing.loads(token, salt=_SALT, max_age=settings.MINT_DOWNLOAD_LINK_S)
    except signing.SignatureExpired:
        return _refused(410, "link_expired", "This download link has expired; ask for a new one.")
    except signing.BadSignature:
        return _refused(404, "not_found", "No such download link.")
    revision = AdapterRevision.objects.select_related("adapter").filter(id=payload.get("r")).first()
    name = payload.get("f")
    record = (revision.policy_record or {}) if revision is not None else {}
    known = {f["name"] for f in record.get("files") or []} | {"policy_record.json"}
    if revision is None or revision.state == S.ARCHIVED or not revision.export_uri or name not in known:
        return _refused(404, "not_found", "The file this link named is no longer stored.")
    path = f"{revision.export_uri}/{name}"
    try:
        handle = store.artifact_storage().open(path, "rb")
    except FileNotFoundError:
        return _refused(404, "not_found", "The file this link named is no longer stored.")
    filename = f"{revision.adapter.name}-r{revision.number}-{name}"
    return FileResponse(handle, as_attachment=True, filename=filename)
