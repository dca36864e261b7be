# ruff: noqa: F811 - pytest fixtures imported from s3_server are used as parameters
"""The fsspec path on a real S3-compatible server (moto, over HTTP on localhost).

The Storage contract, save/load/verify round trips, create-only manifests
(If-None-Match: *), and a process SIGKILLed in the middle of a multipart upload.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch
from ckpt_testutil import assert_same
from s3_server import s3_bucket, s3_server  # noqa: F401 - fixtures
from test_storage_fsspec import StorageContract, state_for

import ckpt
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import Storage, open_storage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TestS3Storage(StorageContract):
    reuses, local = False, False

    @pytest.fixture
    def storage(self, s3_bucket) -> Iterator[Storage]:
        yield open_storage(f"s3://{s3_bucket}/job")

    def test_remove_tree_and_rename(self, storage):
        # Object stores have no empty directories: a prefix exists while an object lies
        # under it, so "u" must hold a file to be listed after "f" moved out of it.
        storage.write_atomic("t/u/f", b"1")
        storage.write_atomic("t/u/keep", b"2")
        storage.rename("t/u/f", "t/g")
        assert storage.listdir("t") == ["g", "u"]
        assert storage.read_bytes("t/g", limit=10) == b"1"
        storage.remove_tree("t")
        assert not storage.exists("t")

    def test_create_only_is_the_servers_check(self, storage, s3_server, s3_bucket):
        # The object appears between our (absent) check and the PUT: only the server's
        # If-None-Match can refuse it. Another client writes it directly.
        s3_server.client().put_object(Bucket=s3_bucket, Key="job/r/MANIFEST.json", Body=b"other")
        storage.exists = lambda path: False  # no client-side check can save us
        with pytest.raises(ckpt.CheckpointExists):
            storage.create_only("r/MANIFEST.json", b"mine")
        assert storage.read_bytes("r/MANIFEST.json", limit=100) == b"other"

    def test_multipart_upload(self, storage, s3_server, s3_bucket):
        from ckptd import knobs

        data = os.urandom(11 << 20)
        with knobs.override(upload_part_size=5 << 20):
            h = storage.open_write("m/x.bin", len(data))
            import numpy as np

            h.write(0, len(data), [(0, np.frombuffer(data, dtype=np.uint8))])
            h.finish()
        head = s3_server.client().head_object(Bucket=s3_bucket, Key="job/m/x.bin")
        assert head["ETag"].strip('"').endswith("-3")  # three parts: a multipart upload
        assert storage.read_bytes("m/x.bin", limit=len(data)) == data


def test_s3_save_load_verify_roundtrip(s3_bucket, run_ckptctl, ckptctl):
    url = f"s3://{s3_bucket}/runs/job"
    states = {s: state_for(s) for s in (1, 2, 3)}
    for s, st in states.items():
        r = ckpt.save(st, url, step=s, keep_last=2, metadata={"where": "s3"})
        assert r.path == f"{url}/{layout.step_dir(s)}"
    lr = ckpt.load({}, url)
    assert lr.step == 3 and lr.metadata == {"where": "s3"}
    assert_same(lr.state, states[3])
    assert_same(ckpt.load({}, url, step=2).state, states[2])
    st = open_storage(url)
    assert [s.step for s in ckfmt.list_steps(st)] == [2, 3]
    with pytest.raises(ckpt.CheckpointExists):
        ckpt.save(states[3], url, step=3)
    # ckptctl in another process, through the same endpoint (environment).
    rc, out, err = run_ckptctl("verify", url, "--all", "--json")
    assert rc == 0, err
    assert [s["step"] for s in json.loads(out)["steps"]] == [2, 3]
    # A flipped byte on the server is caught by verify and by load.
    import boto3

    c = boto3.client("s3")
    mkey = f"runs/job/{layout.step_dir(3)}/{layout.MANIFEST_NAME}"
    manifest = json.loads(c.get_object(Bucket=s3_bucket, Key=mkey)["Body"].read())
    key = f"runs/job/{layout.step_dir(3)}/{manifest['shards'][0]['path']}"  # rank 0's shard
    body = bytearray(c.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[100] ^= 1
    c.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    rc, out, _ = ckptctl("verify", url, "--step", "3")
    assert rc == 1 and key.rsplit("/", 1)[-1] in out
    with pytest.raises(ckpt.HashMismatch):
        ckpt.load({}, url, step=3)


def test_checkpointer_on_s3(s3_bucket, tmp_path, monkeypatch):
    # The embedded coordinator's catalog cannot live in the bucket: a local directory.
    monkeypatch.setenv("CKPTD_CATALOG_DIR", str(tmp_path / "catalogs"))
    url = f"s3://{s3_bucket}/runs/job"
    with ckpt.Checkpointer(url, keep_last=2) as cp:
        for s in (1, 2, 3):
            r = cp.save(state_for(s), s).wait()  # asynchronous, committed by the coordinator
            assert r is not None and r.path == f"{url}/{layout.step_dir(s)}"
    assert [s.step for s in ckfmt.list_steps(open_storage(url))] == [2, 3]
    assert list((tmp_path / "catalogs").glob("*/catalog.sqlite"))
    target = {"model": {"w": torch.zeros(3000), "b": torch.zeros(5, dtype=torch.bfloat16)}}
    with ckpt.Checkpointer(url) as cp:
        assert cp.resume(target, strict=False) == 3
    assert_same(target["model"], state_for(3)["model"])


_UPLOADER = textwrap.dedent(
    """
    import sys, torch, ckpt
    from ckptd import knobs
    url = sys.argv[1]
    ckpt.save({"w": torch.arange(1000, dtype=torch.float32)}, url, step=1)
    print("step 1 committed", flush=True)
    big = {"w": torch.randn((40 << 20) // 4, generator=torch.Generator().manual_seed(2))}
    with knobs.override(upload_part_size=5 << 20, upload_concurrency=1):
        ckpt.save(big, url, step=2, verify="size")
    print("step 2 committed (the kill came too late)", flush=True)
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("next_step", [3, 2])  # a later step, or the killed one again
def test_kill_during_multipart_upload(s3_server, s3_bucket, tmp_path, ckptctl, next_step):
    url = f"s3://{s3_bucket}/job"
    script = tmp_path / "uploader.py"
    script.write_text(_UPLOADER)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO}/clients/python"}
    proc = subprocess.Popen(
        [sys.executable, str(script), url], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    client = s3_server.client()
    parts = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            ups = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
            if ups:
                u = ups[0]
                parts = len(
                    client.list_parts(Bucket=s3_bucket, Key=u["Key"], UploadId=u["UploadId"]).get(
                        "Parts", []
                    )
                )
                if parts >= 1:
                    break
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (out, err[-3000:])
    assert parts >= 1, f"no multipart upload was seen in progress: {out!r} {err[-2000:]!r}"
    assert b"step 2 committed" not in out
    # The half-uploaded shard is not an object: nothing of step 2 is visible as committed.
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert not any(k.startswith(f"job/{layout.step_dir(2)}/") and k.endswith(".bin") for k in keys)
    assert f"job/{layout.step_dir(2)}/{layout.MANIFEST_NAME}" not in keys
    st = open_storage(url)
    assert [(s.step, s.status) for s in ckfmt.list_steps(st) if s.status == ckfmt.COMMITTED] == [
        (1, ckfmt.COMMITTED)
    ]
    lr = ckpt.load({}, url)
    assert lr.step == 1
    assert torch.equal(lr.state["w"], torch.arange(1000, dtype=torch.float32))
    # The parts already sent linger until aborted (a bucket lifecycle rule does it in
    # production); they are never part of a checkpoint.
    ups = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    [lingering] = [u["Key"] for u in ups]  # rank 0's shard of step 2 (its generation named)
    assert re.fullmatch(rf"job/{layout.step_dir(2)}/shards/rank-00000(\.g\d+)?\.bin", lingering)
    # The step is listed (its unfinished upload is an entry): ckptctl gc lists the upload
    # and keeps it while a save of a step newer than the newest commit may be running ...
    assert 2 in [s.step for s in ckfmt.list_steps(st)]
    rc, out, _ = ckptctl("gc", url)
    assert rc == 0 and f"kept unfinished upload {layout.step_dir(2)}/shards/" in out, out
    assert [u.path for u in st.pending_uploads()] == [lingering.removeprefix("job/")]
    # ... and the next save removes it: a later step's commit makes step 2 debris below
    # the live line's newest step, which its retention removes with the upload; a save of
    # step 2 again first aborts the killed attempt (the coordinator's recovery removes
    # its files). Nothing is left to bill.
    ckpt.save({"w": torch.ones(10)}, url, step=next_step)
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert ckptctl("gc", url)[1] == "nothing to remove\n"
    assert ckpt.load({}, url).step == next_step


def test_gc_aborts_uploads_that_belong_to_nothing(s3_server, s3_bucket, ckptctl):
    # An upload under a committed step (a rank's abort that failed after a retry of the
    # save committed) or outside any step is a stray: gc lists it, --dry-run keeps it.
    url = f"s3://{s3_bucket}/job"
    ckpt.save({"w": torch.ones(10)}, url, step=1)
    client = s3_server.client()
    for key in (f"job/{layout.step_dir(1)}/shards/rank-00001.bin", "job/elsewhere/x.bin"):
        client.create_multipart_upload(Bucket=s3_bucket, Key=key)
    rc, out, _ = ckptctl("gc", "--dry-run", url)
    assert rc == 0 and out.count("would abort unfinished upload") == 2, out
    assert len(client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]) == 2
    rc, out, _ = ckptctl("gc", url)
    assert f"aborted unfinished upload {layout.step_dir(1)}/shards/rank-00001.bin" in out, out
    assert "aborted unfinished upload elsewhere/x.bin (outside any step)" in out, out
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert ckpt.load({}, url).step == 1
