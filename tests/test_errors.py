"""Errors a training loop can meet, and what they leave behind.

Committed steps are never overwritten; a missing checkpoint is an error, never a silent
fresh start; a load that does not fit the state changes nothing; a failed save (bad
value, full disk, torn write, silent corruption, failed commit) leaves no step directory
and the previous checkpoint loads bit for bit; retention keeps the newest committed step.
Faults are injected with real means: RLIMIT_FSIZE for EFBIG from the kernel, and a
faulty Storage wrapper around the real local storage.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_testutil import (
    DelegatingStorage,
    DelegatingWriteHandle,
    assert_same,
    edit_manifest,
    index_entries,
    list_files,
    manifest_path,
    shard_path,
    step_path,
    tensor_raw,
)

import ckpt
import ckpt._api
import ckptd.coordinator.core
from ckptd import errors, knobs
from ckptd.format import layout, recycle
from ckptd.storage import open_storage
from ckptd.storage.base import Piece, Storage, WriteHandle


def state_for(step: int, n: int = 64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(3, generator=g), "step": step}


def step_dirs(job: str) -> list[str]:
    return (
        sorted(d for d in os.listdir(job) if d.startswith(layout.STEP_PREFIX))
        if os.path.isdir(job)
        else []
    )


def committed(job: str) -> list[int]:
    return [
        int(d[5:])
        for d in step_dirs(job)
        if os.path.exists(os.path.join(job, d, layout.MANIFEST_NAME))
    ]


# ----------------------------------------------------------------------------- the tree


def test_error_tree():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.CkptError), name
    assert issubclass(errors.CheckpointNotFound, FileNotFoundError)
    assert issubclass(errors.CheckpointExists, FileExistsError)
    assert issubclass(errors.ShardMissing, errors.CorruptCheckpoint)
    assert issubclass(errors.ShardMissing, FileNotFoundError)
    assert issubclass(errors.InvalidManifest, errors.CorruptCheckpoint)
    assert issubclass(errors.InvalidManifest, ValueError)
    assert issubclass(errors.HashMismatch, errors.CorruptCheckpoint)
    assert issubclass(errors.ShardSizeMismatch, errors.CorruptCheckpoint)
    assert issubclass(errors.UnsafePath, PermissionError)
    assert issubclass(errors.UnsupportedValue, TypeError)
    assert issubclass(errors.StateMismatch, KeyError)
    assert issubclass(errors.StorageError, OSError)
    # StateMismatch keeps KeyError's type but not its quoting.
    assert str(errors.StateMismatch("a 'b'")) == "a 'b'"


def test_every_error_class_is_listed():
    classes = {
        n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    assert classes == set(errors.__all__)


# ----------------------------------------------------------------------------- exists / not found


def test_saving_over_a_committed_step_is_refused(job):
    first = state_for(1)
    ckpt.save(first, job, step=1)

    def checkpoint_files() -> dict[str, float]:  # the coordinator's catalog (.ckptd/) aside
        return {
            p: os.path.getmtime(os.path.join(job, p))
            for p in list_files(job)
            if not p.startswith(".ckptd/")
        }

    before = checkpoint_files()
    with pytest.raises(ckpt.CheckpointExists) as ei:
        ckpt.save(state_for(99), job, step=1)
    assert isinstance(ei.value, FileExistsError)
    assert layout.step_dir(1) in str(ei.value)
    assert checkpoint_files() == before
    assert_same(ckpt.load({}, job).state, first)


def test_a_step_left_incomplete_can_be_saved_again(job):
    os.makedirs(os.path.join(step_path(job, 4), "shards"))
    with open(shard_path(job, 4), "wb") as f:
        f.write(b"torn")
    ckpt.save(state_for(4), job, step=4)
    assert_same(ckpt.load({}, job).state, state_for(4))


def test_load_from_nothing(tmp_path):
    with pytest.raises(ckpt.CheckpointNotFound):
        ckpt.load({}, str(tmp_path / "does-not-exist"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointNotFound) as ei:
        ckpt.load({}, str(tmp_path / "empty"))
    assert isinstance(ei.value, FileNotFoundError)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "step-12").mkdir()  # not a step directory name
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ckpt.CheckpointNotFound):
        ckpt.load({}, str(tmp_path / "other"))


def test_load_with_only_debris_says_so(job):
    os.makedirs(os.path.join(step_path(job, 3), "shards"))
    with pytest.raises(ckpt.CheckpointNotFound) as ei:
        ckpt.load({}, job)
    assert "step 3" in str(ei.value)


def test_load_of_a_missing_step(job):
    ckpt.save(state_for(1), job, step=1)
    with pytest.raises(ckpt.CheckpointNotFound):
        ckpt.load({}, job, step=2)


def test_resume_skips_an_unfinished_newer_save(job):
    ckpt.save(state_for(1), job, step=1)
    os.makedirs(os.path.join(step_path(job, 2), "shards"))  # a save that died before commit
    lr = ckpt.load({}, job)
    assert lr.step == 1
    assert_same(lr.state, state_for(1))


@pytest.mark.parametrize("step", [-1, True, 10**12, "1", 1.0, None])
def test_invalid_step_numbers(job, step):
    with pytest.raises((ValueError, TypeError)):
        ckpt.save(state_for(1), job, step=step)
    assert step_dirs(job) == []


def test_invalid_verify_mode(job):
    with pytest.raises(ValueError):
        ckpt.save(state_for(1), job, step=1, verify="sometimes")
    assert committed(job) == []


def test_multi_rank_environment_is_refused(job, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ckpt.CkptError, match="rank 1 of 2"):
        ckpt.save(state_for(1), job, step=1)
    assert committed(job) == []


# ----------------------------------------------------------------------------- state mismatch


@pytest.mark.parametrize(
    "bad",
    [
        {"w": torch.zeros(65)},
        {"w": torch.zeros(64, dtype=torch.float64)},
        {"w": torch.zeros(8, 8)},
        {"w": torch.zeros((), dtype=torch.float32)},
        {"b": torch.zeros(3, dtype=torch.bfloat16)},
    ],
    ids=["length", "dtype", "rank", "0-d", "bf16"],
)
def test_load_into_wrong_shape_or_dtype(job, bad):
    ckpt.save(state_for(1), job, step=1)
    target = {"w": torch.full((64,), 7.0), "b": torch.full((3,), 7.0), "step": 0}
    target.update(bad)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in target.items()}
    with pytest.raises(ckpt.StateMismatch) as ei:
        ckpt.load(target, job)
    (key,) = bad
    assert f"/{key}" in str(ei.value)
    assert isinstance(ei.value, KeyError)
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert_same(target[k], v)


def test_keys_missing_from_the_checkpoint(job):
    ckpt.save(state_for(1), job, step=1)
    w = torch.zeros(64)
    target = {"w": w, "b": torch.zeros(3), "step": 0, "extra": torch.ones(2)}
    with pytest.raises(ckpt.StateMismatch, match="extra"):
        ckpt.load(target, job)
    assert not w.any()
    ckpt.load(target, job, strict=False)
    assert_same(target["w"], state_for(1)["w"])
    assert torch.equal(target["extra"], torch.ones(2))


def test_every_mismatch_is_listed(job):
    ckpt.save({"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)}, job, step=1)
    with pytest.raises(ckpt.StateMismatch) as ei:
        ckpt.load(
            {"a": torch.zeros(3), "b": torch.zeros(2), "c": torch.zeros(2, dtype=torch.int8)}, job
        )
    assert "/a" in str(ei.value) and "/c" in str(ei.value)


def test_state_mismatch_modifies_nothing_at_all(job):
    ckpt.save({"w": torch.ones(2), "n": 5, "hist": [1, 2], "new": "x"}, job, step=1)
    target = {"w": torch.zeros(3), "n": 0, "hist": [0]}
    with pytest.raises(ckpt.StateMismatch):
        ckpt.load(target, job)
    assert target["n"] == 0
    assert target["hist"] == [0]
    assert "new" not in target
    assert not target["w"].any()


# ----------------------------------------------------------------------------- failed saves


def assert_failed_save_left_nothing(job: str, step: int, previous: dict[str, Any]) -> None:
    assert not os.path.exists(step_path(job, step)), list_files(job)
    assert_same(ckpt.load({}, job).state, previous)
    # and the step can be saved again
    again = state_for(step)
    ckpt.save(again, job, step=step)
    assert_same(ckpt.load({}, job).state, again)


def test_unsupported_value_deep_in_the_state(job):
    prev = state_for(1)
    ckpt.save(prev, job, step=1)
    bad = state_for(2)
    bad["deep"] = {"a": [{"b": {"c": object()}}]}
    with pytest.raises(ckpt.UnsupportedValue, match="deep/a/0/b/c"):
        ckpt.save(bad, job, step=2)
    assert_failed_save_left_nothing(job, 2, prev)


def test_disk_full_efbig_from_the_kernel(job):
    """RLIMIT_FSIZE makes the kernel fail writes past the limit with EFBIG, like a full disk."""
    prev = state_for(1)
    ckpt.save(prev, job, step=1)
    big = state_for(2, n=1 << 20)  # 4 MiB
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
        with pytest.raises(ckpt.StorageError) as ei:
            ckpt.save(big, job, step=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert re.search(r"rank-00000(\.g\d+)?\.bin", str(ei.value)), ei.value  # the shard file
    assert isinstance(ei.value, OSError)
    assert_failed_save_left_nothing(job, 2, prev)


# -- a faulty Storage wrapper around the real local storage ---------------------------


class Fault(Exception):
    pass


class FaultyWriteHandle(DelegatingWriteHandle):
    def __init__(self, inner: WriteHandle, owner: FaultyStorage):
        super().__init__(inner)
        self.owner = owner

    def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        o = self.owner
        with o.lock:
            o.writes += 1
            n = o.writes
        if o.fail_write_at is not None and n >= o.fail_write_at:
            raise ckpt.StorageError(5, f"injected EIO writing {self.path} at {offset}")
        if o.flip_on_write and pieces:
            off, arr = pieces[0]
            arr = arr.copy()
            arr[len(arr) // 2] ^= 0x10  # the device silently stores a different bit
            pieces = [(off, arr), *pieces[1:]]
        self.inner.write(offset, length, pieces)

    def finish(self) -> None:
        if self.owner.fail_finish:
            self.inner.abort()
            raise ckpt.StorageError(5, f"injected fsync failure on {self.path}")
        self.inner.finish()

    def abort(self) -> None:
        self.owner.aborted += 1
        self.inner.abort()


class FaultyStorage(DelegatingStorage):
    def __init__(self, inner: Storage, **faults: Any):
        import threading

        super().__init__(inner)
        self.lock = threading.Lock()
        self.writes = 0
        self.aborted = 0
        self.fail_write_at: int | None = faults.pop("fail_write_at", None)
        self.flip_on_write: bool = faults.pop("flip_on_write", False)
        self.fail_finish: bool = faults.pop("fail_finish", False)
        self.fail_atomic: str | None = faults.pop("fail_atomic", None)  # a regex on the path
        assert not faults, faults

    def open_write(self, path: str, size: int, **kw: Any) -> WriteHandle:
        return FaultyWriteHandle(self.inner.open_write(path, size, **kw), self)

    def write_atomic(self, path: str, data: bytes) -> None:
        if self.fail_atomic is not None and re.search(self.fail_atomic, path):
            raise ckpt.StorageError(28, f"injected ENOSPC writing {path}")
        self.inner.write_atomic(path, data)

    def __getattr__(self, name: str) -> Any:  # anything the seam grows later
        return getattr(self.inner, name)


@pytest.fixture
def faulty(monkeypatch):
    """Route ckpt.save's storage through a FaultyStorage configured by the test."""
    made: list[FaultyStorage] = []

    def install(**faults: Any) -> list[FaultyStorage]:
        def opener(path: Any, *, create: bool = False) -> Storage:
            fs = FaultyStorage(open_storage(path, create=create), **faults)
            made.append(fs)
            return fs

        # The rank writes its shard and the coordinator its manifest, each on its storage.
        monkeypatch.setattr(ckpt._checkpointer, "open_storage", opener)
        monkeypatch.setattr(ckptd.coordinator.core, "open_storage", opener)
        return made

    return install


