"""The `mint` CLI through `main(argv)`, against the real app: --json output and the exit codes of its README."""

from __future__ import annotations

import json
import socket

import pytest
from mint_client.cli import main

from tests.clients.conftest import ADAPTER


def run(capsys, *argv: str) -> tuple[int, dict | list | None, str]:
    """(exit code, the JSON it printed or None, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@pytest.fixture
def mint(live_mint, capsys):
    def call(*argv: str, key: str | None = None):
        return run(capsys, *argv, "--json", "--base-url", live_mint.url, "--api-key", key or live_mint.pipeline)

    return call


def test_push_waits_for_export_and_prints_the_revision(mint, adapter_dir):
    code, out, _ = mint("push", str(adapter_dir(1)), "--adapter", ADAPTER, "--step", "42", "--wait")
    assert code == 0
    assert out["revision"]["revision"] == "r1" and out["revision"]["state"] == "exported"
    assert out["revision"]["training_step"] == 42

    code, out, _ = mint("revisions", ADAPTER)
    assert code == 0 and [r["revision"] for r in out] == ["r1"]
    code, out, _ = mint("status", ADAPTER)
    assert code == 0 and out["name"] == ADAPTER and out["latest_revisions"][0]["state"] == "exported"


def test_push_approve_with_the_registrants_own_key_says_to_pass_a_second_persons_deploy_key(
    mint, live_mint, adapter_dir
):
    code, out, _ = mint("push", str(adapter_dir(1)), "-a", ADAPTER, "--approve", key=live_mint.owner_both)
    assert code == 4
    assert out["error"]["code"] == "four_eyes" and out["exit_code"] == 4
    assert "--deploy-key" in out["error"]["message"] and "second person" in out["error"]["message"]
    code, out, _ = mint("push", str(adapter_dir(3)), "-a", ADAPTER, "--approve", key=live_mint.pipeline)
    assert code == 4 and out["error"]["code"] == "insufficient_scope" and "--deploy-key" in out["error"]["message"]

    code, out, _ = mint(
        "push",
        str(adapter_dir(2)),
        "-a",
        ADAPTER,
        "--parent",
        "r1",
        "--approve",
        "--deploy-key",
        live_mint.approver_deploy,
    )
    assert code == 0
    assert out["revision"]["revision"] == "r3" and out["revision"]["state"] == "approved"
    assert out["revision"]["parent"] == "r1"


def test_a_push_validation_refuses_exits_3_with_the_servers_reason(mint, live_mint, bad_adapter_dir, capsys):
    code, out, _ = mint("push", str(bad_adapter_dir), "--adapter", ADAPTER, "--wait")
    assert code == 3
    assert out["error"]["failure_code"] == "shape_mismatch"
    reason = out["error"]["failure_reason"]
    assert reason and "q_proj" in reason

    code = main(
        [
            "push",
            str(bad_adapter_dir),
            "-a",
            ADAPTER,
            "--wait",
            "--allow-duplicate",
            "--base-url",
            live_mint.url,
            "--api-key",
            live_mint.pipeline,
        ]
    )
    assert code == 3
    assert reason in capsys.readouterr().err.replace("\n", "")


def test_exit_codes_for_not_found_authentication_policy_and_usage(mint, live_mint, adapter_dir, capsys):
    assert mint("show", ADAPTER, "r9")[0] == 5
    assert mint("status", "no-such-adapter")[0] == 5
    code, out, _ = mint("status", ADAPTER, key="mint_abcdefabcdef_wrongsecret")
    assert code == 6 and out["error"]["status"] == 401
    mint("push", str(adapter_dir(1)), "-a", ADAPTER, "--wait")
    assert mint("approve", ADAPTER, "r1", key=live_mint.approver_deploy)[0] == 4  # exported, not pending: 409
    assert mint("activate", ADAPTER, "r1", key=live_mint.pipeline)[0] == 4  # a pipeline key does not deploy: 403
    assert run(capsys, "push")[0] == 2
    assert run(capsys, "show", ADAPTER, "x1", "--base-url", live_mint.url, "--api-key", live_mint.pipeline)[0] == 2


def test_no_server_answering_exits_7(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code, out, _ = run(
        capsys,
        "status",
        ADAPTER,
        "--json",
        "--retries",
        "0",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--api-key",
        "mint_a_b",
    )
    assert code == 7 and out["error"]["code"] == "connection_error"


def test_logs_prints_the_audit_log_oldest_first(mint, adapter_dir, capsys, live_mint):
    mint("push", str(adapter_dir(1)), "-a", ADAPTER, "--wait")
    code = main(["logs", "--json", "--limit", "50", "--base-url", live_mint.url, "--api-key", live_mint.pipeline])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and lines
    assert [e["id"] for e in lines] == sorted(e["id"] for e in lines)
    assert any(e["action"] == "revision.register" for e in lines) or any("r1" in e["target"] for e in lines)


def test_human_output_and_completion(live_mint, adapter_dir, capsys):
    assert (
        main(
            [
                "push",
                str(adapter_dir(1)),
                "-a",
                ADAPTER,
                "--wait",
                "--base-url",
                live_mint.url,
                "--api-key",
                live_mint.pipeline,
            ]
        )
        == 0
    )
    assert main(["revisions", ADAPTER, "--base-url", live_mint.url, "--api-key", live_mint.pipeline]) == 0
    out = capsys.readouterr().out
    assert "r1" in out and "exported" in out
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert "complete -o filenames -F _mint mint" in script and "--deploy-key" in script and "push" in script


def test_logs_follow_prints_new_events_as_they_come(live_mint, adapter_dir, capsys, monkeypatch):
    from mint_client.cli import commands

    polls = []

    def sleep(seconds: float) -> None:  # between polls: something happens, then the user presses Ctrl-C
        polls.append(seconds)
        if len(polls) == 1:
            live_mint.client().register(ADAPTER, adapter_dir(7))
        else:
            raise KeyboardInterrupt

    monkeypatch.setattr(commands.time, "sleep", sleep)
    args = [
        "logs",
        "--follow",
        "--json",
        "--interval",
        "0.5",
        "--base-url",
        live_mint.url,
        "--api-key",
        live_mint.pipeline,
    ]
    assert main(args) == 130
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert polls == [0.5, 0.5]
    assert lines and any("r1" in e["target"] for e in lines)
    assert [e["id"] for e in lines] == sorted({e["id"] for e in lines})
