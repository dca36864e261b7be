"""The fsspec path (memory://): save/load round trips and corruption is caught there too.

Also a small conformance suite for the Storage seam, run against both backends
(LocalStorage and FsspecStorage), so the two agree on the contract in storage/base.py.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from ckpt_testutil import DelegatingStorage, assert_same

import ckpt
from ckptd import knobs
from ckptd.format import layout
from ckptd.storage import LocalStorage, Storage, open_storage
from ckptd.storage.fsspec_store import FsspecStorage

MEM = fsspec.filesystem("memory")


def mem_path(url: str, step: int, rel: str) -> str:
    return posixpath.join("/" + url[len("memory://") :], layout.step_dir(step), rel)


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(3000, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
        },
        "t": torch.randn(4, 6, generator=g).T,
        "arr": np.arange(7, dtype=np.int16),
        "opt": {"lr": 0.1 * step, "betas": (0.9, 0.99), "step": step},
    }


def test_open_storage_picks_the_backend(tmp_path, mem_job):
    assert isinstance(open_storage(mem_job), FsspecStorage)
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)


def test_memory_roundtrip(mem_job):
    states = {s: state_for(s) for s in (1, 2)}
    for s, st in states.items():
        ckpt.save(st, mem_job, step=s, metadata={"where": "memory"})
    lr = ckpt.load({}, mem_job)
    assert lr.step == 2 and lr.metadata == {"where": "memory"}
    assert_same(lr.state, states[2])
    assert_same(ckpt.load({}, mem_job, step=1).state, states[1])
    target = {"model": {"w": torch.zeros(3000), "b": torch.zeros(5, dtype=torch.bfloat16)}}
    ckpt.load(target, mem_job, step=1, strict=False)
    assert_same(target["model"], states[1]["model"])
    assert MEM.exists(mem_path(mem_job, 2, layout.MANIFEST_NAME))


def test_memory_multi_block(mem_job):
    with knobs.override(block_size=4096):
        ckpt.save(state_for(1), mem_job, step=1)
    doc = json.loads(MEM.cat_file(mem_path(mem_job, 1, layout.index_name(0))))
    assert max(len(e["blake3"]) for e in doc["entries"]) == 3
    assert_same(ckpt.load({}, mem_job).state, state_for(1))


def test_memory_exists_and_retention(mem_job):
    for s in (1, 2, 3):
        ckpt.save(state_for(s), mem_job, step=s, keep_last=2)
    with pytest.raises(ckpt.CheckpointExists):
        ckpt.save(state_for(3), mem_job, step=3)
    names = MEM.ls("/" + mem_job[len("memory://") :], detail=False)
    assert sorted(posixpath.basename(n) for n in names) == [layout.step_dir(2), layout.step_dir(3)]


def test_memory_not_found(mem_job):
    with pytest.raises(ckpt.CheckpointNotFound):
        ckpt.load({}, mem_job)


def _rank0(url: str, step: int) -> tuple[str, str]:
    """Rank 0's shard and index names of a committed step, from its manifest (a save's
    generation is part of the names)."""
    doc = json.loads(MEM.cat_file(mem_path(url, step, layout.MANIFEST_NAME)))
    s = next(s for s in doc["shards"] if s["rank"] == 0)
    return s["path"], s["index"]


def _flip(path: str, offset: int) -> None:
    data = bytearray(MEM.cat_file(path))
    data[offset] ^= 0x01
    MEM.pipe_file(path, bytes(data))


def _corrupt_bit(url: str) -> tuple[str, type]:
    shard, _ = _rank0(url, 2)
    _flip(mem_path(url, 2, shard), 4096 + 7)
    return posixpath.basename(shard), ckpt.HashMismatch


def _truncate(url: str) -> tuple[str, type]:
    shard, _ = _rank0(url, 2)
    p = mem_path(url, 2, shard)
    MEM.pipe_file(p, MEM.cat_file(p)[:-1])
    return posixpath.basename(shard), ckpt.ShardSizeMismatch


def _delete_shard(url: str) -> tuple[str, type]:
    shard, _ = _rank0(url, 2)
    MEM.rm(mem_path(url, 2, shard))
    return posixpath.basename(shard), ckpt.ShardMissing


def _delete_index(url: str) -> tuple[str, type]:
    _, index = _rank0(url, 2)
    MEM.rm(mem_path(url, 2, index))
    return posixpath.basename(index), ckpt.ShardMissing


def _index_from_step_1(url: str) -> tuple[str, type]:
    (_, index2), (_, index1) = _rank0(url, 2), _rank0(url, 1)
    MEM.pipe_file(mem_path(url, 2, index2), MEM.cat_file(mem_path(url, 1, index1)))
    return posixpath.basename(index2), ckpt.CorruptCheckpoint


def _unsafe_manifest_path(url: str) -> tuple[str, type]:
    p = mem_path(url, 2, layout.MANIFEST_NAME)
    doc = json.loads(MEM.cat_file(p))
    doc["shards"][0]["path"] = "../../elsewhere/rank-00000.bin"
    MEM.pipe_file(p, json.dumps(doc).encode())
    return "elsewhere", ckpt.UnsafePath


MEM_CASES = {
    "bit-flip": _corrupt_bit,
    "truncated": _truncate,
    "deleted-shard": _delete_shard,
    "deleted-index": _delete_index,
    "index-from-other-step": _index_from_step_1,
    "unsafe-path": _unsafe_manifest_path,
}


@pytest.mark.parametrize("case", list(MEM_CASES), ids=list(MEM_CASES))
def test_memory_corruption_detected(mem_job, ckptctl, case):
    with knobs.override(block_size=4096):
        for s in (1, 2):
            ckpt.save(state_for(s), mem_job, step=s)
    fname, err = MEM_CASES[case](mem_job)
    with pytest.raises(err) as ei:
        ckpt.load({}, mem_job, step=2)
    assert fname in str(ei.value)
    if err is ckpt.HashMismatch:
        assert "model/w" in str(ei.value)
    # In-process ckptctl sees the same memory filesystem.
    rc, out, _ = ckptctl("verify", mem_job, "--step", "2", "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    assert any(fname in p for p in doc["steps"][0]["problems"])
    assert ckptctl("verify", mem_job, "--step", "1")[0] == 0
    assert_same(ckpt.load({}, mem_job, step=1).state, state_for(1))


# ----------------------------------------------------------------------------- conformance


class StorageContract:
    """What every Storage promises (storage/base.py); subclasses supply `storage`, and
    the capabilities the backend has (`reuses`: open_write's reuse is honoured; `local`:
    local_path names real files)."""

    reuses: bool
    local: bool

    @pytest.fixture
    def storage(self) -> Iterator[Storage]:
        raise NotImplementedError

    def _write(self, storage: Storage, path: str, fill: int, reuse: str | None = None) -> None:
        h = storage.open_write(path, 4096, reuse=reuse)
        h.write(0, 4096, [(0, np.full(4096, fill, dtype=np.uint8))])
        h.finish()

    def test_supports_reuse_says_what_open_write_does(self, storage):
        assert storage.supports_reuse is self.reuses
        storage.makedirs("r")
        self._write(storage, "r/old.bin", 1)
        self._write(storage, "r/new.bin", 2, reuse="r/old.bin")
        # Reused: the old file was renamed into place (and overwritten); else left alone.
        assert storage.exists("r/old.bin") is not self.reuses
        assert storage.read_bytes("r/new.bin", limit=4096) == bytes([2]) * 4096

    def test_local_path_names_the_real_file_or_is_none(self, storage):
        storage.makedirs("l")
        storage.write_atomic("l/f.json", b"{}")
        got = storage.local_path("l/f.json")
        if self.local:
            assert got is not None and os.path.isabs(got)
            with open(got, "rb") as f:
                assert f.read() == b"{}"
        else:
            assert got is None
        with pytest.raises(ckpt.UnsafePath):
            storage.local_path("../escape")

    def test_create_only_calls_before_publish_once_before_the_file_is_visible(self, storage):
        storage.makedirs("p")
        seen: list[bool] = []
        storage.create_only(
            "p/MANIFEST.json",
            b"m",
            before_publish=lambda: seen.append(storage.exists("p/MANIFEST.json")),
        )
        assert seen == [False]
        assert storage.read_bytes("p/MANIFEST.json", limit=10) == b"m"
        with pytest.raises(ckpt.CheckpointExists):
            storage.create_only("p/MANIFEST.json", b"n", before_publish=lambda: None)
        assert storage.read_bytes("p/MANIFEST.json", limit=10) == b"m"

    def test_write_atomic_and_read_bytes(self, storage):
        storage.makedirs("a/b")
        storage.write_atomic("a/b/f.json", b'{"x":1}')
        assert storage.read_bytes("a/b/f.json", limit=100) == b'{"x":1}'
        storage.write_atomic("a/b/f.json", b"{}")
        assert storage.read_bytes("a/b/f.json", limit=100) == b"{}"
        assert storage.size("a/b/f.json") == 2
        assert storage.exists("a/b/f.json") and storage.exists("a/b")
        assert storage.listdir("a/b") == ["f.json"]

    def test_create_only_never_replaces(self, storage):
        storage.makedirs("c")
        storage.create_only("c/MANIFEST.json", b"first")
        with pytest.raises(ckpt.CheckpointExists) as ei:
            storage.create_only("c/MANIFEST.json", b"second")
        assert "c/MANIFEST.json" in str(ei.value)
        assert storage.read_bytes("c/MANIFEST.json", limit=100) == b"first"

    def test_read_bytes_limit(self, storage):
        storage.makedirs("d")
        storage.write_atomic("d/big", b"x" * 100)
        with pytest.raises(ckpt.InvalidManifest):
            storage.read_bytes("d/big", limit=99)

    def test_missing(self, storage):
        with pytest.raises(ckpt.ShardMissing):
            storage.size("nope/x.bin")
        with pytest.raises(ckpt.ShardMissing):
            storage.read_bytes("nope/x.json", limit=10)
        assert not storage.exists("nope")
        assert storage.listdir("nope") == []
        storage.remove_tree("nope")  # no error

    def test_size_of_a_directory_is_shard_missing(self, storage):
        storage.makedirs("dir/sub")
        with pytest.raises(ckpt.ShardMissing):
            storage.size("dir/sub")

    def test_positional_writes_and_reads(self, storage):
        storage.makedirs("s")
        h = storage.open_write("s/x.bin", 8192)
        a = np.arange(100, dtype=np.uint8)
        b = np.full(50, 7, dtype=np.uint8)
        h.write(4096, 4096, [(4096, b)])
        h.write(0, 4096, [(10, a)])
        h.finish()
        assert storage.size("s/x.bin") == 8192
        r = storage.open_read("s/x.bin", cold=True)
        try:
            got = r.read(0, 8192).copy()
        finally:
            r.close()
        want = np.zeros(8192, dtype=np.uint8)
        want[10:110] = a
        want[4096:4146] = b
        np.testing.assert_array_equal(got, want)

    def test_short_read_raises(self, storage):
        storage.makedirs("s")
        storage.write_atomic("s/small.bin", b"abc")
        r = storage.open_read("s/small.bin")
        try:
            with pytest.raises(ckpt.StorageError):
                r.read(0, 10)
        finally:
            r.close()

    def test_remove_tree_and_rename(self, storage):
        storage.makedirs("t/u")
        storage.write_atomic("t/u/f", b"1")
        storage.rename("t/u/f", "t/g")
        assert storage.listdir("t") == ["g", "u"]
        storage.remove_tree("t")
        assert not storage.exists("t")

    @pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "a\x00b", "a//b", "./a"])
    def test_paths_are_confined(self, storage, bad):
        for call in (
            lambda: storage.exists(bad),
            lambda: storage.size(bad),
            lambda: storage.write_atomic(bad, b"x"),
            lambda: storage.makedirs(bad),
            lambda: storage.remove_tree(bad),
        ):
            with pytest.raises(ckpt.UnsafePath):
                call()


class TestLocalStorage(StorageContract):
    reuses, local = True, True

    @pytest.fixture
    def storage(self, tmp_path) -> Iterator[Storage]:
        yield open_storage(str(tmp_path / "root"), create=True)


class TestFsspecMemoryStorage(StorageContract):
    reuses, local = False, False

    @pytest.fixture
    def storage(self, mem_job) -> Iterator[Storage]:
        s = open_storage(mem_job)
        s.makedirs("")
        yield s


class TestFsspecLocalStorage(StorageContract):
    """fsspec's own local filesystem (FsspecStorage over file://): real files, no reuse."""

    reuses, local = False, True

    @pytest.fixture
    def storage(self, tmp_path) -> Iterator[Storage]:
        (tmp_path / "root").mkdir()
        yield FsspecStorage(f"file://{tmp_path / 'root'}")


class TestDelegatingLocalStorage(TestLocalStorage):
    """The test suites' fault wrapper passes the capabilities on."""

    @pytest.fixture
    def storage(self, tmp_path) -> Iterator[Storage]:
        yield DelegatingStorage(open_storage(str(tmp_path / "root"), create=True))


class TestDelegatingMemoryStorage(TestFsspecMemoryStorage):
    @pytest.fixture
    def storage(self, mem_job) -> Iterator[Storage]:
        s = open_storage(mem_job)
        s.makedirs("")
        yield DelegatingStorage(s)