@pytest.mark.parametrize(
    "faults,expect",
    [
        ({"fail_write_at": 1}, ckpt.StorageError),
        ({"fail_write_at": 3}, ckpt.StorageError),
        ({"fail_finish": True}, ckpt.StorageError),
        ({"fail_atomic": r"/rank-00000(\.g\d+)?\.json$"}, ckpt.StorageError),
        ({"fail_atomic": f"/{layout.MANIFEST_NAME}$"}, ckpt.StorageError),
        ({"flip_on_write": True}, ckpt.HashMismatch),
    ],
    ids=["first-write", "later-write", "fsync", "index-write", "manifest-write", "silent-bit-flip"],
)
def test_faulty_storage_commits_nothing(job, faulty, monkeypatch, faults, expect):
    prev = state_for(1)
    ckpt.save(prev, job, step=1)
    made = faulty(**faults)
    with knobs.override(io_window=64 << 10, block_size=64 << 10):
        with pytest.raises(expect) as ei:
            ckpt.save(state_for(2, n=1 << 17), job, step=2)  # 512 KiB: several windows
    assert made and made[0].writes >= 1
    assert "step-000000000002" in str(ei.value) or "step 2" in str(ei.value)
    assert not os.path.exists(manifest_path(job, 2))
    monkeypatch.undo()  # healthy storage again
    assert_failed_save_left_nothing(job, 2, prev)


