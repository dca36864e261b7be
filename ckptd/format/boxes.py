"""Read boxes of saved tensors from a committed step, whatever the sharding at save time.

A `BoxRead` asks for the box [offsets, offsets+sizes) of one key's global tensor, to be
written C-contiguous into a byte buffer. `plan_box` finds the saved chunks that overlap
it (and proves they cover it exactly once); `plan_boxes` groups the overlaps by shard
file (each saved entry's stored pieces, OpenCheckpoint.pieces: an entry that borrows some
blocks is read from several files), and `read_planned` (`read_boxes` does both) reads
the hash blocks that cover them (ckptd.format.reader: parallel, each block verified
before use) and copies every overlap from the I/O buffer into its destination
(ckptd.format.reshard). A box whose bytes numpy cannot reach (a CUDA tensor) is a
`ByteDest` instead: every verified run is handed to it as it is hashed. The client's load
(ckpt._restore) and `ckptctl restore` both read through here; neither knows about blocks
or shards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from ckptd.errors import CorruptCheckpoint, InvalidManifest, StateMismatch
from ckptd.format import dtypes
from ckptd.format.checkpoint import Chunk, OpenCheckpoint
from ckptd.format.manifest import IndexEntry
from ckptd.format.reader import EntryRead, covering_blocks, read_entries
from ckptd.format.reshard import Overlap, intersect


class ByteDest(Protocol):
    """A box's bytes where numpy cannot write them (a device tensor's memory): verified
    bytes are handed over as they are hashed, one contiguous run at a time. Only a box
    whose every overlap with a saved chunk is one contiguous run can have one
    (`contiguous_box`)."""

    nbytes: int

    def write(self, at: int, data: np.ndarray) -> None:
        """Put `data` at byte `at` of the box; `data` is reused once this returns."""
        ...


@dataclasses.dataclass
class BoxRead:
    key: str
    offsets: Sequence[int]
    sizes: Sequence[int]
    # The C-contiguous bytes of the box (numel * itemsize): a uint8 array, or a ByteDest.
    out: np.ndarray | ByteDest


def saved_entry(ck: OpenCheckpoint, key: str) -> IndexEntry:
    """The first index entry of a key, after checking that all its chunks agree."""
    chunks = ck.chunks[key]
    first = chunks[0].entry
    for c in chunks[1:]:
        if c.entry.dtype != first.dtype or c.entry.shape != first.shape:
            raise InvalidManifest(
                f"{ck.storage.url} step {ck.step}: key {key!r} is saved as "
                f"{first.dtype}{first.shape} in {chunks[0].shard.path} and "
                f"{c.entry.dtype}{c.entry.shape} in {c.shard.path}"
            )
    return first


def plan_box(
    ck: OpenCheckpoint, key: str, offsets: Sequence[int], sizes: Sequence[int]
) -> list[tuple[Chunk, Overlap]]:
    """The saved chunks that overlap the box, with their overlaps; raises unless they
    cover every element of the box exactly once."""
    where = f"{ck.storage.url} step {ck.step}: key {key!r}"
    chunks = ck.chunks[key]
    entry = saved_entry(ck, key)
    if len(offsets) != len(entry.shape) or len(sizes) != len(entry.shape):
        raise StateMismatch(f"{where}: a box of rank {len(sizes)} for a tensor of {entry.shape}")
    for o, n, dim in zip(offsets, sizes, entry.shape, strict=True):
        if o < 0 or n < 0 or o + n > dim:
            raise StateMismatch(f"{where}: box {list(offsets)}+{list(sizes)} outside {entry.shape}")
    itemsize = dtypes.itemsize(entry.dtype)
    want = math.prod(sizes)
    if want == 0:
        return []
    out: list[tuple[Chunk, Overlap]] = []
    for c in chunks:
        ov = overlap_of(
            tuple(c.entry.chunk_offsets),
            tuple(c.entry.chunk_sizes),
            tuple(offsets),
            tuple(sizes),
            itemsize,
        )
        if ov is not None:
            out.append((c, ov))
    # Saved chunks of one key are disjoint (replicas are written once); check it, so that
    # the element count below proves every wanted element has exactly one source.
    for i in range(len(out)):
        a = out[i][0].entry
        for j in range(i + 1, len(out)):
            b = out[j][0].entry
            if intersect(a.chunk_offsets, a.chunk_sizes, b.chunk_offsets, b.chunk_sizes):
                raise InvalidManifest(
                    f"{where}: saved chunks in {out[i][0].shard.path} and "
                    f"{out[j][0].shard.path} overlap"
                )
    covered = sum(o.nbytes for _, o in out) // itemsize
    if covered != want:
        raise StateMismatch(
            f"{where}: the saved chunks cover {covered} of the {want} elements wanted"
        )
    return out


@functools.lru_cache(maxsize=4096)
def overlap_of(
    src_offsets: tuple[int, ...],
    src_sizes: tuple[int, ...],
    dst_offsets: tuple[int, ...],
    dst_sizes: tuple[int, ...],
    itemsize: int,
) -> Overlap | None:
    """The Overlap of a saved box with a wanted one (None: no element in common). Kept by
    geometry: a model repeats a few shapes many times, and an Overlap is never changed."""
    if (
        math.prod(src_sizes) == 0
        or intersect(src_offsets, src_sizes, dst_offsets, dst_sizes) is None
    ):
        return None
    return Overlap(src_offsets, src_sizes, dst_offsets, dst_sizes, itemsize)


def contiguous_box(
    ck: OpenCheckpoint, key: str, offsets: Sequence[int], sizes: Sequence[int]
) -> bool:
    """Whether every saved chunk's overlap with the box is one contiguous run of it (the
    whole tensor, or a dim-0 slice, saved either way): then a ByteDest can take it."""
    return all(ov.contiguous for _, ov in plan_box(ck, key, offsets, sizes))


@dataclasses.dataclass
class ShardReads:
    """What a set of boxes needs from one shard file: its reads and where each one goes."""

    shard: int  # position of the file in OpenCheckpoint.files
    path: str  # the file, relative to the job directory (an earlier step's when borrowed)
    reads: list[EntryRead]
    sinks: list[Callable[[int, np.ndarray], Any]]  # (byte offset in the entry, verified bytes)
    # Where a read's whole entry lands unchanged in its box (else None): the reader may
    # read straight into it (ckptd.format.reader).
    into: list[np.ndarray | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class BoxPlan:
    """Every shard read a set of boxes needs, by shard file, and the bytes they read."""

    shards: list[ShardReads]
    bytes: int  # whole hash blocks


def plan_boxes(ck: OpenCheckpoint, boxes: Sequence[BoxRead]) -> BoxPlan:
    """The reads of every box, grouped by shard file; touches no tensor byte."""
    block = ck.manifest.block_size
    per_shard: dict[str, ShardReads] = {}
    total = 0
    for box in boxes:
        entry = saved_entry(ck, box.key)
        need = math.prod(box.sizes) * dtypes.itemsize(entry.dtype)
        host, dest = (box.out, None) if isinstance(box.out, np.ndarray) else (None, box.out)
        if (host is not None and host.dtype != np.uint8) or box.out.nbytes != need:
            raise ValueError(f"key {box.key!r}: the buffer for the box must be {need} bytes")
        for chunk, ov in plan_box(ck, box.key, box.offsets, box.sizes):
            if host is None and not ov.contiguous:
                raise ValueError(
                    f"key {box.key!r}: a saved chunk in {chunk.shard.path} fills the box in "
                    "strided runs, which only a host buffer can take"
                )
            ranges = None if ov.whole else ov.ranges(block)
            whole = host is not None and ov.whole and ranges is None
            # Each stored piece of the entry (its own shard, an earlier step's it borrows
            # from, or, blocks of it borrowed, several): ck.pieces, the one rule.
            for shard_no, piece in ck.pieces(chunk.entry):
                sub = _piece_ranges(piece, ranges)
                if sub is not None and not sub:
                    continue  # the box needs no byte of this piece
                path = ck.files[shard_no]
                reads = per_shard.get(path)
                if reads is None:
                    reads = per_shard[path] = ShardReads(shard_no, path, [], [])
                reads.reads.append(EntryRead(piece, sub))
                at = ov.dst_start + piece.start
                if dest is None:
                    assert host is not None
                    reads.sinks.append(functools.partial(_copy_piece, ov, host, piece.start))
                    reads.into.append(host[at : at + piece.length] if whole else None)
                else:
                    reads.sinks.append(functools.partial(_write_piece, ov, dest, piece.start))
                    reads.into.append(None)
                if sub is None:
                    total += piece.length  # every block of it
                    continue
                for b in covering_blocks(piece.length, block, sub):
                    total += min(block, piece.length - b * block)
    return BoxPlan(sorted(per_shard.values(), key=lambda r: r.shard), total)


def _piece_ranges(
    piece: IndexEntry, ranges: Sequence[tuple[int, int]] | None
) -> list[tuple[int, int]] | None:
    """The byte ranges of an entry (None: all of it) that fall in one of its pieces, in the
    piece's own bytes (None: all of it)."""
    if ranges is None:
        return None
    lo, hi = piece.start, piece.start + piece.length
    out = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if a < hi and b > lo]
    return None if out == [(0, piece.length)] else out


