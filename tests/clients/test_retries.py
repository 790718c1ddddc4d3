"""Retries at the HTTP edge, against httpx.MockTransport: what is retried, how long it waits, and that a POST
keeps its Idempotency-Key across tries. Also the mapping of error answers to typed exceptions."""

from __future__ import annotations

import httpx
import pytest
from mint_client import (
    ActivationFailed,
    AuthError,
    Client,
    ConnectionFailed,
    EvaluationGateRefused,
    FourEyesRefused,
    MintError,
    NotFound,
    NotReady,
    QuotaExceeded,
    RateLimited,
    Unavailable,
    ValidationError,
    WaitTimeout,
)

REVISION = {"number": 1, "revision": "r1", "state": "pending_approval", "failure": None}


def error(status: int, code: str, headers: dict | None = None, detail=None) -> httpx.Response:
    body = {"error": {"code": code, "message": f"{code}!"} | ({"detail": detail} if detail is not None else {})}
    return httpx.Response(status, json=body, headers=headers or {})


def client_for(answers, **kwargs) -> tuple[Client, list[httpx.Request], list[float]]:
    """A client whose server answers each request with the next of `answers` (a Response or an exception)."""
    seen: list[httpx.Request] = []
    slept: list[float] = []
    queue = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    kwargs.setdefault("retries", 3)
    client = Client(
        "http://mint.test", "mint_abc_def", transport=httpx.MockTransport(handler), sleep=slept.append, **kwargs
    )
    return client, seen, slept


def test_a_503_with_retry_after_is_retried_after_that_long_with_the_same_idempotency_key():
    client, seen, slept = client_for(
        [error(503, "unavailable", {"Retry-After": "2"}), httpx.Response(200, json=REVISION)]
    )
    revision = client.request_approval("support-bot", "r1")
    assert revision.state == "pending_approval"
    assert len(seen) == 2 and slept == [2.0]
    keys = [r.headers["Idempotency-Key"] for r in seen]
    assert keys[0] and keys[0] == keys[1]
    assert seen[0].headers["Authorization"] == "Bearer mint_abc_def"


def test_each_call_has_its_own_idempotency_key_and_gets_are_sent_without_one():
    client, seen, _ = client_for([httpx.Response(200, json=REVISION)] * 3)
    client.request_approval("support-bot", 1)
    client.request_approval("support-bot", 1)
    client.revision("support-bot", 1)
    assert seen[0].headers["Idempotency-Key"] != seen[1].headers["Idempotency-Key"]
    assert "Idempotency-Key" not in seen[2].headers


