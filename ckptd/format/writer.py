"""Shard writer: one file per rank, parallel positional writes, blake3 per block, fsync.

The file is laid out before a byte moves, packed (format version 2): it holds exactly the
chunks this rank writes, each at the aligned end of the one before, the file padded to the
alignment, so its size is what the rank wrote. The writer cuts it into fixed windows and
writes them from a small thread pool, each window one pwrite: straight from a staging
image (which holds every entry the rank has, replicas others write included) where a
window lies in one run of the image, else gathered (O_DIRECT: the whole pages of pieces
whose memory is page-aligned straight from it, the rest through a bounce buffer, in one
pwritev; buffered: one pwritev from the pieces' memory). The same bytes are hashed on
the hash threads meanwhile (ckptd.iopool): blake3 and the I/O calls both release the GIL,
so the disk and the cores are busy at once, and a caller that plans with the hashes can
do so while the last writes are in flight (write(wait=False)). An O_DIRECT write of
items from their own memory (no image: a one-shot save) is staged instead: the hash
pass copies each window into a pooled huge-page buffer as it hashes it, and the window
is written from there (_Staged says why). Only after the data is
durable is the index written, and only after verification does the caller get a
ShardInfo it may commit.

verify="full" on a handle that writes O_DIRECT checks the bytes while later windows are
still being written: as soon as every write under a read window has returned (so its
bytes left host memory for the device, the page cache bypassed) and its blocks' hashes
are known, the window is read back O_DIRECT and each block's blake3 compared, ahead of
the writes still queued (iopool.Pipeline). The file is then fsynced and nothing is
committed before both. Anything not checked that way (a buffered write, a handle that
fell back to buffered) is re-read after the fsync, the page cache dropped, as before.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import numpy as np

from ckptd import iopool, knobs
from ckptd.errors import CkptError, CorruptCheckpoint, ShardSizeMismatch, StorageError
from ckptd.faults import crash_point
from ckptd.format import buffers, hashing, layout, recycle, tensorstats
from ckptd.format.manifest import (
    ENTRY_ALIGN,
    PHASED_VERSION,
    IndexEntry,
    ShardIndex,
    ShardInfo,
    packing_gap,
)
from ckptd.format.reader import ReadWindow, check_window_pooled, plan_reads, verify_entries
from ckptd.storage.base import Piece, ReadHandle, Storage, WriteHandle
from ckptd.storage.local import copy_into


@dataclasses.dataclass
class WriteItem:
    """One tensor chunk to write: its description and its bytes (1-D uint8, contiguous)."""

    key: str
    dtype: str
    shape: list[int]
    chunk_offsets: list[int]
    chunk_sizes: list[int]
    data: np.ndarray
    # Its health (NaN/Inf counts, sum of squares, max |x|), set by the pass that hashes
    # its bytes (_Hasher) for a floating-point dtype; recorded in the shard index.
    stats: tensorstats.TensorStats | None = None

    def entry(self, offset: int, blake3: list[str], file: str) -> IndexEntry:
        """Its index entry, at `offset` of the shard file `file`, with these block hashes.
        The entry shares the item's lists (nothing changes them in place): a copy of each
        was 6 more lists a tensor alive through a save (the index and the early check), and
        what a save keeps alive decides how often Python's full collections run."""
        return IndexEntry(
            key=self.key,
            dtype=self.dtype,
            shape=self.shape,
            chunk_offsets=self.chunk_offsets,
            chunk_sizes=self.chunk_sizes,
            offset=offset,
            length=self.data.nbytes,
            blake3=blake3,
            file=file,
            stats=self.stats,
        )


def ahead_name(shard_path: str) -> str:
    """The private name of a shard file written ahead of the coordinator's plan
    (ShardWriter's ahead=True) until it is published: beside it, never named by an index
    (so `ckptctl gc` removes one a crash left behind, and retention may recycle it)."""
    stem, dot, ext = shard_path.rpartition(".")
    return f"{stem}.ahead.{ext}" if dot else f"{shard_path}.ahead"


@dataclasses.dataclass
class ShardWriteStats:
    bytes: int = 0
    write_s: float = 0.0
    verify_s: float = 0.0


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def plan_offsets(
    sizes: Sequence[int], alignment: int, phases: Sequence[int] | None = None
) -> tuple[list[int], int]:
    """The byte offset of each entry of the given sizes, in order, and the padded file size.

    Each entry starts at the first offset past the one before that lies `phases[i]` bytes
    into an `alignment` (0 without phases: aligned; format version 2). Phases are where
    the entries' memory lies in its page (memory_phases): the offsets of a version-5
    index (manifest.PHASED_VERSION), whose bytes O_DIRECT takes straight from memory.
    """
    offsets = []
    end = 0
    for i, n in enumerate(sizes):
        phase = phases[i] if phases is not None else 0
        offsets.append(end + (phase - end) % alignment)
        end = offsets[-1] + n
    return offsets, _round_up(end, alignment)


