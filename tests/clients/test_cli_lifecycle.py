"""The `mint` CLI for an adapter's whole life, against the real app (live_server): deactivate, archive, restore,
keep, retention, edit, diff, lineage, download, delete; messages that name what was not found and the flags to
pass; `rollback --wait`; a wait that shows its phase and place in the queue."""

from __future__ import annotations

import json

from mint_client.cli import main
from mint_client.models import Alias as ClientAlias
from mint_client.waiting import _alias_progress

from adapters.models import AdapterRevision
from serving.models import Alias
from tenants.models import Tenant
from tests.clients.conftest import ADAPTER


def run(capsys, live_mint, *argv: str, key: str | None = None, json_out: bool = True):
    extra = ["--json"] if json_out else []
    code = main([*argv, *extra, "--base-url", live_mint.url, "--api-key", key or live_mint.owner_both])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if json_out and out.strip() else out), err


def test_not_found_names_what_was_looked_for(live_mint, capsys):
    code, _, err = run(capsys, live_mint, "status", "nosuch", json_out=False)
    assert code == 5 and "No adapter named 'nosuch'" in err and "Not found." not in err
    code, _, err = run(capsys, live_mint, "show", ADAPTER, "r99", json_out=False)
    assert code == 5 and f"{ADAPTER} has no r99." in err


def test_a_duplicate_push_names_the_flag_not_the_api_field(live_mint, adapter_dir, capsys):
    assert run(capsys, live_mint, "push", str(adapter_dir(1)), "-a", ADAPTER, "--wait")[0] == 0
    code, _, err = run(capsys, live_mint, "push", str(adapter_dir(1)), "-a", ADAPTER, json_out=False)
    assert code == 4 and "--allow-duplicate" in err and "allow_duplicate=true" not in err


def test_usage_prints_no_none(live_mint, capsys):
    code, out, _ = run(capsys, live_mint, "usage", json_out=False)
    assert code == 0 and "None" not in out


def test_rollback_waits_for_the_flip_when_asked(capsys):
    calls = []

    class Fake:
        def __init__(self, **_):
            pass

        def rollback(self, adapter, revision, alias=None):
            calls.append(("rollback", adapter, revision, alias))
            return ClientAlias.from_json({"name": "production", "revision": "r2", "desired_revision": "r1"})

        def wait_for_alias(self, adapter, revision, alias="production", **kwargs):
            calls.append(("wait", adapter, revision, alias, kwargs["timeout"]))
            return ClientAlias.from_json({"name": "production", "revision": "r1", "desired_revision": "r1"})

        def close(self):
            pass

    argv = ["rollback", ADAPTER, "--wait", "--timeout", "30", "--json", "--base-url", "http://x", "--api-key", "k"]
    assert main(argv, make_client=Fake) == 0
    assert calls == [("rollback", ADAPTER, None, None), ("wait", ADAPTER, "r1", "production", 30.0)]
    assert json.loads(capsys.readouterr().out)["revision"] == "r1"


def test_a_wait_shows_the_phase_and_place_in_the_queue():
    found = ClientAlias.from_json(
        {
            "name": "production",
            "revision": "r1",
            "desired_revision": "r2",
            "pending": {"phase": "queued", "position": 2, "node": "node-a", "reason": "Behind one other load."},
        }
    )
    line = _alias_progress(ADAPTER, "production", "r2", found, 13.4)
    assert line == (f"{ADAPTER}:production serves r1; r2 queued #2 in node-a queue (13 s): Behind one other load.")


def test_the_whole_life_from_the_command_line(live_mint, adapter_dir, capsys, tmp_path):
    Tenant.objects.filter(id=live_mint.adapter.tenant_id).update(api_write_rpm=10_000, api_tenant_write_rpm=10_000)
    assert run(capsys, live_mint, "push", str(adapter_dir(1)), "-a", ADAPTER, "--wait")[0] == 0
    assert run(capsys, live_mint, "push", str(adapter_dir(2)), "-a", ADAPTER, "--parent", "r1", "--wait")[0] == 0

    code, out, _ = run(capsys, live_mint, "edit-adapter", ADAPTER, "--description", "Replies", "--tag", "support")
    assert code == 0 and out["description"] == "Replies" and out["tags"] == ["support"]
    code, out, _ = run(capsys, live_mint, "keep", ADAPTER, "r2")
    assert code == 0 and out["keep"] is True
    code, out, _ = run(capsys, live_mint, "retention", ADAPTER, "--keep-last", "1")
    assert code == 0 and out["policy"]["keep_last"] == 1 and out["would_archive"] == ["r1"]
    code, out, _ = run(capsys, live_mint, "diff", ADAPTER, "r1", "r2")
    assert code == 0 and out["a"] == "r1" and out["modules"]
    code, out, _ = run(capsys, live_mint, "lineage", ADAPTER, "r2")
    assert code == 0 and out["ancestors"][0]["revision"] == "r1"
    code, out, _ = run(capsys, live_mint, "download", ADAPTER, "r2", "--to", str(tmp_path / "r2"))
    assert code == 0 and any(p.endswith("adapter_model.safetensors") for p in out)
    assert (tmp_path / "r2" / "adapter_model.safetensors").stat().st_size > 0

    code, out, _ = run(capsys, live_mint, "archive", ADAPTER, "r1", "--keep-source")
    assert code == 0 and out["state"] == "archived"
    code, out, _ = run(capsys, live_mint, "restore", ADAPTER, "r1")
    assert code == 0 and out["state"] == "exported"
    r2 = AdapterRevision.objects.get(adapter=live_mint.adapter, number=2)
    AdapterRevision.objects.filter(id=r2.id).update(state="approved")
    Alias.objects.create(adapter=live_mint.adapter, name="production", revision=r2, desired_revision=r2)
    code, out, _ = run(capsys, live_mint, "archive", ADAPTER, "r2", "--json")
    assert code == 4 and out["error"]["code"] in ("revision_in_use", "revision_kept")
    code, out, _ = run(capsys, live_mint, "delete-adapter", ADAPTER, "--yes", ADAPTER)
    assert code == 4 and out["error"]["code"] == "adapter_in_use"
    code, out, _ = run(capsys, live_mint, "deactivate", ADAPTER)
    assert code == 0 and out == {"adapter": ADAPTER, "alias": "production", "deactivated": True, "named": ["r2"]}
    assert run(capsys, live_mint, "delete-adapter", ADAPTER, json_out=False)[0] == 2  # not confirmed
    code, out, _ = run(capsys, live_mint, "delete-adapter", ADAPTER, "--yes", ADAPTER)
    assert code == 0 and out["archived"] == ["r1", "r2"]
    assert run(capsys, live_mint, "status", ADAPTER)[0] == 5


def test_a_pipeline_key_cannot_archive_or_delete(live_mint, adapter_dir, capsys):
    run(capsys, live_mint, "push", str(adapter_dir(1)), "-a", ADAPTER, "--wait", key=live_mint.pipeline)
    assert run(capsys, live_mint, "archive", ADAPTER, "r1", key=live_mint.pipeline)[0] == 4
    assert run(capsys, live_mint, "delete-adapter", ADAPTER, "--yes", ADAPTER, key=live_mint.pipeline)[0] == 4
    assert run(capsys, live_mint, "keep", ADAPTER, "r1", key=live_mint.pipeline)[0] == 0
