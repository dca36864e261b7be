"""Reads straight into the destination (ckptd.format.reader's `into`): the bytes land in the
caller's memory with no bounce copy, each block hashed in place; a corrupt block is zeroed
before the error, so it never stays in the caller's memory. Loads that make new tensors
place large ones in their pages as their bytes lie in the file, so O_DIRECT reads land in
them."""

from __future__ import annotations

import mmap
import threading
import time

import numpy as np
import pytest
import torch

import ckpt
from ckptd import knobs
from ckptd.errors import HashMismatch, StorageError
from ckptd.format import checkpoint as ckfmt
from ckptd.format.reader import read_entries
from ckptd.storage import counters, open_storage
from ckptd.storage.base import ReadHandle


def _aligned(n: int, phase: int = 0) -> np.ndarray:
    """n bytes of memory `phase` bytes into a page."""
    return np.frombuffer(mmap.mmap(-1, phase + n), dtype=np.uint8)[phase:]


class _Handle(ReadHandle):
    """A storage read handle passed through, for a test to change one of its calls."""

    def __init__(self, h: ReadHandle):
        self.h, self.path, self.size = h, h.path, h.size

    def read(self, offset: int, length: int) -> np.ndarray:
        return self.h.read(offset, length)

    def can_read_into(self, out: np.ndarray, offset: int = 0) -> bool:
        return self.h.can_read_into(out, offset)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        self.h.read_into(offset, out)

    def close(self) -> None:
        self.h.close()


def _save_one_shard(job: str, state: dict[str, torch.Tensor]) -> tuple[object, str, list]:
    """Saves `state` as step 1 of a one-rank job: its storage, its one shard's path and the
    index entries of `state`'s keys, in the state's order."""
    ckpt.save(state, job, step=1, verify="size")
    storage = open_storage(job)
    ck = ckfmt.open_checkpoint(storage, 1)
    (shard,) = ck.manifest.shards
    return storage, ck.shard_path(shard), [ck.chunks[k][0].entry for k in state]


def _in_file_order(
    job: str, state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], object, str, list]:
    """_save_one_shard, the entries sorted by their place in the file."""
    storage, path, entries = _save_one_shard(job, state)
    return state, storage, path, sorted(entries, key=lambda e: e.offset)


def _assert_landed(
    state: dict[str, torch.Tensor], entries: list, outs: list[np.ndarray], but: object = None
) -> None:
    """Each entry's destination holds its tensor's bytes (all but `but`'s)."""
    for e, out in zip(entries, outs, strict=True):
        if e is not but:
            assert out.tobytes() == state[e.key].numpy().tobytes(), e.key


def _saved(job: str) -> tuple[dict[str, torch.Tensor], object, str, list]:
    g = torch.Generator().manual_seed(3)
    state = {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB: three hash blocks
        "odd": torch.randn(1000, generator=g),  # not a whole page
    }
    return (state, *_save_one_shard(job, state))


@pytest.mark.parametrize("direct_io", [True, False])
def test_read_into_lands_in_the_destination_without_the_sink(job, direct_io):
    state, storage, path, entries = _saved(job)
    with knobs.override(direct_io=direct_io):
        storage = open_storage(job)
        outs = [_aligned(e.length, e.offset % 4096) for e in entries]
        calls: list[int] = []
        problems = read_entries(
            storage,
            path,
            entries,
            knobs.get().block_size,
            sink=lambda i, start, data: calls.append(i),
            into=outs,
        )
    assert problems == []
    assert calls == []  # every entry was read in place, none copied through the sink
    for key, out in zip(("big", "odd"), outs, strict=True):
        assert out.tobytes() == state[key].numpy().tobytes()


def test_unaligned_destination_goes_through_the_sink(job):
    state, storage, path, entries = _saved(job)
    big = entries[0]
    # Not in its page as the entry is in the file: O_DIRECT cannot read into it.
    out = _aligned(big.length, (big.offset + 64) % 4096)
    got = np.zeros(big.length, dtype=np.uint8)

    def sink(i: int, start: int, data: np.ndarray) -> None:
        got[start : start + data.nbytes] = data

    with knobs.override(direct_io=True):
        storage = open_storage(job)
        handle = storage.open_read(path, cold=True)
        direct = getattr(handle, "direct", False)
        handle.close()
        if not direct:
            pytest.skip("this filesystem refuses O_DIRECT")
        read_entries(storage, path, [big], knobs.get().block_size, sink=sink, into=[out])
    assert got.tobytes() == state["big"].numpy().tobytes()
    assert not out.any()  # nothing was read into the unaligned destination


