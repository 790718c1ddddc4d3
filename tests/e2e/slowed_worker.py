"""A real Celery worker, slowed where a test must watch or interrupt work in flight (tests only).

`python -m tests.e2e.slowed_worker` takes Celery's own command line (`-A mint_site worker …`).
Production code has no test hooks: this entry point wraps the functions a test needs slowed
before Celery starts, and the pool processes inherit the wrappers. The delays come from the
worker's environment:

- MINT_TEST_EXPORT_DELAY_MS: a pause after each file an export writes to the artifact store
  (a test kills the worker mid-export);
- MINT_TEST_PREWARM_DELAY_MS: a pause before the load call of a prewarm (the placement shows
  `loading`) and before its warm-up completion (`warming`), so a browser can watch each phase.

tests/e2e/conftest.py starts workers through this module whenever one of them is set.
"""

from __future__ import annotations

import functools
import os
import time

DELAYS = ("MINT_TEST_EXPORT_DELAY_MS", "MINT_TEST_PREWARM_DELAY_MS")


def _delay_s(name: str) -> float:
    return int(os.environ.get(name, "0")) / 1000


def slow_exports(delay_s: float) -> None:
    from adapters import store

    upload_dir, save_file = store.upload_dir, store.save_file

    def save_then_wait(*args, **kwargs):
        result = save_file(*args, **kwargs)
        time.sleep(delay_s)
        return result

    @functools.wraps(upload_dir)
    def upload_dir_slowly(*args, **kwargs):
        store.save_file = save_then_wait
        try:
            return upload_dir(*args, **kwargs)
        finally:
            store.save_file = save_file

    store.upload_dir = upload_dir_slowly


def slow_prewarms(delay_s: float) -> None:
    from serving.vllm import VllmClient

    for name in ("load_lora", "complete"):
        call = getattr(VllmClient, name)

        @functools.wraps(call)
        def wait_then_call(self, *args, _call=call, **kwargs):
            time.sleep(delay_s)
            return _call(self, *args, **kwargs)

        setattr(VllmClient, name, wait_then_call)


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mint_site.settings")
    import django

    django.setup()
    if delay := _delay_s("MINT_TEST_EXPORT_DELAY_MS"):
        slow_exports(delay)
    if delay := _delay_s("MINT_TEST_PREWARM_DELAY_MS"):
        slow_prewarms(delay)
    from celery.__main__ import main as celery_main

    celery_main()


if __name__ == "__main__":
    main()
