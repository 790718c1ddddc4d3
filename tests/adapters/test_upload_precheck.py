"""Uploads that obviously are no adapter are refused at once (400), before a byte is stored or a number spent."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.artifacts.archive import ArchiveLimits
from adapters.artifacts.archive_zip import zip_member_names
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.precheck import Upload, precheck_upload
from adapters.models import Adapter, AdapterRevision
from tests.adapters.corpus import TINY_DENSE, lora_config, make_archive, write_lora_adapter
from tests.adapters.fixtures import uploads_of
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions/"


def stored(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def files_of(directory: Path, *, drop: tuple[str, ...] = (), extra: dict[str, bytes] | None = None) -> list:
    uploads = [f for f in uploads_of(directory) if f.name not in drop]
    return uploads + [SimpleUploadedFile(name, data) for name, data in (extra or {}).items()]


def zip_of(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def _cases(good: Path) -> dict[str, tuple[dict, str]]:
    weights = (good / "adapter_model.safetensors").read_bytes()
    config = (good / "adapter_config.json").read_bytes()
    return {
        "a text file": ({"files": [SimpleUploadedFile("notes.txt", b"rank 4, alpha 8")]}, "missing_adapter_config"),
        "weights without a config": (
            {"files": files_of(good, drop=("adapter_config.json",))},
            "missing_adapter_config",
        ),
        "a config without weights": ({"files": files_of(good, drop=("adapter_model.safetensors",))}, "no_tensors"),
        "broken JSON": (
            {
                "files": [
                    SimpleUploadedFile("adapter_config.json", b'{"r": 4,'),
                    SimpleUploadedFile("a.safetensors", weights),
                ]
            },
            "bad_adapter_config",
        ),
        "not a LoRA config": (
            {
                "files": [
                    SimpleUploadedFile(
                        "adapter_config.json", json.dumps({**lora_config(), "peft_type": "IA3"}).encode()
                    ),
                    SimpleUploadedFile("adapter_model.safetensors", weights),
                ]
            },
            "bad_adapter_config",
        ),
        "a rank over the base model's": (
            {
                "files": [
                    SimpleUploadedFile("adapter_config.json", json.dumps(lora_config(rank=64)).encode()),
                    SimpleUploadedFile("adapter_model.safetensors", weights),
                ]
            },
            "rank_too_high",
        ),
        "a .bin": ({"files": files_of(good, extra={"adapter_model.bin": b"\x80\x04pickle"})}, "pickle_forbidden"),
        "a .pt": ({"files": files_of(good, extra={"optimizer.pt": b"\x80\x04pickle"})}, "pickle_forbidden"),
        "a non-archive as the archive": (
            {"archive": SimpleUploadedFile("adapter.zip", b"not an archive")},
            "bad_archive",
        ),
        "a zip without a config": (
            {"archive": SimpleUploadedFile("a.zip", zip_of({"adapter/adapter_model.safetensors": weights}))},
            "missing_adapter_config",
        ),
        "a zip without weights": (
            {"archive": SimpleUploadedFile("a.zip", zip_of({"adapter/adapter_config.json": config}))},
            "no_tensors",
        ),
        "a zip with a pickle": (
            {
                "archive": SimpleUploadedFile(
                    "a.zip",
                    zip_of({"adapter_config.json": config, "adapter_model.safetensors": weights, "x/model.pt": b"p"}),
                )
            },
            "pickle_forbidden",
        ),
        "a zip with weights in another folder": (
            {
                "archive": SimpleUploadedFile(
                    "a.zip", zip_of({"a/adapter_config.json": config, "b/adapter_model.safetensors": weights})
                )
            },
            "no_tensors",
        ),
    }


CASES = [
    "a text file",
    "weights without a config",
    "a config without weights",
    "broken JSON",
    "not a LoRA config",
    "a rank over the base model's",
    "a .bin",
    "a .pt",
    "a non-archive as the archive",
    "a zip without a config",
    "a zip without weights",
    "a zip with a pickle",
    "a zip with weights in another folder",
]


@pytest.mark.parametrize("case", CASES)
def test_an_obviously_incomplete_upload_is_a_400_and_spends_no_revision_number(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, case, django_capture_on_commit_callbacks
):
    fields, code = _cases(good_adapter_dir)[case]
    client = tenant_a.client_as("key:pipeline")
    refused = client.post(URL, fields, format="multipart")
    assert refused.status_code == 400, refused.content
    assert error_of(refused)["code"] == code
    assert stored(artifact_root) == []
    assert not AdapterRevision.objects.exists()
    assert Adapter.objects.get(id=adapter_a.id).revision_counter == 0

    with django_capture_on_commit_callbacks(execute=True):
        good = client.post(URL, {"files": uploads_of(good_adapter_dir)}, format="multipart")
    assert good.status_code == 201, good.content
    assert good.json()["revision"] == "r1"  # the number the refused upload would have taken


def test_files_and_an_archive_together_are_a_400_naming_both(
    tenant_a, adapter_a, good_adapter_dir, tmp_path, artifact_root
):
    archive = make_archive(good_adapter_dir, tmp_path / "adapter.zip", "zip")
    response = tenant_a.client_as("developer").post(
        URL,
        {"files": uploads_of(good_adapter_dir), "archive": SimpleUploadedFile("adapter.zip", archive.read_bytes())},
        format="multipart",
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "ambiguous_artifact"
    assert "adapter.zip" in error["message"] and "adapter_config.json" in error["message"]
    assert error["detail"]["archive"] == "adapter.zip"
    assert sorted(error["detail"]["files"]) == ["adapter_config.json", "adapter_model.safetensors"]
    assert stored(artifact_root) == [] and not AdapterRevision.objects.exists()


def test_two_archives_are_a_400(tenant_a, adapter_a, good_adapter_dir, tmp_path, artifact_root):
    archive = make_archive(good_adapter_dir, tmp_path / "adapter.zip", "zip").read_bytes()
    response = tenant_a.client_as("developer").post(
        URL,
        {"archive": [SimpleUploadedFile("one.zip", archive), SimpleUploadedFile("two.zip", archive)]},
        format="multipart",
    )
    assert response.status_code == 400 and error_of(response)["code"] == "ambiguous_artifact"
    assert not AdapterRevision.objects.exists()


def test_a_tar_is_never_opened_at_registration(
    tenant_a, adapter_a, tmp_path, artifact_root, django_capture_on_commit_callbacks
):
    """A tar.gz missing its config is registered; validation (sandboxed) is what unpacks tars and refuses it."""
    source = write_lora_adapter(tmp_path / "src" / "adapter", TINY_DENSE)
    (source / "adapter_config.json").unlink()
    archive = make_archive(source.parent, tmp_path / "adapter.tar.gz", "tar.gz")
    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("developer").post(
            URL, {"archive": SimpleUploadedFile("adapter.tar.gz", archive.read_bytes())}, format="multipart"
        )
    assert response.status_code == 201, response.content
    revision = AdapterRevision.objects.get()
    assert (revision.state, revision.failure_code) == ("failed", "missing_adapter_config")


def test_a_good_zip_passes_the_check_and_registers(
    tenant_a, adapter_a, good_adapter_dir, tmp_path, artifact_root, django_capture_on_commit_callbacks
):
    archive = make_archive(good_adapter_dir, tmp_path / "adapter.zip", "zip")
    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("developer").post(
            URL, {"files": [SimpleUploadedFile("adapter.zip", archive.read_bytes())]}, format="multipart"
        )
    assert response.status_code == 201, response.content
    assert AdapterRevision.objects.get().state == "exported"


def test_zip_member_names_reads_only_the_central_directory(tmp_path):
    data = zip_of({"adapter/adapter_config.json": b"{}", "adapter/adapter_model.safetensors": b"x" * 1000})
    names = zip_member_names(io.BytesIO(data), len(data), max_files=10, max_directory_bytes=1 << 20)
    assert names == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
    with pytest.raises(ArtifactError) as too_many:
        zip_member_names(io.BytesIO(data), len(data), max_files=1, max_directory_bytes=1 << 20)
    assert too_many.value.code == "archive_too_many_files"
    with pytest.raises(ArtifactError) as too_large:
        zip_member_names(io.BytesIO(data), len(data), max_files=10, max_directory_bytes=10)
    assert too_large.value.code == "archive_header_too_large"
    with pytest.raises(ArtifactError) as truncated:
        zip_member_names(io.BytesIO(data[:-30]), len(data) - 30, max_files=10, max_directory_bytes=1 << 20)
    assert truncated.value.code == "bad_archive"


def test_precheck_leaves_the_streams_at_their_start(good_adapter_dir):
    streams = {p.name: io.BytesIO(p.read_bytes()) for p in good_adapter_dir.iterdir()}
    uploads = [Upload(name=n, stream=s, size=len(s.getvalue())) for n, s in streams.items()]
    precheck_upload(uploads, sent_as_archive=False, limits=ArchiveLimits(), max_lora_rank=16)
    assert all(s.tell() == 0 for s in streams.values())