def test_verify_size_commits_silent_corruption_that_load_then_catches(job, faulty):
    faulty(flip_on_write=True)
    ckpt.save(state_for(1), job, step=1, verify="size")
    with pytest.raises(ckpt.HashMismatch, match="rank-00000.bin"):
        ckpt.load({}, job)


def test_failed_save_with_keep_last_removes_nothing(job, faulty):
    for s in (1, 2, 3):
        ckpt.save(state_for(s), job, step=s)
    faulty(fail_write_at=1)
    with pytest.raises(ckpt.StorageError):
        ckpt.save(state_for(4), job, step=4, keep_last=1)
    assert committed(job) == [1, 2, 3]


# ----------------------------------------------------------------------------- retention


def test_keep_last(job):
    for s in range(1, 6):
        ckpt.save(state_for(s), job, step=s, keep_last=2)
        assert committed(job) == list(range(max(1, s - 1), s + 1))
    assert_same(ckpt.load({}, job, step=4).state, state_for(4))


def test_keep_last_one_keeps_the_newest(job):
    for s in (10, 20, 30):
        ckpt.save(state_for(s), job, step=s, keep_last=1)
    assert committed(job) == [30]
    assert_same(ckpt.load({}, job).state, state_for(30))


def test_retention_removes_old_debris_but_not_a_newer_unfinished_save(job):
    ckpt.save(state_for(1), job, step=1)
    for s in (2, 50):  # 2: an aborted save; 50: maybe still being written by someone
        os.makedirs(os.path.join(step_path(job, s), "shards"))
        with open(shard_path(job, s), "wb") as f:
            f.write(b"partial")
    ckpt.save(state_for(3), job, step=3, keep_last=5)
    assert step_dirs(job) == [layout.step_dir(s) for s in (1, 3, 50)]


