"""Helpers shared by the tests: bit-exact comparison and on-storage surgery.

Everything here works on real files of a real checkpoint; nothing is mocked. The
surgery helpers know format v1's layout (ckptd.format.layout) and keep the manifest's
index_size / index_blake3 consistent when a test wants the parser, not the hash check,
to be what rejects an edited index.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from ckptd.format import hashing, layout
from ckptd.storage.base import PendingUpload, Piece, ReadHandle, Storage, WriteHandle
from ckptd.storage.local import LocalStorage

# ----------------------------------------------------------------------------- comparison


def tensor_raw(t: torch.Tensor) -> bytes:
    """The bytes of a tensor's values, in logical (row-major) order.

    Copies into a fresh 1-D tensor first: conj/neg views resolve, and no odd stride of a
    size-1 dim can reach .view(torch.uint8).
    """
    flat = torch.empty((t.numel(),), dtype=t.dtype)
    if t.numel():
        flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


def float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same(got: Any, want: Any, path: str = "<root>") -> None:
    """Bit-exact equality with types preserved (tuple stays tuple, numpy stays numpy).

    Python floats compare by their bits (so -0.0 != 0.0), except that any nan matches any
    nan: a plain float is stored as JSON, which keeps "nan" but not its sign or payload.
    Tensors and arrays compare by dtype, shape and bytes, nan payloads included.
    """
    assert type(got) is type(want), f"{path}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert tuple(got.shape) == tuple(want.shape), f"{path}: shape {got.shape} != {want.shape}"
        assert got.device.type == "cpu", f"{path}: loaded on {got.device}"
        assert tensor_raw(got) == tensor_raw(want), f"{path}: tensor bytes differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), (
            f"{path}: array bytes differ"
        )
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.tobytes() == want.tobytes(), f"{path}: numpy scalar {got!r} != {want!r}"
    elif isinstance(want, float):
        if math.isnan(want):
            assert math.isnan(got), f"{path}: {got!r} is not nan"
        else:
            assert float_bits(got) == float_bits(want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        gk, wk = list(got), list(want)
        assert len(gk) == len(wk), f"{path}: keys {gk!r} != {wk!r}"
        for a, b in zip(gk, wk, strict=True):
            assert_same(a, b, f"{path}.<key {b!r}>")
            assert_same(got[a], want[b], f"{path}/{b!r}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}/{i}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def zeroed_like(state: Any, memo: dict[int, Any] | None = None) -> Any:
    """The same structure with every tensor/array replaced by zeros of the same layout.

    Shared tensors stay shared (one zero tensor for all the keys that shared one), and
    non-contiguous tensors get non-contiguous zero targets (zeros_like keeps strides).
    """
    memo = {} if memo is None else memo
    if id(state) in memo:
        return memo[id(state)]
    if isinstance(state, torch.Tensor):
        out: Any = torch.empty_like(state)  # keeps strides; fill_ is missing for some dtypes
        out.untyped_storage().fill_(0)
    elif isinstance(state, np.ndarray):
        out = np.zeros_like(state)
    elif isinstance(state, dict):
        out = {k: zeroed_like(v, memo) for k, v in state.items()}
    elif isinstance(state, list):
        out = [zeroed_like(v, memo) for v in state]
    elif isinstance(state, tuple):
        out = tuple(zeroed_like(v, memo) for v in state)
    elif isinstance(state, float) and not math.isnan(state):
        out = 0.0
    else:
        out = state
    memo[id(state)] = out
    return out


# ----------------------------------------------------------------------------- surgery


def as_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from here on as another process would: nothing this process committed or
    parsed is remembered (read_lineage's memo)."""
    from ckptd.format import checkpoint as ckfmt

    monkeypatch.setattr(ckfmt, "_LINES", hashing.DigestMemo(16))


def as_older_ckptd(monkeypatch: pytest.MonkeyPatch, versions: tuple[int, ...]) -> None:
    """Read from here on as a ckptd that reads only format `versions`, in a process of its
    own (as_fresh_process)."""
    from ckptd.format import manifest as mf

    monkeypatch.setattr(mf, "READ_VERSIONS", versions)
    as_fresh_process(monkeypatch)


def step_path(job: str | os.PathLike[str], step: int) -> str:
    return os.path.join(os.fspath(job), layout.step_dir(step))


def manifest_path(job: str | os.PathLike[str], step: int) -> str:
    return os.path.join(step_path(job, step), layout.MANIFEST_NAME)


def shard_path(job: str | os.PathLike[str], step: int, rank: int = 0) -> str:
    """Rank `rank`'s shard file of a step: the manifest's name for it once committed (a
    save's generation is part of the name), else generation 0's."""
    return os.path.join(step_path(job, step), _committed_names(job, step, rank)[0])


def index_path(job: str | os.PathLike[str], step: int, rank: int = 0) -> str:
    return os.path.join(step_path(job, step), _committed_names(job, step, rank)[1])


def _committed_names(job: str | os.PathLike[str], step: int, rank: int) -> tuple[str, str]:
    try:
        shards = read_json(manifest_path(job, step))["shards"]
    except FileNotFoundError:
        return layout.shard_name(rank), layout.index_name(rank)
    s = next(s for s in shards if s["rank"] == rank)
    return s["path"], s["index"]