def memory_phases(items: Sequence[WriteItem], alignment: int, least: int) -> list[int]:
    """Where each item's bytes start within an `alignment` of memory: plan_offsets' phases
    for a save that writes the items from their own memory. 0 (the aligned place) for an
    item under `least` bytes (Storage.phased_from) or whose memory is not
    ENTRY_ALIGN-aligned."""
    out = []
    for it in items:
        addr = it.data.ctypes.data if it.data.nbytes >= least else 0
        out.append(addr % alignment if addr % ENTRY_ALIGN == 0 else 0)
    return out


Window = tuple[int, int, list[Piece]]  # (file offset, length, the pieces in it)


def _span_windows(
    spans: Sequence[tuple[int, int, np.ndarray]], window: int, align: int
) -> list[Window]:
    """Windows over the spans' file ranges, each with the spans' bytes that fall in it.

    A span is (file offset, aligned end, bytes from that offset): the bytes may end before
    the aligned end (the handle writes zeros there), and start after the aligned offset
    below (a version-5 shard's entries: zeros there too). Spans are sorted and their bytes
    disjoint; file ranges between spans (none in a packed file) are not written. Each
    window is cut at `window` steps from the start of its contiguous range, so a window
    that lies inside one span's bytes is a single piece (the handle's zero-copy O_DIRECT
    path).
    """
    ranges: list[list[int]] = []
    for off, end, _ in spans:
        if end <= off:
            continue
        start = off - off % align
        if ranges and ranges[-1][1] >= start:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    out: list[Window] = []
    j, n = 0, len(spans)
    for lo, hi in ranges:
        for start in range(lo, hi, window):
            stop = min(hi, start + window)
            pieces: list[Piece] = []
            while j < n and spans[j][0] + spans[j][2].nbytes <= start:
                j += 1
            k = j
            while k < n and spans[k][0] < stop:
                off, _, arr = spans[k]
                a, b = max(start, off), min(stop, off + arr.nbytes)
                if b > a:
                    pieces.append((a, arr[a - off : b - off]))
                k += 1
            out.append((start, stop - start, pieces))
    return out


def _item_windows(
    items: Sequence[WriteItem], offsets: Sequence[int], align: int, window: int
) -> list[Window]:
    """Windows writing the items from their own memory at their file offsets."""
    spans = sorted(
        (
            (off, _round_up(off + it.data.nbytes, align), it.data)
            for off, it in zip(offsets, items, strict=True)
        ),
        key=lambda x: (x[0], x[1]),
    )
    return _span_windows(spans, window, align)


def _gather_windows(
    image: np.ndarray,
    image_offsets: Sequence[int],
    offsets: Sequence[int],
    items: Sequence[WriteItem],
    align: int,
    window: int,
) -> list[Window]:
    """Windows writing items from the staging image (at `image_offsets`) to their packed
    file `offsets`: runs of items that are neighbours in both become one span of the
    image, its padding included. With nothing deduplicated the image is the file and each
    window is one piece of it; a window across a run's edge is a gather (a bounce copy
    under O_DIRECT, one pwritev otherwise)."""
    spans: list[tuple[int, int, np.ndarray]] = []
    src: list[int] = []  # each span's start in the image
    for off, img, it in sorted(zip(offsets, image_offsets, items, strict=True), key=lambda x: x[0]):
        n = _round_up(it.data.nbytes, align)
        if not n:
            continue
        if spans and spans[-1][1] == off and src[-1] + spans[-1][1] - spans[-1][0] == img:
            start = spans[-1][0]
            spans[-1] = (start, off + n, image[src[-1] : img + n])
        else:
            spans.append((off, off + n, image[img : img + n]))
            src.append(img)
    return _span_windows(spans, window, align)


def _hash_groups(
    items: Sequence[WriteItem], block: int, target: int
) -> list[list[tuple[int, int]]]:
    """(item, block) pairs grouped so that each task hashes about `target` bytes."""
    groups: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    acc = 0
    for i, it in enumerate(items):
        for b in range(hashing.n_blocks(it.data.nbytes, block)):
            cur.append((i, b))
            acc += min(block, it.data.nbytes - b * block)
            if acc >= target:
                groups.append(cur)
                cur, acc = [], 0
    if cur:
        groups.append(cur)
    return groups