def test_apply_retention_directly(job):
    for s in (1, 2, 3):
        ckpt.save(state_for(s), job, step=s)
    storage = open_storage(job)
    with pytest.raises(ValueError):
        ckpt.apply_retention(storage, 0)
    assert committed(job) == [1, 2, 3]
    assert ckpt.apply_retention(storage, 5) == []
    assert ckpt.apply_retention(storage, 1) == [1, 2]
    assert committed(job) == [3]
    assert ckpt.apply_retention(storage, 1) == []
    assert ckpt.apply_retention(open_storage(str(job) + "-empty"), 1) == []


def test_retention_never_removes_the_newest_even_if_it_is_the_only_one(job):
    ckpt.save(state_for(7), job, step=7)
    os.makedirs(os.path.join(step_path(job, 3), "shards"))
    ckpt.apply_retention(open_storage(job), 1)
    assert step_dirs(job) == [layout.step_dir(7)]


def test_retention_keeps_committed_steps_it_cannot_read(job):
    ckpt.save(state_for(1), job, step=1, metadata={"notes": "x" * 4000})
    ckpt.save(state_for(2), job, step=2)
    small = os.path.getsize(manifest_path(job, 2))
    with knobs.override(max_manifest_bytes=small + 100):
        ckpt.save(state_for(3), job, step=3, keep_last=5)
    assert committed(job) == [1, 2, 3]