def test_corrupt_block_read_in_place_is_zeroed_and_raises(job, tally):
    state, storage, path, entries = _saved(job)
    big = entries[0]
    block = knobs.get().block_size
    full = storage.local_path(path)
    with open(full, "r+b") as f:  # flip a byte in the second block
        f.seek(big.offset + block + 123)
        b = f.read(1)
        f.seek(big.offset + block + 123)
        f.write(bytes([b[0] ^ 0xFF]))
    out = _aligned(big.length, big.offset % 4096)
    with tally.fault("corrupt:block-read-in-place"):
        with pytest.raises(HashMismatch, match="block 1"):
            read_entries(storage, path, [big], block, into=[out])
    assert not out[block : 2 * block].any()  # the corrupt block did not stay
    want = state["big"].numpy().view(np.uint8)
    assert out[:block].tobytes() == want[:block].tobytes()  # its verified neighbour did


def test_load_into_empty_places_large_tensors_as_in_the_file(job):
    state = {"big": torch.randn(1 << 19), "small": torch.randn(10)}
    ckpt.save(state, job, step=1)
    ck = ckfmt.open_checkpoint(open_storage(job), 1)
    out = ckpt.load({}, job).state
    assert out["big"].data_ptr() % 4096 == ck.chunks["big"][0].entry.offset % 4096
    assert torch.equal(out["big"], state["big"]) and torch.equal(out["small"], state["small"])
    out["big"].add_(1)  # writable, an ordinary tensor to the caller
    assert out["big"].untyped_storage().nbytes() == state["big"].nbytes


def _many(job: str, n: int = 40) -> tuple[dict[str, torch.Tensor], object, str, list]:
    """A shard of many small entries, packed: some whole pages, some not."""
    g = torch.Generator().manual_seed(5)
    state = {
        f"t{i:02d}": torch.randn(1024 * (1 + i % 3) + (i % 2) * 7, generator=g) for i in range(n)
    }
    return _in_file_order(job, state)


@pytest.mark.parametrize("direct_io", [True, False])
def test_neighbouring_entries_are_read_in_one_scatter_read(job, direct_io):
    state, _, path, entries = _many(job)
    with knobs.override(direct_io=direct_io):
        storage = open_storage(job)
        outs = [_aligned(e.length) for e in entries]
        before = counters.snapshot()
        assert read_entries(storage, path, entries, knobs.get().block_size, into=outs) == []
        calls = (counters.snapshot() - before).read_calls
    assert calls == 1  # 40 entries, one preadv (their tails through scratch pages)
    _assert_landed(state, entries, outs)


