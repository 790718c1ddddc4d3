"""The local vLLM node itself: it must survive what clients send it."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.engine]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_short_prompt_does_not_kill_the_engine(engine, temperature):
    # A two-token prompt used to reach vLLM's AMX attention kernel on CPUs without AMX-BF16 (SIGILL).
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4, "temperature": temperature}
    answer = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60)

    assert answer.status_code == 200, answer.text
    assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