def test_retention_keeps_a_newer_format_step(job):
    ckpt.save(state_for(1), job, step=1)
    ckpt.save(state_for(2), job, step=2)
    edit_manifest(job, 1, lambda m: m.__setitem__("version", 6))  # newer than any read
    ckpt.save(state_for(3), job, step=3, keep_last=5)
    assert committed(job) == [1, 2, 3]


def test_numpy_and_torch_values_untouched_by_save(job):
    """save reads the state; it never modifies it."""
    w = torch.randn(5, 5)
    a = np.arange(4.0)
    state = {"w": w, "wt": w.T, "a": a, "lst": [1, 2]}
    copy = {"w": w.clone(), "a": a.copy(), "lst": [1, 2]}
    ckpt.save(state, job, step=1)
    assert (
        torch.equal(w, copy["w"]) and np.array_equal(a, copy["a"]) and state["lst"] == copy["lst"]
    )
    assert state["wt"] is not None and list(state) == ["w", "wt", "a", "lst"]


# ----------------------------------------------------------------------------- recycling


@pytest.mark.parametrize("direct_io", [True, False], ids=["o_direct", "buffered"])
def test_a_recycled_shard_file_keeps_nothing_of_its_old_content(job, direct_io):
    """Retention may keep retired shard files for reuse: the new shard must be all new."""
    with knobs.override(direct_io=direct_io, recycle_files=8):
        noise = torch.randint(1, 256, (300_000,), dtype=torch.uint8)
        ckpt.save({"noise": noise}, job, step=1)
        ckpt.save({"noise": noise.flip(0)}, job, step=2, keep_last=1)  # step 1 retired
        small = {"a": torch.arange(1, 11, dtype=torch.uint8), "b": torch.full((5000,), 3.0)}
        ckpt.save(small, job, step=3, keep_last=1)
    pool = os.path.join(job, *recycle.POOL.split("/"))
    # step 1's file was taken for step 3 (only step 2's is left in the pool; each save is
    # its own attempt, so step 2's shard carries generation 1 in its name) ...
    assert sorted(os.listdir(pool)) == [f"{2:012d}-rank-00000.g1.bin"]
    assert committed(job) == [3]
    # ... and holds exactly the new entries, zeros everywhere else.
    with open(shard_path(job, 3), "rb") as f:
        data = bytearray(f.read())
    for e in index_entries(job, 3):
        assert bytes(data[e["offset"] : e["offset"] + e["length"]]) == tensor_raw(small[e["key"]])
        data[e["offset"] : e["offset"] + e["length"]] = bytes(e["length"])
    assert not any(data), "bytes of the retired step survived in the recycled shard"
    assert_same(ckpt.load({}, job).state, small)


def test_recycling_off_deletes_retired_files(job):
    with knobs.override(recycle_files=0):
        for s in (1, 2, 3):
            ckpt.save(state_for(s), job, step=s, keep_last=1)
    pool = os.path.join(job, *recycle.POOL.split("/"))
    assert not os.path.isdir(pool) or os.listdir(pool) == []
    assert committed(job) == [3]


# ----------------------------------------------------------------------------- ckptctl gc


def test_ckptctl_gc(job, ckptctl):
    for s in (1, 2, 3):
        ckpt.save(state_for(s), job, step=s)
    for s in (0, 99):  # an old aborted save, and one that may still be running
        os.makedirs(os.path.join(step_path(job, s), "shards"))
    before = list_files(job), step_dirs(job)

    rc, out, _ = ckptctl("gc", job, "--keep-last", "1", "--dry-run")
    assert rc == 0
    assert (list_files(job), step_dirs(job)) == before
    assert layout.step_dir(0) in out and layout.step_dir(1) in out

    rc, out, _ = ckptctl("gc", job, "--json")
    assert rc == 0
    assert json.loads(out)["removed"] == [0]
    assert step_dirs(job) == [layout.step_dir(s) for s in (1, 2, 3, 99)]

    rc, out, _ = ckptctl("gc", job, "--keep-last", "2", "--json")
    assert rc == 0
    assert json.loads(out)["removed"] == [1]
    assert committed(job) == [2, 3]
    assert layout.step_dir(99) in step_dirs(job)
    assert_same(ckpt.load({}, job).state, state_for(3))
