"""The `mint` CLI and the SDK against the real serving stack: a vLLM CPU server, the Celery worker with the node
agent, the web server with the gateway. Everything a pipeline does goes through mint-client over HTTP.

One scenario: on a tenant with four-eyes relaxed, `mint push --wait --activate` with one deploy key makes r1 live
and the openai client gets its completion; with four-eyes on, `mint push --approve --activate --deploy-key` (a
second person's key) makes r2 live; a push whose validation fails exits 3 with the server's reason; the SDK
registers r4 over the resumable path (small parts), waits, approves with the second key, activates and waits for
the flip, and the completion follows.
"""

from __future__ import annotations

import json

import openai
import pytest
from mint_client import Client, RevisionFailed
from mint_client.cli import main

from adapters.models import AdapterRevision, UploadSession
from serving.models import Alias
from tenants.access import Actor
from tenants.models import Tenant
from tenants.services import api_key_create
from tests.e2e.conftest import make_peft_adapter
from tests.e2e.world import wait

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

PROMPT = "the quick brown fox"


def completion(web: str, token: str, model: str) -> str | None:
    client = openai.OpenAI(base_url=f"{web}/v1", api_key=token, max_retries=0, timeout=60)
    try:
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    except openai.APIStatusError:
        return None
    return done.choices[0].text


def test_cli_and_sdk_end_to_end(tenant_a, engine, tiny_llama_dir, artifact_root, tmp_path, make_serving_world, capsys):
    env = {"MINT_ARTIFACT_ROOT": str(artifact_root), "MINT_HEARTBEAT_S": "1", "MINT_UPLOAD_PART_BYTES": "5242880"}
    world = make_serving_world(tenant_a.tenant, env)
    web, logs = world.web, world.logs
    owner, approver = tenant_a.users["owner"], tenant_a.users["approver"]

    def key(scopes: list[str], person) -> str:
        return api_key_create(
            tenant=tenant_a.tenant, name="-".join(scopes), scopes=scopes, created_by=person, by=Actor(user=owner)
        )[1]

    one_person = key(["pipeline", "deploy"], owner)  # registers and deploys: fine only without four-eyes
    pipeline, second = key(["pipeline"], owner), key(["deploy"], approver)
    _, inference = tenant_a.key("inference")

    def mint(*argv: str, api_key: str) -> tuple[int, dict]:
        code = main([*argv, "--json", "--base-url", web, "--api-key", api_key])
        out, _ = capsys.readouterr()
        return code, json.loads(out)

    def live(number: int) -> bool:
        alias = Alias.objects.filter(adapter=world.adapter, name="production").first()
        return (
            alias is not None
            and alias.revision_id == AdapterRevision.objects.get(adapter=world.adapter, number=number).id
        )

    # Four-eyes relaxed: one key pushes, waits, approves and activates.
    Tenant.objects.filter(id=tenant_a.tenant.id).update(four_eyes=False)
    r1_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "peft-1", seed=1)
    code, out = mint(
        "push", str(r1_dir), "--adapter", "support-bot", "--step", "100", "--wait", "--activate", api_key=one_person
    )
    assert code == 0, (out, logs())
    assert out["revision"]["revision"] == "r1"
    wait(lambda: live(1), timeout=90, what="r1 live", logs=logs)
    text_r1 = wait(lambda: completion(web, inference, "support-bot"), timeout=20, what="r1 answers", logs=logs)

    # Four-eyes on: the pipeline pushes, a second person's deploy key approves and activates.
    Tenant.objects.filter(id=tenant_a.tenant.id).update(four_eyes=True)
    r2_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "peft-2", seed=2)
    code, out = mint(
        "push",
        str(r2_dir),
        "-a",
        "support-bot",
        "--parent",
        "r1",
        "--wait",
        "--approve",
        "--activate",
        "--deploy-key",
        second,
        api_key=pipeline,
    )
    assert code == 0, (out, logs())
    assert out["revision"]["revision"] == "r2"
    wait(lambda: live(2), timeout=90, what="r2 live", logs=logs)
    text_r2 = wait(
        lambda: (t := completion(web, inference, "support-bot")) != text_r1 and t, timeout=20, what="r2 answers"
    )
    assert text_r2 == completion(web, inference, "support-bot@r2")

    # A push whose validation fails: exit 3, the server's reason.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((r1_dir / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file" * 10)
    code, out = mint("push", str(bad), "-a", "support-bot", "--wait", api_key=pipeline)
    assert code == 3, out
    failed = AdapterRevision.objects.get(adapter=world.adapter, number=3)
    assert failed.state == "failed" and failed.failure_reason
    printed = json.dumps(out, ensure_ascii=False)
    assert failed.failure_code in printed and failed.failure_reason[:40] in printed, (out, failed.failure_reason)

    # The SDK, over the resumable path (a threshold below the adapter's size), as a pipeline would.
    sdk, deploy = Client(web, pipeline, upload_threshold=1), Client(web, second)
    r4_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "peft-4", seed=4)
    revision = sdk.register("support-bot", str(r4_dir), training_step=400, parent="r2")
    assert revision.number == 4
    assert UploadSession.objects.get(adapter=world.adapter).state == "completed"  # it went the resumable way
    try:
        revision = sdk.wait_for("support-bot", 4, "exported", timeout=120)
    except RevisionFailed as exc:
        raise AssertionError(f"{exc.failure_code}: {exc.failure_reason}\n{logs()}") from exc
    sdk.request_approval("support-bot", 4)
    deploy.approve("support-bot", 4, comment="e2e")
    deploy.activate("support-bot", 4)
    deploy.wait_for_alias("support-bot", 4, timeout=120)
    assert live(4)
    wait(
        lambda: completion(web, inference, "support-bot") == completion(web, inference, "support-bot@r4"),
        timeout=20,
        what="r4 answers",
    )
    assert AdapterRevision.objects.get(adapter=world.adapter, number=4).training_step == 400