class ShardWriter:
    """One rank's shard file for one save, written in one or more parts.

    Call order: ShardWriter(...) creates the file at its final size -> write(...) once or
    more (each call writes its items at their offsets from a thread pool, hashing what it
    writes unless digests are given) -> finish(...) fsyncs, writes the index, verifies and
    returns the ShardInfo to report. abort() (or any failure) removes the files. Errors
    name job, step, rank and shard file.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        job: str,
        step: int,
        rank: int,
        world_size: int,
        generation: int,
        size: int,
        preallocate: bool | None = None,
        io_threads: int | None = None,
        verify: str | None = None,
        ahead: bool = False,
    ):
        k = knobs.get()
        # "full": check each window's bytes as soon as they are written (see the module
        # docstring); the offsets of the entries checked that way.
        self.verify_early = verify == "full"
        self._checked: set[int] = set()
        self.storage, self.job, self.step, self.rank = storage, job, step, rank
        self.world_size, self.generation, self.size = world_size, generation, size
        self.block, self.align, self.window = k.block_size, k.alignment, k.io_window
        self.threads = io_threads or k.io_threads
        sdir = layout.step_dir(step)
        self.shard_name = layout.shard_name(rank, generation)
        self.index_name = layout.index_name(rank, generation)
        self.final_path = f"{sdir}/{self.shard_name}"
        # ahead: written under a private name until publish() (see write_ahead's caller,
        # ckpt._save_job), so a save the coordinator then refuses never touches the
        # shard path, which may be a committed step's.
        self.shard_path = ahead_name(self.final_path) if ahead else self.final_path
        self.index_path = f"{sdir}/{self.index_name}"
        self.ctx = f"job {job!r} step {step} rank {rank} shard {storage.url}/{self.final_path}"
        self._open = False
        self._pending: _Pending | None = None
        try:
            storage.makedirs(f"{sdir}/{layout.SHARDS_DIR}")
            # A retired file can be reused: a packed shard's every byte is written (its
            # entries and their padding tile it), so nothing of the old file shows through.
            reuse = recycle.take(storage, size) if k.recycle_files > 0 and size else None
            self.handle = storage.open_write(
                self.shard_path,
                size,
                preallocate=k.preallocate if preallocate is None else preallocate,
                reuse=reuse,
            )
        except BaseException as e:
            _remove_quietly(storage, self.shard_path)
            _reraise(e, self.ctx)
        self._open = True

    def write(
        self,
        items: Sequence[WriteItem],
        offsets: Sequence[int],
        *,
        image: np.ndarray | None = None,
        image_offsets: Sequence[int] | None = None,
        digests: list[list[str]] | None = None,
        progress: Callable[[int], None] | None = None,
        wait: bool = True,
    ) -> list[list[str]]:
        """Write items at their file offsets; returns their block hashes (computed as
        they are written unless `digests` are given). From `image` when given: a staging
        buffer holding item i at image_offsets[i] (see _gather_windows).

        wait=False returns as soon as the hashes are known, the writes still going on, so
        the caller can plan with them meanwhile: written() waits for the writes, and
        publish(), finish() and a later write() call it; abort() stops them."""
        self.written()  # one write() in flight at a time
        hasher = _Hasher(items, self.block) if digests is None else None
        hashes = hasher.hashes if hasher is not None else digests or []

        try:
            if image is not None:
                if image_offsets is None or len(image_offsets) != len(items):
                    raise ValueError("a staging image needs the image offset of every item")
                windows = _gather_windows(
                    image, image_offsets, offsets, items, self.align, self.window
                )
            else:
                windows = _item_windows(items, offsets, self.align, self.window)
            direct = getattr(self.handle, "direct", False)
            early = None
            if self.verify_early and direct:
                try:
                    early = _EarlyCheck(self, items, offsets, hashes, windows)
                except _NoEarlyCheck:
                    early = None
            # From the items' own memory, through the writes' huge-page buffers: see _Staged.
            staged = hasher is not None and image is None and len(windows) > 1 and direct
            # Staged writes are queued as their windows are filled.
            tasks = (
                []
                if staged
                else [
                    functools.partial(self._write_one, w, i, early, progress)
                    for i, w in enumerate(windows)
                ]
            )
            pipe = iopool.Pipeline(iopool.executor(self.threads), self.threads, tasks)
            self._pending = _Pending(pipe, early, offsets)
            if early is not None:
                early.pipe = pipe
            pipe.start()
            if staged:
                assert hasher is not None
                self._pending.staged = _Staged(
                    self.handle, items, offsets, windows, hasher, early, pipe, progress
                )
                self._pending.staged.run(self.threads)
            elif hasher is not None:
                # Beside the writes, not in their slots: when a hash task took one of the
                # writes' slots, fewer writes were in flight and the disk waited
                # (bench/README.md, issue 16 twelfth pass).
                hasher.run_all(
                    self.window, functools.partial(_hash_then, hasher.run, early=early, pipe=pipe)
                )
        except BaseException as e:
            self.abort()
            _reraise(e, self.ctx)
        if wait or pipe.failed:  # a failed write may have left blocks unhashed
            self.written()
        return hashes

    def written(self) -> None:
        """Wait for the writes of a write(wait=False) and their early checks; a failure
        aborts the file and is raised."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            try:
                pending.pipe.wait()
            finally:
                pending.done()
            if pending.early is not None:
                pending.early.check_all_read()
                # Checked only if every byte went O_DIRECT (no fallback to buffered).
                if getattr(self.handle, "direct", False):
                    self._checked.update(pending.offsets)
        except BaseException as e:
            self.abort()
            _reraise(e, self.ctx)

    def _write_one(
        self,
        window: Window,
        i: int,
        early: _EarlyCheck | None,
        progress: Callable[[int], None] | None,
    ) -> None:
        _write_window(self.handle, window[0], window[1], window[2], progress)
        if early is not None:
            early.wrote(i)

    def publish(self) -> None:
        """Rename a file written ahead of the plan to the shard's own name (a no-op for
        one that was not); before finish(), which makes it and its directory durable."""
        self.written()
        if self.shard_path == self.final_path:
            return
        try:
            self.storage.rename(self.shard_path, self.final_path)
        except BaseException as e:
            # The rename may have happened (a failed fsync of the directory after it):
            # the plan made the shard's name this save's, so both names go.
            self.abort()
            _remove_quietly(self.storage, self.final_path)
            _reraise(e, self.ctx)
        self.shard_path = self.final_path

    def finish(
        self,
        items: Sequence[WriteItem],
        offsets: Sequence[int],
        digests: list[list[str]],
        *,
        verify: str = "full",
        stats: ShardWriteStats | None = None,
        borrowed: Sequence[IndexEntry] = (),
        split: Sequence[tuple[int, int, IndexEntry]] = (),
    ) -> ShardInfo:
        """fsync, write the index of `items` (what this shard holds), verify; the ShardInfo.

        The items must tile the file (packed, format version 2): a layout with a gap is
        the caller's bug, refused before the file is made durable. `borrowed`: entries of
        an incremental save whose bytes earlier committed steps hold (their `file`, or
        their `borrowed_blocks`, name them: ckptd.format.incremental.borrowable); listed in
        the index after the items, never written or re-read here (docs/format.md, Borrowed
        entries). `split`: (first, count, entry) of an entry only some blocks of which
        changed (incremental.reuse_blocks): items[first:first + count] are its changed blocks
        (a run each, neighbours in the file), the rest it borrows; the index lists it as
        one entry at items[first]'s offset."""
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
        self.written()
        written = [
            it.entry(off, digests[i], self.shard_name)
            for i, (it, off) in enumerate(zip(items, offsets, strict=True))
        ]
        gap = packing_gap(written, self.size, self.align, PHASED_VERSION)
        parts = {first: (count, e) for first, count, e in split}
        entries: list[IndexEntry] = []
        i = 0
        while i < len(written):
            count, whole = parts.get(i, (1, None))
            if whole is None:
                entries.append(written[i])
            else:
                entries.append(
                    dataclasses.replace(whole, file=self.shard_name, offset=written[i].offset)
                )
            i += count
        entries += [dataclasses.replace(e) for e in borrowed]
        if gap is not None:
            self.abort()
            raise ValueError(f"{self.ctx}: the entries do not tile the shard file: {gap}")
        t0 = time.perf_counter()
        try:
            self.handle.finish()
            self._open = False
        except BaseException as e:
            self.abort()
            _reraise(e, self.ctx)
        if stats is not None:
            stats.write_s += time.perf_counter() - t0  # the fsync belongs to writing
        index = ShardIndex(
            job=self.job,
            step=self.step,
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            shard=self.shard_name,
            shard_size=self.size,
            block_size=self.block,
            alignment=self.align,
            entries=entries,
        )
        index_bytes = index.to_bytes()
        t1 = time.perf_counter()
        try:
            self.storage.write_atomic(self.index_path, index_bytes)
            _verify_written(
                self.storage,
                self.shard_path,
                self.index_path,
                index_bytes,
                index,
                verify,
                self.threads,
                self.ctx,
                written,
                checked=self._checked,
            )
        except BaseException as e:
            self.abort()
            _reraise(e, self.ctx)
        if stats is not None:
            stats.verify_s = time.perf_counter() - t1
            stats.bytes = self.size
        return ShardInfo(
            rank=self.rank,
            path=self.shard_name,
            size=self.size,
            index=self.index_name,
            index_size=len(index_bytes),
            index_blake3=hashing.digest(index_bytes),
            borrows=sorted({k for e in entries for k in e.lenders}),
            index_version=index.version,
        )

    def abort(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:  # writes still in flight: none starts now, the rest end
            pending.pipe.stop(CkptError(f"{self.ctx}: the shard file was aborted"))
            try:
                pending.pipe.wait()
            except BaseException:  # noqa: S110 - the caller raises the failure that aborted
                pass
            finally:
                pending.done()
        if self._open:
            self.handle.abort()
            self._open = False
        _remove_quietly(self.storage, self.shard_path)
        _remove_quietly(self.storage, self.index_path)


def write_shard(
    storage: Storage,
    *,
    job: str,
    step: int,
    rank: int,
    world_size: int,
    generation: int,
    items: Sequence[WriteItem],
    verify: str = "full",
    preallocate: bool | None = None,
    io_threads: int | None = None,
    progress: Callable[[int], None] | None = None,
    stats: ShardWriteStats | None = None,
    digests: list[list[str]] | None = None,
) -> ShardInfo:
    """Write, fsync and verify one rank's shard and its index in one go (see ShardWriter):
    the items packed one after another (aligned), from their own memory."""
    if verify not in ("full", "size"):
        raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
    offsets, size = plan_offsets([it.data.nbytes for it in items], knobs.get().alignment)
    st = stats if stats is not None else ShardWriteStats()
    t0 = time.perf_counter()
    w = ShardWriter(
        storage,
        job=job,
        step=step,
        rank=rank,
        world_size=world_size,
        generation=generation,
        size=size,
        preallocate=preallocate,
        io_threads=io_threads,
        verify=verify,
    )
    hashes = w.write(items, offsets, digests=digests, progress=progress)
    st.write_s = time.perf_counter() - t0
    return w.finish(items, offsets, hashes, verify=verify, stats=st)


def hash_items(items: Sequence[WriteItem]) -> list[list[str]]:
    """Block hashes of every item, on the hash threads (blake3 releases the GIL); each
    floating-point item's health stats are set on it in the same pass (_Hasher)."""
    k = knobs.get()
    hasher = _Hasher(items, k.block_size)
    hasher.run_all(k.io_window)
    return hasher.hashes


class _Hasher:
    """The one pass over a write's bytes: blake3 of each block and, for a floating-point
    item, the block's health stats while it is in cache (ckptd.format.tensorstats; off
    with the knob health_stats). run() takes (item, block) groups from any thread;
    settle() then sets each item's stats."""

    def __init__(self, items: Sequence[WriteItem], block: int):
        self.items, self.block = items, block
        self.hashes = [[""] * hashing.n_blocks(it.data.nbytes, block) for it in items]
        on = knobs.get().health_stats
        # Each block's stats as a plain tuple: the collector stops tracking a tuple of
        # numbers, so the thousands a save keeps until it settles are never moved into its
        # oldest generation, whose full collections a loop of saves pays for (as
        # TensorStats objects they were a fifth of what a save moved there). All items'
        # blocks in one list, item i's from first[i] (-1: no stats), not a list an item.
        self.parts: list[tuple[int, int, float, float]] = []
        self.first: list[int] = []
        for it, h in zip(items, self.hashes, strict=True):
            if on and tensorstats.covered(it.dtype):
                self.first.append(len(self.parts))
                self.parts += [(0, 0, 0.0, 0.0)] * len(h)
            else:
                self.first.append(-1)

    def run(self, group: list[tuple[int, int]]) -> None:
        block = self.block
        for i, b in group:
            self.block_of(i, b, self.items[i].data[b * block : (b + 1) * block])

    def block_of(self, i: int, b: int, data: np.ndarray, copied: bool = False) -> None:
        """Item i's block b, whose bytes are `data`: the item's own or, `copied`, a copy just
        made. A block just copied is in cache, and is hashed first. Any other comes from
        memory: its stats go first, since their plain passes stream the block into cache
        at the memory's pace, and blake3 then reads it from there (about 15% less CPU a
        float32 MiB, 5% a bfloat16 one, on 2 cores: bench/README.md, twenty-fifth pass)."""
        first, dtype = self.first[i], self.items[i].dtype
        if first >= 0 and not copied:
            self.parts[first + b] = tensorstats.block_stats(data, dtype).plain()
        self.hashes[i][b] = hashing.digest(data)
        if first >= 0 and copied:
            self.parts[first + b] = tensorstats.block_stats(data, dtype).plain()

    def run_all(
        self, target: int, task: Callable[[list[tuple[int, int]]], None] | None = None
    ) -> None:
        """Every block, in groups of about `target` bytes on the hash threads (one group
        in the calling thread), each group through `task` (run, or a wrapper of it); then
        settle()."""
        task = task or self.run
        groups = _hash_groups(self.items, self.block, target)
        if len(groups) <= 1:
            for g in groups:
                task(g)
        else:
            pool = iopool.executor(knobs.get().hashers, "hash")
            iopool.wait_all([pool.submit(task, g) for g in groups])
        self.settle()

    def settle(self) -> None:
        for it, first, h in zip(self.items, self.first, self.hashes, strict=True):
            if first >= 0:
                it.stats = tensorstats.combine(self.parts[first : first + len(h)])


def _write_window(
    handle: WriteHandle,
    offset: int,
    length: int,
    pieces: list[Piece],
    progress: Callable[[int], None] | None,
) -> None:
    handle.write(offset, length, pieces)
    crash_point("rank.mid_write")
    if progress is not None:
        progress(length)


def _verify_written(
    storage: Storage,
    shard_path: str,
    index_path: str,
    index_bytes: bytes,
    index: ShardIndex,
    verify: str,
    threads: int,
    ctx: str,
    written: Sequence[IndexEntry],
    checked: set[int] | None = None,
) -> None:
    """Size and index checks; with verify="full" the cold re-read of every range written
    (`written`: the file's ranges, as entries) not `checked` (by offset) already as it was
    written."""
    size = storage.size(shard_path)
    if size != index.shard_size:
        raise ShardSizeMismatch(
            f"{shard_path} is {size} bytes after writing, expected {index.shard_size}"
        )
    reread = storage.read_bytes(index_path, limit=len(index_bytes) + 1)
    if reread != index_bytes:
        raise CorruptCheckpoint(f"{index_path} reads back different from what was written")
    if verify == "full":
        rest = [e for e in written if not checked or e.offset not in checked]
        if not rest:
            return
        problems = verify_entries(storage, shard_path, rest, index.block_size, threads=threads)
        if problems:
            raise problems[0]


def _hash_then(
    fn: Callable[[list[tuple[int, int]]], None],
    group: list[tuple[int, int]],
    early: _EarlyCheck | None,
    pipe: iopool.Pipeline,
) -> None:
    if pipe.failed:  # the file is lost: no point hashing what it would have held
        return
    fn(group)
    if early is not None:
        early.advance()


@dataclasses.dataclass
class _Pending:
    """The writes of a write() call still in flight, their early check and buffers."""

    pipe: iopool.Pipeline
    early: _EarlyCheck | None
    offsets: Sequence[int]
    staged: _Staged | None = None

    def done(self) -> None:
        """Once no write runs: close the read-back's handle, give the buffers back."""
        if self.early is not None:
            self.early.drain()
            self.early.handle.close()
        if self.staged is not None:
            self.staged.give_back()


# How long the staged writes' hash pass waits for a buffer while no write returns before
# it hashes on in place (_Staged): far above a window's write on a working disk.
_STALL_S = 0.5


class _Staged:
    """A write of items from their own memory, each window copied into a pooled huge-page
    buffer by the pass that hashes it, then written from there.

    O_DIRECT from a tensor's memory is slower than from a huge-page buffer: torch leaves a
    CPU tensor in 4 KiB pages, and a device request then carries at most max_segments of
    them (254 pages, about 1 MiB, on virtio) where from huge pages it carries 4 MiB. A
    2 GiB overwrite took 0.74 s from 4 KiB pages and 0.58 from huge pages, at any thread
    count or window (bench/README.md, issue 16 seventeenth pass). The hash pass reads every
    byte anyway: it copies each block into the window's buffer and hashes it (and takes
    its health stats) there while it is in cache, so the copy costs about 7% of the hashing.

    The caller's thread takes the buffers (at most writes in flight + hash threads), so
    no pool thread ever waits for one; a hash task fills a window and queues its write,
    and the write gives the buffer back. A block cut by a window's edge is hashed from
    the item's memory by the window it starts in. The hashes are back once the last
    window is filled, a few windows before the writes end; where no write has returned
    for _STALL_S (a stalled disk, or writes held back until the plan that waits for the
    hashes: ckpt's write_ahead) the windows left are hashed in place and written from the
    items' memory, as without staging.
    """

    def __init__(
        self,
        handle: WriteHandle,
        items: Sequence[WriteItem],
        offsets: Sequence[int],
        windows: list[Window],
        hasher: _Hasher,
        early: _EarlyCheck | None,
        pipe: iopool.Pipeline,
        progress: Callable[[int], None] | None,
    ):
        self.handle, self.items, self.windows = handle, items, windows
        self.hasher, self.early, self.pipe, self.progress = hasher, early, pipe, progress
        self.order = sorted(range(len(items)), key=lambda i: (offsets[i], items[i].data.nbytes))
        self.starts = [offsets[i] for i in self.order]
        self.lock = threading.Lock()
        self.lent: dict[int, np.ndarray] = {}  # window -> its buffer, until written
        self.returned = time.monotonic()  # when a write last returned

    def run(self, writes: int) -> None:
        """Fill every window (its write queued as it is filled); returns when all are
        filled, the items' hashes and stats set."""
        pool = iopool.executor(knobs.get().hashers, "hash")
        limit = writes + knobs.get().hashers
        self.returned = time.monotonic()
        fills = []
        for i, w in enumerate(self.windows):
            buf = buffers.WRITES.take_unless(w[1], limit, self._stalled)
            if self.pipe.failed:  # a write failed: nothing more is written
                if buf is not None:
                    buffers.WRITES.give(buf)
                break
            if buf is not None:
                with self.lock:
                    self.lent[i] = buf
            fills.append(pool.submit(self._fill, i, buf))
        iopool.wait_all(fills)
        if not self.pipe.failed:
            self.hasher.settle()

    def _stalled(self) -> bool:
        return self.pipe.failed or time.monotonic() - self.returned > _STALL_S

    def _fill(self, i: int, buf: np.ndarray | None) -> None:
        """Window i's blocks hashed, copied into `buf` on the way (None: hashed in place),
        and its write queued."""
        if self.pipe.failed:
            return
        start, length, pieces = self.windows[i]
        pos = 0
        for off, arr in pieces:
            at = off - start
            if buf is not None and at > pos:
                buf[pos:at] = 0
            self._hash(off, arr.nbytes, None if buf is None else buf[at : at + arr.nbytes])
            pos = at + arr.nbytes
        if buf is not None and pos < length:
            buf[pos:length] = 0
        if self.early is not None:
            self.early.advance()
        self.pipe.urgent(functools.partial(self._write, i, buf))

    def _hash(self, off: int, n: int, out: np.ndarray | None) -> None:
        """The `n` bytes at file offset `off` (part of one item): copied into `out` block
        by block where given, each block of the item that lies whole in them hashed from
        the copy; a block that starts in them but goes on past them, or every block that
        starts in them when there is no copy, from the item's memory."""
        k = bisect.bisect_right(self.starts, off) - 1
        i = self.order[k]
        data = self.items[i].data
        lo = off - self.starts[k]  # where the bytes lie in the item
        hi = lo + n
        block = self.hasher.block
        for b in range(lo // block, -(-hi // block)):
            bs, be = b * block, min((b + 1) * block, data.nbytes)
            if out is not None:
                a, z = max(bs, lo), min(be, hi)
                copy_into(out[a - lo : z - lo], data[a:z])
                if lo <= bs and be <= hi:
                    self.hasher.block_of(i, b, out[bs - lo : be - lo], copied=True)
                    continue
            if lo <= bs:
                self.hasher.block_of(i, b, data[bs:be])

    def _write(self, i: int, buf: np.ndarray | None) -> None:
        start, length, pieces = self.windows[i]
        try:
            _write_window(
                self.handle, start, length, pieces if buf is None else [(start, buf)], self.progress
            )
        finally:
            if buf is not None:
                with self.lock:
                    self.lent.pop(i, None)
                buffers.WRITES.give(buf)
            self.returned = time.monotonic()
        if self.early is not None:
            self.early.wrote(i)

    def give_back(self) -> None:
        """The buffers of windows never written (a write failed, the file was aborted)."""
        with self.lock:
            lent, self.lent = self.lent, {}
        for buf in lent.values():
            buffers.WRITES.give(buf)


class _EarlyCheck:
    """The read-back of one write() call, window by window, as the writes return.

    A read window (whole blocks, as a load reads them) is checked once every write window
    before its end has returned and its blocks' hashes are known; it runs on the writer's
    pipeline ahead of the queued writes. Each write window that returns or hash group that
    finishes advances the frontier.
    """

    def __init__(
        self,
        writer: ShardWriter,
        items: Sequence[WriteItem],
        offsets: Sequence[int],
        hashes: list[list[str]],
        windows: list[Window],
    ):
        self.writer = writer
        self.entries = [  # their hashes filled in by the hash tasks
            it.entry(off, hashes[i], writer.shard_name)
            for i, (it, off) in enumerate(zip(items, offsets, strict=True))
        ]
        k = knobs.get()
        self.reads: list[ReadWindow] = plan_reads(self.entries, writer.block, k.read_window)
        order = sorted(range(len(windows)), key=lambda i: windows[i][0])
        self.rank_of = {w: r for r, w in enumerate(order)}  # write window -> position
        self.starts = [windows[w][0] for w in order]
        self.done = [False] * len(order)
        self.frontier = 0  # write windows [0, frontier) in file order have all returned
        self.next = 0
        self.lock = threading.Lock()
        self.pipe: iopool.Pipeline | None = None
        self.checks: list[futures.Future[list[CorruptCheckpoint]]] = []
        self.handle: ReadHandle = writer.storage.open_read(writer.shard_path, cold=True)
        if not getattr(self.handle, "direct", False):
            self.handle.close()  # a buffered read-back could see the page cache
            raise _NoEarlyCheck

    def wrote(self, window: int) -> None:
        with self.lock:
            self.done[self.rank_of[window]] = True
        self.advance()

    def advance(self) -> None:
        ready = []
        with self.lock:
            while self.frontier < len(self.done) and self.done[self.frontier]:
                self.frontier += 1
            written_to = self.starts[self.frontier] if self.frontier < len(self.starts) else 1 << 62
            while self.next < len(self.reads):
                r = self.reads[self.next]
                if r.offset + r.length > written_to or not all(
                    self.entries[p.entry].blake3[p.block] for p in r.parts
                ):
                    break
                ready.append(r)
                self.next += 1
        assert self.pipe is not None
        for r in ready:
            self.pipe.urgent(functools.partial(self.check, r))

    def check(self, r: ReadWindow) -> None:
        # Hashed on the hash threads, so that this I/O slot goes on to the next transfer
        # (hashed in the slot, a 2.13 GB save(full) took 2.16 s, 2.07 s this way: 7 reps
        # alternated, bench/README.md, issue 16 seventeenth pass). A mismatch stops the
        # writes still queued, as one found in the slot did.
        w = self.writer
        k = knobs.get()
        assert self.pipe is not None
        f = check_window_pooled(
            w.storage,
            w.shard_path,
            self.handle,
            r,
            self.entries,
            iopool.executor(k.hashers, "hash"),
            w.threads + k.hashers,
            self.pipe.stop,
        )
        with self.lock:
            self.checks.append(f)

    def drain(self) -> None:
        """Wait for the checks still hashing (their failures are check_all_read's)."""
        with self.lock:
            checks = list(self.checks)
        futures.wait(checks)

    def check_all_read(self) -> None:
        """After _Pending.done() drained the checks: the first failure raised, and a
        window never read back is a bug."""
        iopool.wait_all(self.checks)
        if self.next < len(self.reads):  # every task ended, so every window was ready
            raise CorruptCheckpoint(
                f"{self.writer.ctx}: {len(self.reads) - self.next} windows were not read "
                "back; this is a bug in ckptd, nothing was committed"
            )


class _NoEarlyCheck(Exception):
    pass


def _with_context(e: BaseException, ctx: str) -> BaseException:
    """The same error with job/step/rank/shard prefixed; foreign OSErrors become StorageError."""
    if isinstance(e, CkptError):
        if isinstance(e, OSError) and e.errno is not None:
            return type(e)(e.errno, f"{ctx}: {e.strerror}")
        return type(e)(f"{ctx}: {e}")
    if isinstance(e, OSError):
        return StorageError(e.errno or 0, f"{ctx}: {e}")
    return e


def _reraise(e: BaseException, ctx: str) -> None:
    new = _with_context(e, ctx)
    if new is e:
        raise e
    raise new from e


def _remove_quietly(storage: Storage, path: str) -> None:
    try:
        storage.remove_tree(path)
    except Exception:  # noqa: S110 - best effort cleanup; the original error is raised
        pass