def test_an_upload_is_sent_whole_again_on_a_retry(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x" * 5000)
    (tmp_path / "optimizer.pt").write_bytes(b"pickle")
    client, seen, _ = client_for([error(503, "unavailable"), httpx.Response(201, json=REVISION)])
    progress: list[tuple[int, int]] = []
    client.register("support-bot", tmp_path, training_step=7, parent="r3", progress=lambda *p: progress.append(p))
    assert progress[-1] == (5008, 5008)  # both tries read the files through; done never passes the total
    assert len(seen) == 2 and seen[0].content.count(b"x" * 5000) == seen[1].content.count(b"x" * 5000) == 1
    assert seen[0].headers["Idempotency-Key"] == seen[1].headers["Idempotency-Key"]
    body = seen[1].content
    assert b'filename="adapter_config.json"' in body and b"optimizer.pt" not in body
    assert b'name="training_step"\r\n\r\n7' in body and b'name="parent"\r\n\r\n3' in body


def test_a_connection_that_fails_before_any_answer_is_retried():
    client, seen, slept = client_for([httpx.ConnectError("refused"), httpx.Response(200, json=REVISION)])
    assert client.revision("support-bot", 1).label == "r1"
    assert len(seen) == 2 and len(slept) == 1 and 0 < slept[0] <= 0.5


def test_retries_are_bounded_and_the_last_answer_is_raised():
    client, seen, slept = client_for([error(503, "adapter_not_ready", {"Retry-After": "1"})] * 3, retries=2)
    with pytest.raises(NotReady) as caught:
        client.revision("support-bot", 1)
    assert isinstance(caught.value, Unavailable) and caught.value.retry_after == 1.0
    assert len(seen) == 3 and slept == [1.0, 1.0]
    client, seen, _ = client_for([httpx.ConnectError("refused")] * 2, retries=1)
    with pytest.raises(ConnectionFailed):
        client.adapter("support-bot")
    assert len(seen) == 2


def test_a_rate_limit_is_retried_but_a_plan_quota_is_not():
    client, seen, slept = client_for(
        [error(429, "throttled", {"Retry-After": "3"}), httpx.Response(200, json=REVISION)]
    )
    client.revision("support-bot", 1)
    assert slept == [3.0]
    client, seen, slept = client_for([error(429, "storage_quota_exceeded")])
    with pytest.raises(QuotaExceeded) as caught:
        client.request_approval("support-bot", 1)
    assert not isinstance(caught.value, RateLimited) and len(seen) == 1 and slept == []


def test_a_retry_finding_the_first_try_still_running_waits_and_gets_its_answer():
    client, seen, slept = client_for(
        [
            httpx.ReadError("dropped"),
            error(409, "idempotency_in_progress", {"Retry-After": "1"}),
            httpx.Response(200, json=REVISION),
        ]
    )
    client.request_approval("support-bot", 1)
    assert len(seen) == 3 and len({r.headers["Idempotency-Key"] for r in seen}) == 1
    assert slept[1] == 1.0


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (400, "invalid_request", ValidationError),
        (401, "not_authenticated", AuthError),
        (403, "four_eyes", FourEyesRefused),
        (404, "not_found", NotFound),
        (409, "evaluation_failed", EvaluationGateRefused),
        (429, "serving_quota_exceeded", QuotaExceeded),
        (418, "teapot", MintError),
    ],
)
def test_error_answers_raise_their_typed_exception(status, code, kind):
    client, _, _ = client_for([error(status, code, detail={"why": 1})], retries=0)
    with pytest.raises(kind) as caught:
        client.adapter("support-bot")
    assert type(caught.value) is kind
    assert (caught.value.status, caught.value.code, caught.value.message, caught.value.detail) == (
        status,
        code,
        f"{code}!",
        {"why": 1},
    )


def adapter_body(*, serves: str | None, wants: str | None, phase: str | None = None) -> dict:
    pending = {"phase": phase, "reason": f"{phase} on cpu-0"} if phase else None
    alias = {"name": "production", "revision": serves, "desired_revision": wants, "pending": pending, "canary": None}
    return {"name": "support-bot", "base_model": "tiny", "aliases": [alias], "latest_revisions": []}


def test_waiting_for_an_alias_polls_until_it_flips_and_stops_on_a_failed_placement():
    client, seen, slept = client_for(
        [
            httpx.Response(200, json=adapter_body(serves="r1", wants="r2", phase="queued")),
            httpx.Response(200, json=adapter_body(serves="r1", wants="r2", phase="loading")),
            httpx.Response(200, json=adapter_body(serves="r2", wants="r2")),
        ]
    )
    assert client.wait_for_alias("support-bot", "r2", timeout=60).revision == "r2"
    assert len(seen) == 3 and slept == [0.5, 0.75]

    client, _, _ = client_for([httpx.Response(200, json=adapter_body(serves="r1", wants="r2", phase="failed"))])
    with pytest.raises(ActivationFailed, match="failed on cpu-0"):
        client.wait_for_alias("support-bot", 2, timeout=60)


def test_waiting_gives_up_after_the_timeout():
    body = {"number": 1, "revision": "r1", "state": "validated", "failure": None, "stalled": False}
    client, seen, _ = client_for([httpx.Response(200, json=body)] * 50)
    with pytest.raises(WaitTimeout, match="still validated"):
        client.wait_for("support-bot", 1, timeout=0.2, interval=0.3)
    assert len(seen) == 1


def test_a_next_link_is_followed_on_the_clients_own_host_only():
    first = {
        "next": "http://internal:8000/mint/api/v1/audit/?cursor=abc&limit=1",
        "results": [{"id": 2, "action": "b"}],
    }
    last = {"next": None, "results": [{"id": 1, "action": "a"}]}
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json=first if len(seen) == 1 else last)

    client = Client("https://mint.example/mint", "mint_a_b", transport=httpx.MockTransport(handler))
    assert [e.id for e in client.audit(page_size=1)] == [2, 1]
    assert seen == [
        "https://mint.example/mint/api/v1/audit/?limit=1",
        "https://mint.example/mint/api/v1/audit/?cursor=abc&limit=1",
    ]
