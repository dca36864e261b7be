"""Staged writes: items written from their own memory through pooled huge-page buffers,
each window copied there by the pass that hashes it (ckptd.format.writer._Staged).

The file must hold the same bytes, and the index the same hashes and health stats, as a
write straight from the items' memory, whatever the items' sizes, their places in their
pages and where the windows cut their blocks; every buffer must come back, also when a
write fails; and the hashes must not wait for writes that do not move.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from ckpt_testutil import DelegatingStorage, DirectDelegatingWriteHandle, direct_local_storage

from ckptd import knobs
from ckptd.errors import StorageError
from ckptd.format import buffers, writer
from ckptd.format.writer import ShardWriter, WriteItem, memory_phases, plan_offsets
from ckptd.storage.base import Piece, WriteHandle
from ckptd.storage.local import ALIGN, LocalStorage, map_populated

KiB = 1 << 10


def _item(key: str, arr: np.ndarray, dtype: str = "uint8") -> WriteItem:
    n = arr.nbytes
    return WriteItem(key, dtype, [n], [0], [n], arr)


def _items(seed: int) -> list[WriteItem]:
    """Items of many sizes at many places in their pages: floats (health stats), bytes,
    an empty one, ones under a block and ones of many blocks."""
    rng = np.random.default_rng(seed)
    out = []
    for j in range(12):
        n = int(rng.choice([0, 3, 1000, 5 * KiB + 7, 64 * KiB, 200 * KiB + 12, 700 * KiB]))
        shift = int(rng.choice([0, 64, 2048, 4000]))
        _, base = map_populated(-(-(n + shift) // ALIGN) * ALIGN + ALIGN)
        mem = base[shift : shift + n]
        if j % 3 == 0 and n % 4 == 0:
            mem[:] = np.frombuffer(
                rng.standard_normal(n // 4).astype(np.float32).tobytes(), np.uint8
            )
            out.append(WriteItem(f"f{j}", "float32", [n // 4], [0], [n // 4], mem))
        else:
            mem[:] = rng.integers(0, 256, n, dtype=np.uint8)
            out.append(_item(f"b{j}", mem))
    return out


def _layout(items: list[WriteItem]) -> tuple[list[int], int]:
    phases = memory_phases(items, ALIGN, 64 * KiB)
    return plan_offsets([it.data.nbytes for it in items], ALIGN, phases)


def _write(storage, items, *, wait: bool = True):  # noqa: ANN001, ANN202
    offsets, size = _layout(items)
    w = ShardWriter(
        storage, job="j", step=1, rank=0, world_size=1, generation=0, size=size, verify="full"
    )
    return w, offsets, size, w.write(items, offsets, wait=wait)


@pytest.mark.parametrize("seed", range(6))
def test_the_same_bytes_hashes_and_stats_as_a_write_from_the_items(tmp_path, seed) -> None:
    items = _items(seed)
    staged: list[int] = []
    real = writer._Staged.run

    def counting(self, writes):  # noqa: ANN001, ANN202
        staged.append(len(self.windows))
        return real(self, writes)

    runs = []
    with knobs.override(io_window=96 * KiB, block_size=48 * KiB, alignment=ALIGN):
        for storage in (
            direct_local_storage(tmp_path / "d"),
            LocalStorage(str(tmp_path / "b"), direct_io=False, create=True),
        ):
            for it in items:
                it.stats = None
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(writer._Staged, "run", counting)
                w, offsets, size, hashes = _write(storage, items)
                info = w.finish(items, offsets, hashes, verify="full")
            got = (Path(storage.root) / w.shard_path).read_bytes()
            runs.append((hashes, [it.stats and it.stats.to_json() for it in items], got, info))
        expected = writer.hash_items(items)
    assert len(staged) == 1, "the O_DIRECT write was not staged, or the buffered one was"
    (h1, s1, got, info1), (h2, s2, plain, info2) = runs
    assert h1 == h2 == expected
    assert s1 == s2 and any(s is not None for s in s1)
    assert len(got) == size and got == plain
    assert info1.index_blake3 == info2.index_blake3
    for it, off in zip(items, offsets, strict=True):
        assert got[off : off + it.data.nbytes] == it.data.tobytes(), it.key
    assert buffers.WRITES.out == 0


class _Failing(DelegatingStorage):
    """The shard's write at `fail_at` fails; writes from `hold_from` on wait for `release`."""

    def __init__(
        self, inner: LocalStorage, fail_at: int | None = None, hold_from: int | None = None
    ):
        super().__init__(inner)
        self.fail_at, self.hold_from = fail_at, hold_from
        self.release = threading.Event()
        self.written: list[int] = []

    def wrap_write(self, inner: WriteHandle) -> WriteHandle:
        outer = self

        class Handle(DirectDelegatingWriteHandle):
            def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
                if outer.hold_from is not None and offset >= outer.hold_from:
                    outer.release.wait(10)
                if offset == outer.fail_at:
                    raise StorageError(5, f"the device refused the write at {offset}")
                inner.write(offset, length, pieces)
                outer.written.append(offset)

        return Handle(inner)


def test_a_failed_write_stops_the_rest_and_every_buffer_comes_back(tmp_path) -> None:
    data = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
    with knobs.override(io_window=64 * KiB, alignment=ALIGN):
        storage = _Failing(direct_local_storage(tmp_path), fail_at=10 * 64 * KiB)
        offsets, size = plan_offsets([data.nbytes], ALIGN)
        w = ShardWriter(
            storage, job="j", step=3, rank=1, world_size=2, generation=0, size=size, verify="size"
        )
        with pytest.raises(Exception, match="refused the write at 655360") as e:
            w.write([_item("w", data)], offsets)
    assert "job 'j' step 3 rank 1" in str(e.value)
    assert buffers.WRITES.out == 0
    assert len(storage.written) < size // (64 * KiB)  # the windows not yet started never were
    assert not list(tmp_path.rglob("*.bin"))  # the file is gone


def test_the_hashes_do_not_wait_for_writes_that_do_not_move(tmp_path) -> None:
    """Writes held back (as write_ahead's plan holds none, but a stalled disk may) keep
    their buffers; the hash pass goes on in place after writer._STALL_S and the hashes
    are back; the bytes are right once the writes go on."""
    data = np.random.default_rng(2).integers(0, 256, 8 << 20, dtype=np.uint8)
    with knobs.override(io_window=64 * KiB, alignment=ALIGN):
        storage = _Failing(direct_local_storage(tmp_path), hold_from=0)
        item = _item("w", data)
        t0 = time.monotonic()
        w, offsets, _, hashes = _write(storage, [item], wait=False)
        took = time.monotonic() - t0
        assert not storage.written and hashes == writer.hash_items([item])
        assert took < 5, f"the hashes waited {took:.1f} s for the writes"
        storage.release.set()
        w.finish([item], offsets, hashes, verify="full")
    got = (tmp_path / w.shard_path).read_bytes()
    assert got[offsets[0] : offsets[0] + data.nbytes] == data.tobytes()
    assert buffers.WRITES.out == 0
