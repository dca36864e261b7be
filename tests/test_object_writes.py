# ruff: noqa: F811 - pytest fixtures imported from s3_server are used as parameters
"""Streaming shard writes to object stores (ckptd.storage.object_writes).

On the moto S3 server: a multi-part shard round-trips bit-exact through a real save and
load, its parts are uploaded while the shard is still being written, the handle never
holds more than (parts in flight + parts partly filled), and an abort or a failed part
leaves neither an object nor a pending multipart upload. On memory://: the in-order
path holds only out-of-order windows and shows nothing until finish.
"""

from __future__ import annotations

import asyncio
import errno
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import s3fs
import torch
from ckpt_testutil import assert_same
from s3_server import s3_bucket, s3_server  # noqa: F401 - fixtures

import ckpt
from ckptd import knobs
from ckptd.format import layout
from ckptd.storage import counters, open_storage
from ckptd.storage.fsspec_store import FsspecStorage
from ckptd.storage.object_writes import MultipartWriteHandle, SequentialWriteHandle

MiB = 1 << 20
# Small windows and parts so that a test-sized shard has many of each.
SMALL = {"io_window": MiB, "upload_part_size": 5 * MiB, "upload_concurrency": 2, "io_threads": 2}


def big_state(mib: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(mib * MiB // 8, generator=g),  # half of it, float32
        "b": torch.randn(mib * MiB // 16, generator=g).to(torch.float64),  # the other half
        "small": torch.arange(7, dtype=torch.int16),
    }


def pending_uploads(s3_server, bucket: str) -> list[str]:
    ups = s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return [u["Key"] for u in ups]


def objects(s3_server, bucket: str) -> list[str]:
    out = s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return [o["Key"] for o in out]


@pytest.fixture
def handles(monkeypatch) -> list[Any]:
    """Every write handle an FsspecStorage opens in this test."""
    opened: list[Any] = []
    real = FsspecStorage.open_write

    def open_write(self, path, size, **kw):  # noqa: ANN001, ANN202 - the real signature
        h = real(self, path, size, **kw)
        opened.append(h)
        return h

    monkeypatch.setattr(FsspecStorage, "open_write", open_write)
    return opened


def test_s3_multipart_shard_streams_and_round_trips(s3_server, s3_bucket, handles, monkeypatch):
    url = f"s3://{s3_bucket}/job"
    state = big_state(48)  # 48 MiB of tensors: ten 5 MiB parts
    # What the server holds of the shard's upload at the moment finish() is called.
    parts_before_finish: list[int] = []
    real_finish = MultipartWriteHandle.finish

    def finish(self: MultipartWriteHandle) -> None:
        ups = s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
        for u in ups:
            got = s3_server.client().list_parts(
                Bucket=s3_bucket, Key=u["Key"], UploadId=u["UploadId"]
            )
            parts_before_finish.append(len(got.get("Parts", [])))
        real_finish(self)

    monkeypatch.setattr(MultipartWriteHandle, "finish", finish)
    before = counters.snapshot()
    with knobs.override(**SMALL):
        ckpt.save(state, url, step=1)
    wrote = counters.snapshot() - before
    [h] = [h for h in handles if h.path.endswith(".bin")]
    assert isinstance(h, MultipartWriteHandle) and h.n_parts >= 10, h.n_parts
    # The parts went up while the writer was still writing: all but those in flight were
    # on the server before finish() (a shard held whole uploads only at finish()).
    assert parts_before_finish and parts_before_finish[0] >= h.n_parts - h.concurrency - 1
    # Held at most: the parts in flight plus those the writer's threads were filling.
    bound = h.part_size * (h.concurrency + SMALL["io_threads"] + 1)
    assert 0 < h.high_water <= bound < h.size, (h.high_water, bound, h.size)
    assert h.buffered == 0
    # Counted where the bytes reached the store: the shard once, part by part.
    assert wrote.written_bytes == h.size, (wrote, h.size)
    assert wrote.write_calls == h.n_parts
    key = f"job/{h.path}"
    head = s3_server.client().head_object(Bucket=s3_bucket, Key=key)
    assert head["ETag"].strip('"').endswith(f"-{h.n_parts}")
    assert head["ContentLength"] == h.size
    assert pending_uploads(s3_server, s3_bucket) == []
    assert_same(ckpt.load({}, url).state, state)


def test_s3_abort_mid_upload_leaves_no_object_and_no_upload(
    s3_server, s3_bucket, monkeypatch, tally
):
    url = f"s3://{s3_bucket}/job"
    ckpt.save({"w": torch.arange(10.0)}, url, step=1)
    # The writer fails after 30 windows (30 MiB): parts are on the server by then.
    calls: list[int] = []
    seen_parts: list[int] = []
    real_write = MultipartWriteHandle.write

    def write(self: MultipartWriteHandle, offset: int, length: int, pieces: Any) -> None:
        calls.append(offset)
        if len(calls) == 30:
            deadline = time.monotonic() + 10
            while len(self._etags) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            seen_parts.append(len(self._etags))
            raise OSError(errno.EIO, "injected: the staging buffer went away")
        real_write(self, offset, length, pieces)

    monkeypatch.setattr(MultipartWriteHandle, "write", write)
    with tally.fault("s3-writer-fails-mid-upload"):
        with knobs.override(**SMALL), pytest.raises(ckpt.StorageError) as ei:
            ckpt.save(big_state(48, seed=1), url, step=2)
        assert seen_parts and seen_parts[0] >= 3, "no part was uploaded before the failure"
        assert "step 2" in str(ei.value) and "rank-00000" in str(ei.value), ei.value
        assert pending_uploads(s3_server, s3_bucket) == []
        step2 = f"job/{layout.step_dir(2)}/"
        assert [k for k in objects(s3_server, s3_bucket) if k.startswith(step2)] == []
        assert ckpt.load({}, url).step == 1


def test_s3_failed_part_fails_the_save_with_a_clear_error(s3_server, s3_bucket, monkeypatch, tally):
    url = f"s3://{s3_bucket}/job"
    ckpt.save({"w": torch.arange(10.0)}, url, step=1)
    real_call = s3fs.S3FileSystem._call_s3
    failed: list[int] = []

    async def call_s3(self, method, *args, **kwargs):  # noqa: ANN001, ANN202 - s3fs's
        if method == "upload_part" and kwargs.get("PartNumber") == 3:
            failed.append(3)
            raise OSError(errno.ECONNRESET, "injected: Connection reset by peer")
        return await real_call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    with tally.fault("s3-part-upload-fails"):
        with knobs.override(**SMALL), pytest.raises(ckpt.StorageError) as ei:
            ckpt.save(big_state(48, seed=2), url, step=2)
        assert failed
        msg = str(ei.value)
        assert f"{url}/{layout.step_dir(2)}/shards/rank-00000" in msg, msg
        assert "part 3" in msg and "Connection reset by peer" in msg, msg
        assert "aborted" in msg and "retry" in msg, msg
        assert pending_uploads(s3_server, s3_bucket) == []
        step2 = f"job/{layout.step_dir(2)}/"
        assert [k for k in objects(s3_server, s3_bucket) if k.startswith(step2)] == []
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", real_call)
    assert ckpt.load({}, url).step == 1


def _windows(size: int, window: int) -> list[tuple[int, int]]:
    return [(o, min(window, size - o)) for o in range(0, size, window)]


def _write_all(h: Any, data: np.ndarray, windows: list[tuple[int, int]], threads: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(h.write, o, n, [(o, data[o : o + n])]) for o, n in windows]:
            f.result()


def test_s3_handle_memory_is_bounded_while_the_store_is_slow(s3_bucket, monkeypatch):
    # Slow part uploads: the writer's threads wait for a slot instead of piling up parts.
    real_call = s3fs.S3FileSystem._call_s3

    async def slow(self, method, *args, **kwargs):  # noqa: ANN001, ANN202 - s3fs's
        if method == "upload_part":
            await asyncio.sleep(0.05)
        return await real_call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", slow)
    st = open_storage(f"s3://{s3_bucket}/job")
    data = np.random.default_rng(3).integers(0, 255, 60 * MiB, dtype=np.uint8)
    with knobs.override(**SMALL):
        h = st.open_write("x.bin", data.nbytes)
    assert isinstance(h, MultipartWriteHandle) and h.n_parts == 12
    _write_all(h, data, _windows(data.nbytes, MiB), threads=4)
    h.finish()
    assert h.high_water <= h.part_size * (h.concurrency + 4 + 1), h.high_water
    assert st.read_bytes("x.bin", limit=data.nbytes) == data.tobytes()


def test_s3_handle_unwritten_ranges_are_zeros(s3_server, s3_bucket):
    # A sparse layout leaves ranges no window writes: whole parts and parts of parts.
    st = open_storage(f"s3://{s3_bucket}/job")
    size = 23 * MiB
    data = np.random.default_rng(4).integers(0, 255, size, dtype=np.uint8)
    written = [(0, 3 * MiB), (7 * MiB, 2 * MiB), (20 * MiB, 3 * MiB)]
    with knobs.override(**SMALL):
        h = st.open_write("holes.bin", size)
    for o, n in written:
        h.write(o, n, [(o, data[o : o + n])])
    h.finish()
    want = np.zeros(size, dtype=np.uint8)
    for o, n in written:
        want[o : o + n] = data[o : o + n]
    assert st.read_bytes("holes.bin", limit=size) == want.tobytes()
    assert pending_uploads(s3_server, s3_bucket) == []


def test_s3_handle_abort_after_parts_went_up(s3_server, s3_bucket):
    st = open_storage(f"s3://{s3_bucket}/job")
    data = np.random.default_rng(5).integers(0, 255, 30 * MiB, dtype=np.uint8)
    with knobs.override(**SMALL):
        h = st.open_write("a.bin", data.nbytes)
    _write_all(h, data, _windows(15 * MiB, MiB), threads=2)  # three whole parts
    deadline = time.monotonic() + 10
    while len(h._etags) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    [key] = pending_uploads(s3_server, s3_bucket)
    assert key == "job/a.bin"
    h.abort()
    assert pending_uploads(s3_server, s3_bucket) == []
    assert not st.exists("a.bin")
    assert h.buffered == 0
    with pytest.raises(ckpt.StorageError, match="already finished or aborted"):
        h.write(15 * MiB, MiB, [(15 * MiB, data[15 * MiB : 16 * MiB])])


def test_s3_small_shard_is_one_put(s3_server, s3_bucket):
    st = open_storage(f"s3://{s3_bucket}/job")
    data = np.arange(3 * MiB, dtype=np.uint8)
    with knobs.override(**SMALL):
        h = st.open_write("s.bin", data.nbytes)
    assert isinstance(h, MultipartWriteHandle) and h.n_parts == 1
    _write_all(h, data, _windows(data.nbytes, MiB), threads=2)
    assert pending_uploads(s3_server, s3_bucket) == [] and not st.exists("s.bin")
    h.finish()
    head = s3_server.client().head_object(Bucket=s3_bucket, Key="job/s.bin")
    assert "-" not in head["ETag"].strip('"')  # a PUT, not a multipart upload
    assert st.read_bytes("s.bin", limit=data.nbytes) == data.tobytes()


# ----------------------------------------------------------------------------- memory://


def test_memory_handle_holds_only_windows_ahead_of_the_frontier(mem_url):
    st = open_storage(mem_url)
    size = 16 * MiB
    data = np.random.default_rng(6).integers(0, 255, size, dtype=np.uint8)
    h = st.open_write("m.bin", size)
    assert isinstance(h, SequentialWriteHandle)
    # Out of order: each pair swapped, so one window waits at a time.
    order = _windows(size, MiB)
    for i in range(0, len(order), 2):
        for o, n in (order[i + 1], order[i]):
            h.write(o, n, [(o, data[o : o + n])])
            assert not st.exists("m.bin")  # nothing visible before finish
    # Held: the window waiting, and the one that completes the run while it is copied in.
    assert h.high_water == 2 * MiB, h.high_water
    h.finish()
    assert st.read_bytes("m.bin", limit=size) == data.tobytes()
    assert st.listdir("") == ["m.bin"]


def test_memory_handle_concurrent_writes_holes_and_abort(mem_url):
    st = open_storage(mem_url)
    size = 9 * MiB + 123
    data = np.random.default_rng(7).integers(0, 255, size, dtype=np.uint8)
    windows = [w for i, w in enumerate(_windows(size, MiB)) if i != 4]  # a hole at 4 MiB
    h = st.open_write("h.bin", size)
    _write_all(h, data, windows, threads=4)
    h.finish()
    want = data.copy()
    want[4 * MiB : 5 * MiB] = 0
    assert st.read_bytes("h.bin", limit=size) == want.tobytes()
    # An abort leaves nothing, not even the temporary.
    h2 = st.open_write("g.bin", size)
    _write_all(h2, data, _windows(3 * MiB, MiB), threads=2)
    h2.abort()
    assert st.listdir("") == ["h.bin"]
