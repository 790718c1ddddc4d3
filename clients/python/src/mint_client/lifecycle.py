"""Client methods for the rest of an adapter's life: deactivate an alias, archive, restore and keep revisions,
retention (its policy and dry run), delete an adapter, edit its words, and look inside revisions (download,
diff, lineage)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from mint_client.models import Adapter, Revision, revision_number


class LifecycleMixin:
    """Uses the client's `_json`, `_revision` and `_http`."""

    def update_adapter(self, adapter: str, *, description: str | None = None, tags: list[str] | None = None) -> Adapter:
        """Change the adapter's description and/or tags (a pipeline key may)."""
        body: dict[str, Any] = {}
        if description is not None:
            body["description"] = description
        if tags is not None:
            body["tags"] = tags
        return Adapter.from_json(self._json("adapters.update", name=adapter, json=body))

    def delete_adapter(self, adapter: str) -> dict:
        """Delete an adapter with no live alias (a deploy key): its revisions are archived, its name not reused."""
        return self._json("adapters.delete", name=adapter)

    def deactivate(self, adapter: str, alias: str | None = None) -> dict:
        """Take an alias down (requests for it answer 404); its revisions leave the nodes unless another names them."""
        return self._json("adapters.deactivate", name=adapter, json={"alias": alias} if alias else {})

    def archive(self, adapter: str, revision: int | str, *, keep_source: bool = False, reason: str = "") -> Revision:
        """Archive a revision no alias names: its files are collected (the source too unless `keep_source`)."""
        body = {"keep_source": keep_source, "reason": reason}
        data = self._json("revisions.archive", name=adapter, number=revision_number(revision), json=body)
        return self._revision(data, adapter)

    def restore(self, adapter: str, revision: int | str) -> Revision:
        """Restore an archived revision whose source was kept; its export is written again (`wait_for` exported)."""
        return self._revision(self._json("revisions.restore", name=adapter, number=revision_number(revision)), adapter)

    def keep(self, adapter: str, revision: int | str, keep: bool = True) -> Revision:
        """Mark a revision keep (retention never archives it), or unmark it."""
        data = self._json("revisions.keep", name=adapter, number=revision_number(revision), json={"keep": keep})
        return self._revision(data, adapter)

    def retention(self, adapter: str) -> dict:
        """The retention policy in force and its dry run: `would_archive` (oldest first) and why the rest stay."""
        return self._json("adapters.retention.get", name=adapter)

    def set_retention(self, adapter: str, keep_last: int | None, grace_days: int | None = None) -> dict:
        """The adapter's own retention (None: the tenant plan's); answers the new dry run."""
        body = {"keep_last": keep_last, "grace_days": grace_days}
        return self._json("adapters.retention.set", name=adapter, json=body)

    def diff(self, adapter: str, a: int | str, b: int | str) -> dict:
        """Two revisions side by side: config, modules (shapes, norms), evaluation scores."""
        params = {"a": f"r{revision_number(a)}", "b": f"r{revision_number(b)}"}
        return self._json("adapters.diff", name=adapter, params=params)

    def lineage(self, adapter: str, revision: int | str) -> dict:
        """The revision's parent chain and children."""
        return self._json("revisions.lineage", name=adapter, number=revision_number(revision))

    def download_links(self, adapter: str, revision: int | str) -> list[dict]:
        """Expiring links to the revision's exported files (name, size_bytes, sha256, url, expires_at)."""
        return self._json("revisions.download", name=adapter, number=revision_number(revision))["files"]

    def download(self, adapter: str, revision: int | str, dest: str | os.PathLike) -> list[Path]:
        """Fetch every exported file of the revision into `dest` (made if missing); returns their paths."""
        folder = Path(dest)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for link in self.download_links(adapter, revision):
            target = folder / Path(link["name"]).name
            with httpx.stream("GET", link["url"], timeout=self._http.client.timeout, follow_redirects=True) as response:
                response.raise_for_status()
                with open(target, "wb") as out:
                    for chunk in response.iter_bytes():
                        out.write(chunk)
            written.append(target)
        return written
