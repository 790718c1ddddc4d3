"""A real S3-protocol server for the suite: moto's standalone server on a free local port, one per session.

`s3_server` starts it (and stops it at the end); `s3_store` points the artifact store at a fresh bucket of it
for one test, configured the way `MINT_STORAGE=s3` configures it (mint_site/settings.py), with the test's
credentials. Every byte goes over HTTP through django-storages and boto3, as against any S3 service.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from devtools.supervisor import free_port, wait_for

CREDENTIALS = {"access_key": "mint-test", "secret_key": "mint-test-secret"}
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    url: str

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=CREDENTIALS["access_key"],
            aws_secret_access_key=CREDENTIALS["secret_key"],
        )


@dataclass(frozen=True)
class S3Store:
    server: S3Server
    bucket: str

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under `prefix`, read from the server itself (not through the store)."""
        pages = self.server.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def digests(self, prefix: str) -> dict[str, str]:
        """The SHA-256 of every object under `prefix`, by key, read from the server itself."""
        client = self.server.client()
        return {
            key: hashlib.sha256(client.get_object(Bucket=self.bucket, Key=key)["Body"].read()).hexdigest()
            for key in self.keys(prefix)
        }

    def put(self, key: str, path: Path) -> None:
        self.server.client().upload_file(str(path), self.bucket, key)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = S3Server(f"http://127.0.0.1:{port}")
    try:
        wait_for(lambda: _answers(f"{server.url}/moto-api/"), timeout=60, what="the S3 server (moto) to answer")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture
def s3_store(s3_server, settings) -> S3Store:
    """The artifact store on a fresh bucket of the session's S3 server, for one test."""
    bucket = f"mint-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    settings.STORAGES = settings.STORAGES | {
        "artifacts": {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {
                "bucket_name": bucket,
                "endpoint_url": s3_server.url,
                "region_name": REGION,
                "default_acl": None,
                "file_overwrite": False,
                **CREDENTIALS,
            },
        }
    }
    settings.MINT_WORK_DIR = None
    return S3Store(s3_server, bucket)
