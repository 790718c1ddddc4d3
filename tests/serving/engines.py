"""A fake of vLLM at its HTTP edge for the heartbeat's tests (the `engines` fixture of tests/serving/conftest.py)."""

from __future__ import annotations


class Engines:
    """vLLM at its HTTP edge, per node URL: `down` URLs fail their health check; the others list `loaded`."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.loaded: dict[str, list[str]] = {}

    def __call__(self, url: str, *, timeout: float = 30.0):
        engines = self

        class Client:
            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                return None

            def health(self) -> bool:
                return url not in engines.down

            def models(self) -> list[str]:
                return ["test-dense", *engines.loaded.get(url, [])]

            def model_entries(self) -> list[dict]:
                return [{"id": name} for name in self.models()]

            def version(self) -> str:
                return "0.32.0"

        return Client()
