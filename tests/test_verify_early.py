"""verify="full" reads each window back while later windows are still being written
(ckptd.format.writer._EarlyCheck), O_DIRECT, before the fsync; a byte the device holds
differently from what was written fails the save before anything is committed."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from ckpt_testutil import DelegatingStorage, DirectDelegatingWriteHandle, direct_local_storage

from ckptd import knobs
from ckptd.errors import HashMismatch
from ckptd.format import buffers
from ckptd.format.writer import WriteItem, write_shard
from ckptd.storage.base import Piece, ReadHandle, WriteHandle
from ckptd.storage.local import LocalStorage

MiB = 1 << 20


class Recording(DelegatingStorage):
    """Logs every shard write, read and fsync in the order they happen."""

    def __init__(
        self, inner: LocalStorage, corrupt_at: int | None = None, hold_from: int | None = None
    ):
        super().__init__(inner)
        self.log: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.corrupt_at = corrupt_at
        # Writes at or past this offset wait (30 s at most) for the first read-back: the
        # order the test asserts then does not hang on how fast this machine writes.
        self.hold_from = hold_from
        self.first_read = threading.Event()

    def note(self, what: str, offset: int) -> None:
        with self.lock:
            self.log.append((what, offset))

    def wrap_write(self, inner: WriteHandle) -> WriteHandle:
        outer = self

        class Handle(DirectDelegatingWriteHandle):
            def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
                if outer.corrupt_at is not None and offset <= outer.corrupt_at < offset + length:
                    # The device keeps something else than it was given (a lost write).
                    off, arr = pieces[0]
                    bad = arr.copy()
                    bad[outer.corrupt_at - off] ^= 0xFF
                    pieces = [(off, bad), *pieces[1:]]
                if outer.hold_from is not None and offset >= outer.hold_from:
                    outer.first_read.wait(timeout=30)
                inner.write(offset, length, pieces)
                outer.note("write", offset)

            def finish(self) -> None:
                outer.note("fsync", 0)
                inner.finish()

        return Handle(inner)

    def open_read(self, path: str, *, cold: bool = False) -> ReadHandle:
        inner = self.inner.open_read(path, cold=cold)
        outer = self

        class Handle(ReadHandle):
            def __init__(self) -> None:
                self.path, self.size = inner.path, inner.size

            @property
            def direct(self) -> bool:
                return bool(getattr(inner, "direct", False))

            def read(self, offset: int, length: int) -> np.ndarray:
                outer.note("read", offset)
                outer.first_read.set()
                return inner.read(offset, length)

            def close(self) -> None:
                inner.close()

        return Handle()


def _items(n_mib: int) -> list[WriteItem]:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, n_mib * MiB, dtype=np.uint8)
    half = data.nbytes // 2
    return [
        WriteItem(f"t{i}", "uint8", [half], [0], [half], data[i * half : (i + 1) * half])
        for i in range(2)
    ]


def _save(storage: Recording, verify: str) -> None:
    with knobs.override(io_window=8 * MiB, read_window=16 * MiB, io_threads=4):
        write_shard(
            storage, job="j", step=1, rank=0, world_size=1, generation=0,
            items=_items(128), verify=verify,
        )  # fmt: skip


def test_full_verify_reads_back_while_writing_and_before_the_fsync(tmp_path):
    # The last window's write waits for a read-back: one that only comes after every
    # write (no early check) leaves it waiting out its 30 s, and the order below fails.
    # Unheld, a machine that wrote all 16 windows before the first two were hashed
    # failed it now and then (after other tests had warmed the I/O threads' buffers).
    storage = Recording(direct_local_storage(tmp_path / "job"), hold_from=120 * MiB)
    _save(storage, "full")
    kinds = [k for k, _ in storage.log]
    writes = [i for i, k in enumerate(kinds) if k == "write"]
    reads = [i for i, k in enumerate(kinds) if k == "read"]
    fsync = kinds.index("fsync")
    assert len(writes) == 16 and reads  # 128 MiB in 8 MiB windows, read back in 16 MiB
    assert max(reads) < fsync  # nothing left to re-read after the fsync
    assert min(reads) < max(writes)  # the first read-back ran before the last write
    read_bytes = sorted(off for k, off in storage.log if k == "read")
    assert read_bytes == list(range(0, 128 * MiB, 16 * MiB))  # every byte, once


def test_size_verify_reads_nothing_back(tmp_path):
    storage = Recording(direct_local_storage(tmp_path / "job"))
    _save(storage, "size")
    assert not [k for k, _ in storage.log if k == "read"]


def test_a_byte_the_device_holds_differently_fails_before_the_fsync(tmp_path, tally):
    storage = Recording(direct_local_storage(tmp_path / "job"), corrupt_at=40 * MiB + 5)
    with tally.fault("device:lost-write-read-back-early"):
        with pytest.raises(HashMismatch, match="block 40"):
            _save(storage, "full")
    assert "fsync" not in [k for k, _ in storage.log]
    assert not storage.inner.exists("step-000000000001/shards/rank-00000.bin")
    # The read-back's buffers (its hashing runs on the hash threads) and the staged
    # writes' buffers all came back.
    assert buffers.READS.out == 0 and buffers.WRITES.out == 0
