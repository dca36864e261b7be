"""A real S3-compatible server for tests: moto's ThreadedMotoServer on 127.0.0.1.

Tests talk to it over HTTP through s3fs/botocore exactly as they would to S3; the
endpoint and (fake) credentials go into the environment so that subprocesses (ranks,
ckptctl, a process killed mid-upload) reach the same server. Skips when moto or s3fs
is not installed (`pip install -e .[dev,s3]`).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclasses.dataclass
class S3Server:
    endpoint: str

    def env(self) -> dict[str, str]:
        return {**ENV, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"ckptd-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e .[s3])")
    moto_server = pytest.importorskip(
        "moto.moto_server.threaded_moto_server", reason="moto[server] is not installed"
    )
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}")
    saved = {k: os.environ.get(k) for k in s3.env()}
    os.environ.update(s3.env())
    try:
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket per test."""
    return s3_server.new_bucket()
