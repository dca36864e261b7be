"""Shard reader: parallel positional reads of whole hash blocks, verified before use.

Reads are planned as windows: a large entry is read block by block (each block one
read, so its hash can be checked from one buffer), small neighbouring entries are
coalesced into one read. Every block is hashed before its bytes are handed to the sink
(the copy into the destination tensor), so a corrupt block never reaches the caller's
memory. The same machinery serves load, verification after write, and `ckptctl verify`.

A read may ask for byte ranges of an entry rather than all of it (a resharded load needs
the overlap of a saved chunk with the chunk a rank wants): only the blocks that cover
those ranges are read, and they are read whole, because a block can only be verified
whole. The sink then sees every byte of those blocks, verified, and picks what it needs;
nothing outside the covering blocks is read.

Where the caller gives an entry's destination (the whole entry, C-contiguous) and the
storage can read straight into it (page-aligned memory under O_DIRECT), the entry is read
there in windows and each block is hashed in place: no bounce buffer, no copy, and the
sink is not called. A block whose hash does not match is zeroed before the error is
raised, so its bytes never remain in the caller's memory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np

from ckptd import iopool, knobs
from ckptd.errors import CorruptCheckpoint, HashMismatch, StorageError
from ckptd.format import hashing
from ckptd.format.manifest import IndexEntry
from ckptd.storage.base import ReadHandle, Storage

# sink(entry position in the list, byte offset inside the entry, verified bytes)
Sink = Callable[[int, int, np.ndarray], None]


@dataclasses.dataclass
class ReadPart:
    entry: int  # position in the entries list
    block: int
    start: int  # byte offset inside the entry
    length: int
    at: int  # byte offset inside the window


@dataclasses.dataclass
class ReadWindow:
    offset: int
    length: int
    parts: list[ReadPart]


@dataclasses.dataclass
class EntryRead:
    """What to read of one entry: byte ranges [start, end) inside it, or all of it (None)."""

    entry: IndexEntry
    ranges: Sequence[tuple[int, int]] | None = None


def covering_blocks(length: int, block: int, ranges: Sequence[tuple[int, int]] | None) -> list[int]:
    """The blocks of an entry of `length` bytes that hold any byte of `ranges`, ascending."""
    n = hashing.n_blocks(length, block)
    if ranges is None:
        return list(range(n))
    out: set[int] = set()
    for start, end in ranges:
        if not 0 <= start <= end <= length:
            raise ValueError(f"byte range [{start}, {end}) is outside an entry of {length} bytes")
        if end > start:
            out.update(range(start // block, (end - 1) // block + 1))
    return sorted(out)


def plan_reads(
    entries: Sequence[IndexEntry | EntryRead], block: int, window: int, gap: int = 4096
) -> list[ReadWindow]:
    """Windows of whole blocks, coalescing neighbours separated by at most `gap` bytes.

    An EntryRead with ranges reads only the blocks covering them; blocks it skips split
    windows like any other gap.
    """
    reads = [r if isinstance(r, EntryRead) else EntryRead(r) for r in entries]
    order = sorted(range(len(reads)), key=lambda i: reads[i].entry.offset)
    limit = max(window, block)
    out: list[ReadWindow] = []
    cur: ReadWindow | None = None
    for i in order:
        e = reads[i].entry
        for b in covering_blocks(e.length, block, reads[i].ranges):
            s = b * block
            n = min(block, e.length - s)
            lo = e.offset + s
            if (
                cur is not None
                and lo - (cur.offset + cur.length) <= gap
                and lo + n - cur.offset <= limit
            ):
                cur.parts.append(ReadPart(i, b, s, n, lo - cur.offset))
                cur.length = lo + n - cur.offset
            else:
                cur = ReadWindow(lo, n, [ReadPart(i, b, s, n, 0)])
                out.append(cur)
    return out


def read_entries(
    storage: Storage,
    path: str,
    entries: Sequence[IndexEntry | EntryRead],
    block: int,
    *,
    sink: Sink | None = None,
    cold: bool = True,
    threads: int | None = None,
    collect: bool = False,
    progress: Callable[[int], None] | None = None,
    into: Sequence[np.ndarray | None] | None = None,
) -> list[CorruptCheckpoint]:
    """Read and verify the blocks of `entries` from one shard file.

    An IndexEntry is read whole; an EntryRead with ranges reads the whole blocks that cover
    its ranges. The sink gets (position in `entries`, byte offset of the data inside the
    entry, verified bytes): one call per block, always a whole block, which may extend past
    the requested ranges. The bytes may live in a per-thread buffer: consume them in the
    sink. With collect=False the first mismatch raises HashMismatch; with collect=True all
    problems are returned (ckptctl verify reports every bad key, not the first).
    into[i], where given: the destination of all of entry i (entry.length bytes); the
    entry is read straight into it when the handle can (see the module docstring).
    """
    k = knobs.get()
    plain = [r.entry if isinstance(r, EntryRead) else r for r in entries]
    handle = storage.open_read(path, cold=cold)

    def mismatch(ent: IndexEntry, b: int, start: int, length: int, got: str) -> HashMismatch:
        return _mismatch(storage, path, ent, b, start, length, got)

    def failed(ent: IndexEntry, offset: int, length: int, e: StorageError) -> CorruptCheckpoint:
        return _failed(storage, path, ent, offset, length, e)

    def read_window(w: ReadWindow) -> list[CorruptCheckpoint]:
        return check_window(
            storage, path, handle, w, plain, collect=collect, sink=sink, progress=progress
        )

    def read_direct(i: int, start: int, out: np.ndarray) -> list[CorruptCheckpoint]:
        ent = plain[i]
        try:
            handle.read_into(ent.offset + start, out)
        except StorageError as e:
            out.fill(0)
            err = failed(ent, ent.offset + start, out.nbytes, e)
            if not collect:
                raise err from e
            return [err]
        bad: list[CorruptCheckpoint] = []
        for s in range(0, out.nbytes, block):
            view = out[s : s + block]
            b = (start + s) // block
            got = hashing.digest(view)
            if got != ent.blake3[b]:
                view.fill(0)  # unverified bytes never stay in the caller's memory
                err = mismatch(ent, b, start + s, view.nbytes, got)
                if not collect:
                    raise err
                bad.append(err)
        if progress is not None:
            progress(out.nbytes)
        return bad

    problems: list[CorruptCheckpoint] = []
    try:
        direct: dict[int, np.ndarray] = {}
        for i, out in enumerate(into or ()):
            r = entries[i]
            whole = not isinstance(r, EntryRead) or r.ranges is None
            if out is not None and whole and plain[i].length and handle.can_read_into(out):
                if out.nbytes != plain[i].length:
                    raise ValueError(f"key {plain[i].key!r}: a destination of the wrong size")
                direct[i] = out
        rest = [i for i in range(len(entries)) if i not in direct]
        windows = plan_reads([entries[i] for i in rest], block, k.read_window)
        for w in windows:
            for p in w.parts:
                p.entry = rest[p.entry]
        tasks: list[tuple[int, Callable[[], list[CorruptCheckpoint]]]] = [
            (w.offset, functools.partial(read_window, w)) for w in windows
        ]
        span = max(block, k.read_window // block * block)  # whole blocks per read
        for i, out in direct.items():
            e = plain[i]
            for s in range(0, e.length, span):
                part = out[s : min(e.length, s + span)]
                tasks.append((e.offset + s, functools.partial(read_direct, i, s, part)))
        tasks.sort(key=lambda t: t[0])  # in file order: the disk sees one stream
        pool = iopool.executor(threads or k.io_threads)
        for found in iopool.wait_all([pool.submit(fn) for _, fn in tasks]):
            problems.extend(found)
    finally:
        handle.close()
    return problems


def _mismatch(
    storage: Storage, path: str, ent: IndexEntry, b: int, start: int, length: int, got: str
) -> HashMismatch:
    return HashMismatch(
        f"{storage.url}/{path}: key {ent.key!r} block {ent.first_block + b} "
        f"(file bytes {ent.offset + start}..{ent.offset + start + length}) "
        f"has blake3 {got[:16]}..., the index says {ent.blake3[b][:16]}...; "
        "the shard is corrupt: restore an earlier step or a replica"
    )


def _failed(
    storage: Storage, path: str, ent: IndexEntry, offset: int, length: int, e: StorageError
) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"{storage.url}/{path}: reading bytes {offset}..{offset + length} "
        f"(key {ent.key!r}) failed: {e}"
    )


def check_window(
    storage: Storage,
    path: str,
    handle: ReadHandle,
    w: ReadWindow,
    entries: Sequence[IndexEntry],
    *,
    collect: bool = False,
    sink: Sink | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[CorruptCheckpoint]:
    """Read one planned window through `handle` and check each of its blocks against
    entries[part.entry].blake3; verified blocks go to the sink. The problems (collect),
    else the first one raised."""
    bad: list[CorruptCheckpoint] = []
    try:
        data = handle.read(w.offset, w.length)
    except StorageError as e:
        err = _failed(storage, path, entries[w.parts[0].entry], w.offset, w.length, e)
        if not collect:
            raise err from e
        return [err]
    for p in w.parts:
        view = data[p.at : p.at + p.length]
        ent = entries[p.entry]
        got = hashing.digest(view)
        if got != ent.blake3[p.block]:
            err = _mismatch(storage, path, ent, p.block, p.start, p.length, got)
            if not collect:
                raise err
            bad.append(err)
        elif sink is not None:
            sink(p.entry, p.start, view)
    if progress is not None:
        progress(w.length)
    return bad


def verify_entries(
    storage: Storage,
    path: str,
    entries: Sequence[IndexEntry],
    block: int,
    *,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[CorruptCheckpoint]:
    """Re-read a shard cold and check every block; return all problems found."""
    return read_entries(
        storage, path, entries, block, cold=True, threads=threads, collect=True, progress=progress
    )
