"""Real object-store servers for tests, each started here: S3 (moto, tests/s3_server.py),
GCS (gcp-storage-emulator, in-process) and Azure Blob (Azurite, a node process).

`object_store` is parametrized over the three: a test gets a `Store` with a fresh bucket
(container), the job URL to hand to ckptd, and `put_raw` for another client writing
behind ckptd's back. Endpoints and credentials go into the environment (and fsspec's
config) as a real deployment's would, so the code under test opens the store from its
URL alone.

A server that cannot be had is a skip that says why: gcsfs or gcp-storage-emulator not
installed (`pip install -e .[dev,gcs]`); adlfs not installed, or no `node` or Azurite (the
tests install Azurite with npm into $CKPTD_TEST_CACHE/azurite, default
~/.cache/ckptd-tests, once; offline and not there: skip).

gcp-storage-emulator ignores `ifGenerationMatch`; GCS honours `ifGenerationMatch=0` by
refusing with 412 when the object exists, and the fixture adds just that to the
emulator's uploads, so that a create-only manifest write there is tested as the server's
refusal, as on GCS.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import pytest
from s3_server import S3Server

# Before gcsfs is first imported: its experimental gRPC probe of each bucket waits 60 s
# on an emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
AZURITE_VERSION = "3.35.0"


@dataclasses.dataclass
class Store:
    name: str  # s3 | gcs | azure
    scheme: str  # s3 | gs | az
    bucket: str
    put_raw: Callable[[str, bytes], None]  # key under the bucket, bytes: another client
    list_raw: Callable[[], list[str]]

    def url(self, job: str = "job") -> str:
        return f"{self.scheme}://{self.bucket}/{job}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


# ---------------------------------------------------------------------------------- GCS


def _conditional_uploads(objects: object) -> None:
    """Make the emulator refuse a simple upload with ifGenerationMatch=0 when the object
    exists (412), as GCS does."""
    from http import HTTPStatus

    # An optional test dependency: imported only once the emulator is there.
    from gcp_storage_emulator.exceptions import NotFound

    original = objects._multipart_upload  # type: ignore[attr-defined]
    if getattr(original, "conditional", False):
        return

    def upload(request, response, storage):  # type: ignore[no-untyped-def]
        if request.query.get("ifGenerationMatch") == ["0"]:
            name = request.query.get("name", [request.data["meta"].get("name")])[0]
            try:
                storage.get_file_obj(request.params["bucket_name"], name)
            except NotFound:
                pass
            else:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                return None
        return original(request, response, storage)

    upload.conditional = True  # type: ignore[attr-defined]
    objects._multipart_upload = upload  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    gcsfs = pytest.importorskip("gcsfs", reason="gcsfs is not installed (pip install -e .[gcs])")
    server_mod = pytest.importorskip(
        "gcp_storage_emulator.server",
        reason="gcp-storage-emulator is not installed (pip install -e .[dev])",
    )
    from gcp_storage_emulator.handlers import objects  # importorskip'ed just above

    _conditional_uploads(objects)
    port = free_port()
    server = server_mod.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "STORAGE_EMULATOR_HOST": endpoint,
        "FSSPEC_GCS_TOKEN": "anon",
        "FSSPEC_GCS_PROJECT": "ckptd-tests",
    }
    saved = {k: os.environ.get(k) for k in env}
    saved_conf = fsspec.config.conf.get("gcs")
    os.environ.update(env)
    fsspec.config.conf["gcs"] = {"token": "anon", "project": "ckptd-tests"}
    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("gcs", None)
        else:
            fsspec.config.conf["gcs"] = saved_conf
        gcsfs.GCSFileSystem.clear_instance_cache()
        server.stop()


def _gcs_store(endpoint: str) -> Store:
    import gcsfs  # optional: the gcs_endpoint fixture skipped when it is missing

    fs = gcsfs.GCSFileSystem(token="anon", project="ckptd-tests", endpoint_url=endpoint)
    bucket = f"ckptd-{uuid.uuid4().hex[:20]}"
    fs.mkdir(bucket)
    return Store(
        "gcs",
        "gs",
        bucket,
        put_raw=lambda key, data: fs.pipe_file(f"{bucket}/{key}", data),
        list_raw=lambda: sorted(str(p)[len(bucket) + 1 :] for p in fs.find(bucket)),
    )


# -------------------------------------------------------------------------------- Azure


def _azurite_main() -> Path:
    """Azurite's blob server script, installed with npm into the test cache if missing."""
    cache = (
        Path(os.environ.get("CKPTD_TEST_CACHE", Path.home() / ".cache" / "ckptd-tests")) / "azurite"
    )
    main = cache / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"
    if main.exists():
        return main
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        pytest.skip("Azurite needs node and npm (apt-get install nodejs npm)")
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [
            npm,
            "install",
            "--no-audit",
            "--no-fund",
            "--prefix",
            str(cache),
            f"azurite@{AZURITE_VERSION}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not main.exists():
        pytest.skip(f"could not install Azurite with npm: {proc.stderr[-500:]}")
    return main


@pytest.fixture(scope="session")
def azure_connection() -> Iterator[str]:
    adlfs = pytest.importorskip("adlfs", reason="adlfs is not installed (pip install -e .[azure])")
    main = _azurite_main()
    port = free_port()
    proc = subprocess.Popen(
        [
            "node",
            str(main),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--loose",
            "--disableTelemetry",
            "--silent",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_port(port, "Azurite")
    except RuntimeError:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.skip(f"Azurite did not start: {err.decode(errors='replace')[-500:]}")
    conn = (
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
        f"AccountKey={AZURITE_KEY};BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
    )
    saved = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = conn
    adlfs.AzureBlobFileSystem.clear_instance_cache()
    try:
        yield conn
    finally:
        if saved is None:
            os.environ.pop("AZURE_STORAGE_CONNECTION_STRING", None)
        else:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = saved
        adlfs.AzureBlobFileSystem.clear_instance_cache()
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def _azure_store(conn: str) -> Store:
    import adlfs  # optional: the azure_connection fixture skipped when it is missing

    fs = adlfs.AzureBlobFileSystem(connection_string=conn)
    container = f"ckptd-{uuid.uuid4().hex[:20]}"
    fs.mkdir(container)
    return Store(
        "azure",
        "az",
        container,
        put_raw=lambda key, data: fs.pipe_file(f"{container}/{key}", data),
        list_raw=lambda: sorted(str(p)[len(container) + 1 :] for p in fs.find(container)),
    )


# ----------------------------------------------------------------------------------- S3


def _s3_store(s3: S3Server) -> Store:
    bucket = s3.new_bucket()
    client = s3.client()

    def list_raw() -> list[str]:
        return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))

    return Store(
        "s3",
        "s3",
        bucket,
        put_raw=lambda key, data: client.put_object(Bucket=bucket, Key=key, Body=data),
        list_raw=list_raw,
    )


@pytest.fixture(params=["s3", "gcs", "azure"])
def object_store(request: pytest.FixtureRequest) -> Store:
    """A fresh bucket on each real server in turn."""
    if request.param == "s3":
        return _s3_store(request.getfixturevalue("s3_server"))
    if request.param == "gcs":
        return _gcs_store(request.getfixturevalue("gcs_endpoint"))
    return _azure_store(request.getfixturevalue("azure_connection"))