def _copy_piece(ov: Overlap, out: np.ndarray, start: int, at: int, data: np.ndarray) -> None:
    """A piece's verified bytes at `at` inside it are the entry's bytes at start + at."""
    ov.copy(out, start + at, data)


def _write_piece(ov: Overlap, out: ByteDest, start: int, at: int, data: np.ndarray) -> None:
    """_copy_piece for a ByteDest (the overlap is one contiguous run)."""
    run = ov.run_in(start + at, data.nbytes)
    if run is not None:
        dst, lo, hi = run
        out.write(dst, data[lo:hi])


def read_planned(
    ck: OpenCheckpoint,
    plan: BoxPlan,
    *,
    threads: int | None = None,
    cold: bool = True,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Read every shard read of the plan from storage, verified; the bytes read."""
    block = ck.manifest.block_size

    def load_shard(sr: ShardReads) -> None:
        def sink(i: int, start: int, data: np.ndarray) -> None:
            sr.sinks[i](start, data)

        try:
            read_entries(
                ck.storage,
                sr.path,
                sr.reads,
                block,
                sink=sink,
                threads=threads,
                cold=cold,
                progress=progress,
                into=sr.into or None,
            )
        except CorruptCheckpoint as e:
            raise borrowed_context(ck, sr.shard, e)  # noqa: B904 - keeps e's own cause

    if len(plan.shards) == 1:
        load_shard(plan.shards[0])
    elif plan.shards:
        with ThreadPoolExecutor(min(4, len(plan.shards))) as pool:
            list(pool.map(load_shard, plan.shards))
    return plan.bytes


def borrowed_context(ck: OpenCheckpoint, file: int, e: CorruptCheckpoint) -> CorruptCheckpoint:
    """`e` (a read of file number `file` of `ck` failed), saying which step borrowed the
    bytes when the file is a lender's: the error names the lender's file, not the step."""
    if file < len(ck.manifest.shards):
        return e
    new = type(e)(
        f"job {ck.storage.url} step {ck.step} borrows bytes from {ck.files[file]}, and "
        f"they fail: {e}"
    )
    # The cause is the load policy's evidence (a read the device refused is transient,
    # never quarantined: ckpt._load), so it stays the original's.
    new.__cause__ = e.__cause__
    return new


def read_boxes(
    ck: OpenCheckpoint,
    boxes: Sequence[BoxRead],
    *,
    threads: int | None = None,
    cold: bool = True,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Read every box, verified; returns the bytes read from storage (whole blocks)."""
    return read_planned(ck, plan_boxes(ck, boxes), threads=threads, cold=cold, progress=progress)