def read_json(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def write_json(path: str, doc: Any) -> bytes:
    data = json.dumps(doc).encode()
    write_bytes(path, data)
    return data


def edit_manifest(job: str | os.PathLike[str], step: int, fn: Callable[[dict], Any]) -> None:
    """Apply fn to the parsed MANIFEST.json (in place, or return a replacement) and write it."""
    path = manifest_path(job, step)
    doc = read_json(path)
    new = fn(doc)
    write_json(path, doc if new is None else new)


def write_index_consistently(
    job: str | os.PathLike[str], step: int, data: bytes, rank: int = 0
) -> None:
    """Replace a shard index and record its new size and blake3 in the manifest."""
    write_bytes(index_path(job, step, rank), data)

    def fix(m: dict) -> None:
        for s in m["shards"]:
            if s["rank"] == rank:
                s["index_size"] = len(data)
                s["index_blake3"] = hashing.digest(data)

    edit_manifest(job, step, fix)


def edit_index(
    job: str | os.PathLike[str], step: int, fn: Callable[[dict], Any], rank: int = 0
) -> None:
    """Apply fn to the parsed index and write it back, manifest kept consistent."""
    doc = read_json(index_path(job, step, rank))
    new = fn(doc)
    write_index_consistently(job, step, json.dumps(doc if new is None else new).encode(), rank)


def index_entries(job: str | os.PathLike[str], step: int, rank: int = 0) -> list[dict]:
    return list(read_json(index_path(job, step, rank))["entries"])


def entry(job: str | os.PathLike[str], step: int, key: str, rank: int = 0) -> dict:
    for e in index_entries(job, step, rank):
        if e["key"] == key:
            return e
    raise KeyError(key)


def flip_bit(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1, f"{path} has no byte {offset}"
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def list_files(root: str | os.PathLike[str]) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        out.extend(os.path.relpath(os.path.join(d, f), root) for f in files)
    return sorted(out)


class DelegatingWriteHandle(WriteHandle):
    """A write handle that passes every call to `inner`; fault wrappers override one."""

    def __init__(self, inner: WriteHandle):
        self.inner = inner
        self.path, self.size = inner.path, inner.size

    def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        self.inner.write(offset, length, pieces)

    def finish(self) -> None:
        self.inner.finish()

    def abort(self) -> None:
        self.inner.abort()


class DirectDelegatingWriteHandle(DelegatingWriteHandle):
    """As DelegatingWriteHandle, and says whether `inner` writes O_DIRECT, as the writer
    asks before it stages windows or reads them back early."""

    @property
    def direct(self) -> bool:
        return bool(getattr(self.inner, "direct", False))


def writes_direct(storage: LocalStorage) -> bool:
    """Whether `storage` writes its files O_DIRECT (not where the filesystem refuses it:
    tmpfs); probed with a file it removes."""
    probe = storage.open_write("probe.bin", 4096)
    direct = bool(getattr(probe, "direct", False))
    probe.abort()
    storage.remove_tree("probe.bin")
    return direct


def direct_local_storage(root: str | os.PathLike[str]) -> LocalStorage:
    """A LocalStorage at `root` whose shard files are written O_DIRECT; the test is skipped
    where the filesystem refuses it (tmpfs)."""
    storage = LocalStorage(str(root), create=True)
    if not writes_direct(storage):
        pytest.skip("this filesystem refuses O_DIRECT")
    return storage


class DelegatingStorage(Storage):
    """A real storage behind the Storage seam; fault wrappers override what they change."""

    def __init__(self, inner: Storage):
        self.inner = inner
        self.url = inner.url

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def open_write(
        self, path: str, size: int, *, preallocate: bool = False, reuse: str | None = None
    ) -> WriteHandle:
        return self.wrap_write(
            self.inner.open_write(path, size, preallocate=preallocate, reuse=reuse)
        )

    def wrap_write(self, inner: WriteHandle) -> WriteHandle:
        """The handle open_write returns for `inner`, the real storage's: a wrapper that
        changes how shard writes behave overrides this."""
        return inner

    def open_read(self, path: str, *, cold: bool = False) -> ReadHandle:
        return self.inner.open_read(path, cold=cold)

    def write_atomic(self, path: str, data: bytes) -> None:
        self.inner.write_atomic(path, data)

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        return self.inner.read_bytes(path, limit=limit)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def remove_tree(self, path: str) -> None:
        self.inner.remove_tree(path)

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)

    @property
    def supports_reuse(self) -> bool:
        return self.inner.supports_reuse

    def local_path(self, path: str) -> str | None:
        return self.inner.local_path(path)

    # create_only is the base's check-then-write here, so atomic_create_only stays False.
    def pending_uploads(self, path: str = "") -> list[PendingUpload]:
        return self.inner.pending_uploads(path)

    def abort_upload(self, upload: PendingUpload) -> None:
        self.inner.abort_upload(upload)


class FaultyOs:
    """`os` for ckptd.storage.local with some calls replaced; the rest is the real module."""

    def __init__(self, **calls: Callable[..., Any]):
        self.__dict__.update(calls)
        self.fd_path: dict[int, str] = {}
        self.fd_open: dict[int, int] = {}  # fd -> which open() it came from (fds are reused)
        self._opens = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        fd = os.open(path, flags, mode, **kw)
        self._opens += 1
        self.fd_path[fd], self.fd_open[fd] = os.fspath(path), self._opens
        return fd
