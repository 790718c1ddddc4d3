"""Django's SECRET_KEY: the configured one, or one generated once per installation.

A key in the repository would let anyone who read it forge sessions, password-reset
links and signed cookies on every installation that forgot to set its own. So when
SECRET_KEY is unset, the key lives in `<MINT_VAR_DIR>/secret_key` instead: generated
on first start, readable only by its owner, and the same for every process that
shares the directory (the web server, Celery workers, management commands).
Production sets SECRET_KEY, and MINT_REQUIRE_SECRET_KEY=1 makes forgetting it fatal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

log = logging.getLogger(__name__)

KEY_FILE_NAME = "secret_key"
# Django's deploy check calls a key weak below 50 characters; token_urlsafe(50) gives 67.
_KEY_BYTES = 50


def secret_key(*, configured: str, var_dir: Path, require: bool) -> str:
    """The SECRET_KEY to run with.

    `configured` is the SECRET_KEY variable ("" when unset). Without it, `require` refuses
    to start; otherwise the key comes from `var_dir/secret_key`, made there if missing.
    """
    if configured:
        return configured
    if require:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set and MINT_REQUIRE_SECRET_KEY is on: set SECRET_KEY to a long random string."
        )
    path = var_dir / KEY_FILE_NAME
    key = _read_or_create(path)
    log.warning(
        "SECRET_KEY is not set: using the key generated in %s. Fine for local use; production must set SECRET_KEY "
        "(and MINT_REQUIRE_SECRET_KEY=1).",
        path,
    )
    return key


def _read_or_create(path: Path) -> str:
    try:
        key = _read(path)
        if key is None:
            _create(path)
            key = _read(path)
    except OSError as exc:  # a read-only or link-less file system, say: name the way out
        raise ImproperlyConfigured(
            f"SECRET_KEY is not set and {path} could not be read or written ({exc}); set SECRET_KEY."
        ) from exc
    if key is None:
        raise ImproperlyConfigured(f"{path} is empty: delete it to have a new key generated, or set SECRET_KEY.")
    return key


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-link: the key is written whole to a private temporary file, which is then hard-linked to its
    # final name. link() fails if the name exists, so when several processes start at once exactly one key
    # wins, every other process reads that one, and nobody ever sees a half-written file.
    fd, temporary = tempfile.mkstemp(prefix=".secret_key.", dir=path.parent)  # created with mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(_KEY_BYTES) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another process won the race: its key is used
            os.link(temporary, path)
    finally:
        os.unlink(temporary)


def _read(path: Path) -> str | None:
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        return None
    return key or None
