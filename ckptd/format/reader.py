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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ckptd import iopool, knobs
from ckptd.errors import CorruptCheckpoint, HashMismatch, StorageError
from ckptd.format import hashing
from ckptd.format.manifest import IndexEntry
from ckptd.storage.base import Storage

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
) -> list[CorruptCheckpoint]:
    """Read and verify the blocks of `entries` from one shard file.

    An IndexEntry is read whole; an EntryRead with ranges reads the whole blocks that cover
    its ranges. The sink gets (position in `entries`, byte offset of the data inside the
    entry, verified bytes): one call per block, always a whole block, which may extend past
    the requested ranges. The bytes may live in a per-thread buffer: consume them in the
    sink. With collect=False the first mismatch raises HashMismatch; with collect=True all
    problems are returned (ckptctl verify reports every bad key, not the first).
    """
    k = knobs.get()
    windows = plan_reads(entries, block, k.read_window)
    if not windows:
        return []
    plain = [r.entry if isinstance(r, EntryRead) else r for r in entries]
    handle = storage.open_read(path, cold=cold)
    problems: list[CorruptCheckpoint] = []

    def run(w: ReadWindow) -> list[CorruptCheckpoint]:
        bad: list[CorruptCheckpoint] = []
        try:
            data = handle.read(w.offset, w.length)
        except StorageError as e:
            err = CorruptCheckpoint(
                f"{storage.url}/{path}: reading bytes {w.offset}..{w.offset + w.length} "
                f"(key {plain[w.parts[0].entry].key!r}) failed: {e}"
            )
            if not collect:
                raise err from e
            return [err]
        for p in w.parts:
            view = data[p.at : p.at + p.length]
            ent = plain[p.entry]
            got = hashing.digest(view)
            if got != ent.blake3[p.block]:
                err = HashMismatch(
                    f"{storage.url}/{path}: key {ent.key!r} block {p.block} "
                    f"(file bytes {ent.offset + p.start}..{ent.offset + p.start + p.length}) "
                    f"has blake3 {got[:16]}..., the index says {ent.blake3[p.block][:16]}...; "
                    "the shard is corrupt: restore an earlier step or a replica"
                )
                if not collect:
                    raise err
                bad.append(err)
            elif sink is not None:
                sink(p.entry, p.start, view)
        if progress is not None:
            progress(w.length)
        return bad

    try:
        pool = iopool.executor(threads or k.io_threads)
        for found in iopool.wait_all([pool.submit(run, w) for w in windows]):
            problems.extend(found)
    finally:
        handle.close()
    return problems


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
