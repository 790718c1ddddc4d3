"""Hostile review of issue 16's upload precheck, duplicate refusal, retry and Idempotency-Key additions."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.models import AdapterRevision
from tests.adapters.corpus import lora_config

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions/"


def _zip(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def _bad_zips() -> dict[str, bytes]:
    good = _zip({"adapter_config.json": json.dumps(lora_config()).encode(), "a.safetensors": b"x"})
    eocd = good.rindex(b"PK\x05\x06")
    cases = {}
    # directory offset past the end of the file; directory size larger than the file
    cases["offset past end"] = good[: eocd + 16] + struct.pack("<I", 10**9) + good[eocd + 20 :]
    cases["size past end"] = good[: eocd + 12] + struct.pack("<I", 10**6) + good[eocd + 16 :]
    cases["entries zero"] = good[: eocd + 8] + struct.pack("<HH", 0, 0) + good[eocd + 12 :]
    cases["truncated directory"] = good[: eocd - 10] + good[eocd:]
    cases["only eocd"] = good[eocd:]
    cases["unicode names"] = _zip({"ädäptér/adapter_config.json": b"{}", "ädäptér/ä.safetensors": b"x"})
    return cases


@pytest.mark.parametrize("case", list(_bad_zips()))
def test_a_damaged_zip_is_a_400_not_a_server_error(tenant_a, adapter_a, artifact_root, case):
    data = _bad_zips()[case]
    response = tenant_a.client_as("key:pipeline").post(
        URL, {"archive": SimpleUploadedFile("a.zip", data)}, format="multipart"
    )
    assert response.status_code in (201, 400), (case, response.status_code, response.content[:300])


@pytest.mark.parametrize(
    "config",
    [
        b'{"r": 1e400, "lora_alpha": 8, "peft_type": "LORA", "target_modules": ["q_proj"]}',
        b'{"r": 99999999999999999999999999, "lora_alpha": 8, "peft_type": "LORA", "target_modules": ["q_proj"]}',
        b'{"r": true, "lora_alpha": 8, "peft_type": "LORA", "target_modules": ["q_proj"]}',
        b'{"r": "8", "lora_alpha": 8, "peft_type": "LORA", "target_modules": ["q_proj"]}',
        b'{"r": -4, "lora_alpha": 8, "peft_type": "LORA", "target_modules": ["q_proj"]}',
        b"\xff\xfe{\x00}\x00",
        b'{"r": NaN}',
        b"[]",
        b"\xef\xbb\xbf{}",
        b'"\\ud800"',
    ],
)
def test_a_strange_config_is_a_400_not_a_server_error(tenant_a, adapter_a, artifact_root, config):
    files = [SimpleUploadedFile("adapter_config.json", config), SimpleUploadedFile("a.safetensors", b"x")]
    response = tenant_a.client_as("key:pipeline").post(URL, {"files": files}, format="multipart")
    assert response.status_code in (201, 400), (response.status_code, response.content[:300])
    if response.status_code == 400:
        assert not AdapterRevision.objects.filter(adapter=adapter_a).exists()