def test_corrupt_entry_of_a_scatter_read_is_zeroed_and_named(job):
    state, storage, path, entries = _many(job)
    bad = entries[7]
    with open(storage.local_path(path), "r+b") as f:
        f.seek(bad.offset + 5)
        b = f.read(1)
        f.seek(bad.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    outs = [_aligned(e.length) for e in entries]
    with pytest.raises(HashMismatch, match=bad.key):
        read_entries(storage, path, entries, knobs.get().block_size, into=outs)
    assert not outs[7].any()  # the corrupt entry's bytes did not stay
    problems = read_entries(storage, path, entries, knobs.get().block_size, into=outs, collect=True)
    assert [bad.key in str(p) for p in problems] == [True]
    _assert_landed(state, entries, outs, but=bad)


def test_pooled_read_buffers_come_back_after_a_failed_read(job):
    """Windows read into the shared buffer pool (no destination: a verify) give every
    buffer back, also when a read fails, so later reads never wait for one."""
    from ckptd.format import buffers, reader

    state, storage, path, entries = _many(job)
    assert reader.verify_entries(storage, path, entries, knobs.get().block_size) == []
    inner = storage.open_read

    class Failing(_Handle):
        def can_read_into(self, out: np.ndarray, offset: int = 0) -> bool:
            return True

        def read_into(self, offset: int, out: np.ndarray) -> None:
            raise StorageError(5, "the device refused the read")

    storage.open_read = lambda p, cold=False: Failing(inner(p, cold=cold))  # type: ignore[method-assign]
    problems = reader.verify_entries(storage, path, entries, knobs.get().block_size)
    assert problems and all("refused" in str(p) for p in problems)
    assert buffers.READS.out == 0


@pytest.mark.parametrize("cap", [2, 6])
def test_pooled_reads_in_flight_are_the_knobs(job, cap):
    """knobs.pooled_reads is how many reads into the pooled buffers a verify (or a load into
    memory it cannot read into straight) keeps in flight: each read here waits until `cap`
    are in, so fewer would time out, and holds its slot a moment, so more would show."""
    from ckptd.format import buffers, reader

    state = {"w": torch.randn(4 << 20, generator=torch.Generator().manual_seed(7))}  # 16 MiB
    storage, path, entries = _save_one_shard(job, state)
    lock = threading.Condition()
    inflight = [0, 0]  # now, most
    inner = storage.open_read

    class Counting(_Handle):
        def read_into(self, offset: int, out: np.ndarray) -> None:
            with lock:
                inflight[0] += 1
                inflight[1] = max(inflight[1], inflight[0])
                lock.notify_all()
                lock.wait_for(lambda: inflight[0] >= cap, timeout=5)
            time.sleep(0.02)
            try:
                self.h.read_into(offset, out)
            finally:
                with lock:
                    inflight[0] -= 1

    storage.open_read = lambda p, cold=False: Counting(inner(p, cold=cold))  # type: ignore[method-assign]
    with knobs.override(read_window=1 << 20, read_threads=8, pooled_reads=cap):
        assert reader.verify_entries(storage, path, entries, knobs.get().block_size) == []
    assert inflight[1] == cap
    assert buffers.READS.out == 0


def test_pooled_read_buffers_of_different_sizes_are_reused():
    """A window starts where its bytes lie in a page (a version-5 shard), so the pool holds
    buffers of several sizes; taking one back picks it by identity (comparing numpy arrays
    broke this as soon as two sizes were free)."""
    from ckptd.format import buffers

    pool = buffers.Buffers(lambda: knobs.get().read_window + 4096)
    with knobs.override(read_window=1 << 20):
        small, big = pool.take(1 << 20, 4), pool.take(3 << 20, 4)
        assert small.nbytes == 1 << 20 and big.nbytes == 3 << 20
        pool.give(small)
        pool.give(big)
        again = pool.take(2 << 20, 4)  # only the big one fits
        assert buffers.address(again) == buffers.address(big)
        pool.give(again)
        assert pool.out == 0


def test_spans_join_within_the_page_after_the_end():
    from ckptd.storage.base import spans_join

    assert spans_join(100, 100)  # meet inside a page: they share it
    assert spans_join(100, 4096 + 4095)  # in the next page
    assert not spans_join(100, 8192)  # a whole page between them would be read for nothing
    assert spans_join(4096, 4096 + 4095) and not spans_join(4096, 8192)
    assert not spans_join(100, 99)  # overlapping, or out of order


def _random_spans(rng: np.random.Generator, size: int) -> list[tuple[int, int, int]]:
    """(file offset, length, memory phase) of spans that each join the one before: short
    ones (inside a page, or across one edge) at any phase, long ones (whole pages in
    them) in their page as in the file."""
    out: list[tuple[int, int, int]] = []
    at = int(rng.integers(0, 3 * 4096))
    while True:
        n = int(rng.choice([1, 7, 100, 1792, 4000, 4096, 5000, 9000, 3 * 4096 + 17]))
        n = min(n, size - at)
        if n <= 0:
            return out
        holds_page = -(-at // 4096) * 4096 + 4096 <= at + n
        out.append((at, n, at % 4096 if holds_page else int(rng.integers(0, 4096))))
        end = at + n
        at = int(rng.integers(end, -(-end // 4096) * 4096 + 4096))


@pytest.mark.parametrize("direct_io", [True, False])
def test_scatter_read_of_joined_spans_gets_every_byte_in_one_call(tmp_path, direct_io):
    """Spans meeting inside a page, in neighbouring pages, small ones at any place in memory
    and large ones placed by their page phase: one preadv each time, every byte right."""
    rng = np.random.default_rng(11)
    size = 64 * 4096
    data = rng.integers(0, 256, size, dtype=np.uint8)
    (tmp_path / "f.bin").write_bytes(data.tobytes())
    with knobs.override(direct_io=direct_io):
        storage = open_storage(str(tmp_path))
        for _ in range(40):
            spans = _random_spans(rng, size)
            outs = [_aligned(n, phase) for _, n, phase in spans]
            handle = storage.open_read("f.bin", cold=True)
            try:
                before = counters.snapshot()
                handle.read_spans([(at, out) for (at, _, _), out in zip(spans, outs, strict=True)])
                assert (counters.snapshot() - before).read_calls == 1, spans
            finally:
                handle.close()
            for (at, n, _), out in zip(spans, outs, strict=True):
                assert out.tobytes() == data[at : at + n].tobytes(), (at, n)


def _layered(job: str) -> tuple[dict[str, torch.Tensor], object, str, list]:
    """Large weights placed in the file by their memory's page phase (format version 5)
    with a small norm weight (not a whole page) between each layer's: a model's layout."""
    g = torch.Generator().manual_seed(7)
    state: dict[str, torch.Tensor] = {}
    for layer in range(6):
        state[f"l{layer}.norm"] = torch.randn(448, generator=g)  # 1792 bytes
        for j, w in enumerate(("q", "k")):
            skip = 16 * (1 + 2 * layer + j)  # at 64 bytes and more into its page of memory
            state[f"l{layer}.{w}"] = torch.randn(skip + 270_000, generator=g)[skip:]
    return _in_file_order(job, state)


@pytest.mark.parametrize("direct_io", [True, False])
def test_small_entries_join_the_direct_reads_beside_them(job, direct_io):
    state, _, path, entries = _layered(job)
    with knobs.override(direct_io=direct_io):
        storage = open_storage(job)
        # The large ones in their page as in the file; the small ones anywhere.
        outs = [_aligned(e.length, e.offset % 4096 if e.length > 8192 else 1000) for e in entries]
        calls: list[int] = []
        before = counters.snapshot()
        problems = read_entries(
            storage,
            path,
            entries,
            knobs.get().block_size,
            sink=lambda i, start, data: calls.append(i),
            into=outs,
        )
        reads = (counters.snapshot() - before).read_calls
    assert problems == [] and calls == []  # all read in place, none through a pooled window
    assert reads == 1  # 18 entries, 13 MB: one scatter read (not one per small entry)
    _assert_landed(state, entries, outs)


def test_small_entries_between_pooled_ones_share_their_windows(job):
    """The large destinations not in their page as in the file (pooled windows, copied
    through the sink); the small ones page-aligned: they ride in the windows too instead
    of each being a read of its own."""
    state, _, path, entries = _layered(job)
    with knobs.override(direct_io=True):
        storage = open_storage(job)
        if not getattr(storage.open_write("probe.bin", 4096), "direct", False):
            pytest.skip("this filesystem refuses O_DIRECT")
        outs = [
            _aligned(e.length, (e.offset + 64) % 4096 if e.length > 8192 else 0) for e in entries
        ]

        def sink(i: int, start: int, data: np.ndarray) -> None:
            outs[i][start : start + data.nbytes] = data

        before = counters.snapshot()
        assert (
            read_entries(storage, path, entries, knobs.get().block_size, sink=sink, into=outs) == []
        )
        reads = (counters.snapshot() - before).read_calls
    # One pooled window of 13 MB (its last partial page through the bounce buffer: a
    # second call); before, each norm was a read of its own besides.
    assert reads <= 2
    _assert_landed(state, entries, outs)


def test_corrupt_small_entry_joined_to_a_direct_read_is_zeroed_and_named(job, tally):
    state, storage, path, entries = _layered(job)
    bad = next(e for e in entries if e.length < 4096 and e.offset > 100_000)
    with open(storage.local_path(path), "r+b") as f:
        f.seek(bad.offset + 9)
        b = f.read(1)
        f.seek(bad.offset + 9)
        f.write(bytes([b[0] ^ 0xFF]))
    outs = [_aligned(e.length, e.offset % 4096 if e.length > 8192 else 1000) for e in entries]
    with tally.fault("corrupt:small-entry-in-a-scatter-read"):
        with pytest.raises(HashMismatch, match=bad.key.replace(".", r"\.")):
            read_entries(storage, path, entries, knobs.get().block_size, into=outs)
    assert not outs[entries.index(bad)].any()  # its bytes did not stay
    problems = read_entries(storage, path, entries, knobs.get().block_size, into=outs, collect=True)
    assert [bad.key in str(p) for p in problems] == [True]
    _assert_landed(state, entries, outs, but=bad)
