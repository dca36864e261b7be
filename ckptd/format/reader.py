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
raised, so its bytes never remain in the caller's memory (nor do bytes read but never
hashed because the read failed elsewhere first).

Reading and hashing are a pipeline: the I/O threads only read (in file order, into the
destination or into a pooled page-aligned buffer) and hand each window to a hash task on
a pool of its own (knobs `hash_threads`), which checks it, calls the sink and frees the
buffer. A thread that read and then hashed left the disk idle while it hashed, and the
threads fell into step (all reading, then all hashing): on 2 cores with a disk faster
than the hash, a load ran at about 1/(1/read + 1/hash) instead of min(read, hash)
(bench/README.md, issue 16 fourth pass). Handles that cannot read into a buffer of ours
(object stores, the memory tier) still read and hash on one thread.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ckptd import iopool, knobs
from ckptd.errors import CorruptCheckpoint, HashMismatch, StorageError
from ckptd.format import buffers, hashing
from ckptd.format.manifest import IndexEntry
from ckptd.storage.base import ReadHandle, Storage, holds_page, spans_join
from ckptd.storage.local import ALIGN

_HASH_PIECE = 8 << 20  # bytes of a read straight into its destination hashed per task

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
    the requested ranges. The bytes may live in a buffer reused after the call: consume
    them in the sink (it may run on a hashing thread). With collect=False the first
    mismatch raises HashMismatch; with collect=True all problems are returned (ckptctl
    verify reports every bad key, not the first). into[i], where given: the destination of
    all of entry i (entry.length bytes); the entry is read straight into it when the
    handle can (see the module docstring).

    `threads` (default: the knobs' read_threads) read, on the shared I/O pool; the knobs'
    `hashers` hash, on a pool of their own, so that reads go on while earlier bytes are
    hashed (ckptd.iopool).
    """
    k = knobs.get()
    plain = [r.entry if isinstance(r, EntryRead) else r for r in entries]
    handle = storage.open_read(path, cold=cold)
    readers = threads or k.read_threads
    hashes = _Hashes(iopool.executor(k.hashers, "hash"))

    def mismatch(ent: IndexEntry, b: int, start: int, length: int, got: str) -> HashMismatch:
        return _mismatch(storage, path, ent, b, start, length, got)

    def failed(ent: IndexEntry, offset: int, length: int, e: StorageError) -> CorruptCheckpoint:
        return _failed(storage, path, ent, offset, length, e)

    def hash_window(w: ReadWindow, data: np.ndarray) -> list[CorruptCheckpoint]:
        return _check_parts(storage, path, w, data, plain, collect, sink, progress)

    # Reads into pooled buffers: at most `reads_in_flight` (the knob pooled_reads) at once,
    # and that many + hashers buffers, so that a buffer is always free for a read while
    # others wait for their hash (with 8 readers and 6 buffers, every buffer could be in a
    # read at once, and then no read could start until a hash task freed one). What made
    # verify slow (0.6 of a cold read of the same file) was the buffers' pages, not this:
    # see ckptd.storage.local.map_populated.
    reads_in_flight = max(1, min(readers, k.pooled_reads))
    reading = threading.Semaphore(reads_in_flight)

    def read_window(w: ReadWindow) -> list[CorruptCheckpoint]:
        """Into a pooled buffer, hashed (and sunk) by a hash task that frees the buffer."""
        with reading:
            try:
                buf, data = _read_pooled(handle, w, reads_in_flight + k.hashers)
            except StorageError as e:
                err = failed(plain[w.parts[0].entry], w.offset, w.length, e)
                if not collect:
                    raise err from e
                return [err]
        hashes.submit(functools.partial(hash_window, w, data), lambda _: buffers.READS.give(buf))
        return []

    def read_inline(w: ReadWindow) -> list[CorruptCheckpoint]:
        """Read and hash on this thread (a handle that cannot read into a buffer of ours)."""
        return check_window(
            storage, path, handle, w, plain, collect=collect, sink=sink, progress=progress
        )

    def hash_direct(i: int, start: int, out: np.ndarray) -> list[CorruptCheckpoint]:
        ent = plain[i]
        bad: list[CorruptCheckpoint] = []
        for s in range(0, out.nbytes, block):
            view = out[s : s + block]
            b = (start + s) // block
            got = hashing.digest(view)
            if got != ent.blake3[b]:
                view.fill(0)  # unverified bytes never stay in the caller's memory
                err = mismatch(ent, b, start + s, view.nbytes, got)
                if not collect:
                    out[s:].fill(0)  # nor do the blocks after it, left unchecked
                    raise err
                bad.append(err)
        if progress is not None:
            progress(out.nbytes)
        return bad

    def read_direct(group: list[tuple[int, int, np.ndarray]]) -> list[CorruptCheckpoint]:
        """Pieces (entry, offset inside it, destination) lying end to end in the file (each
        at the page-aligned end of the one before): one scatter read, then hash tasks."""
        try:
            handle.read_spans([(plain[i].offset + start, out) for i, start, out in group])
        except BaseException as e:
            for _, _, out in group:
                out.fill(0)
            if not isinstance(e, StorageError):
                raise
            i, start, _ = group[0]
            n = sum(out.nbytes for _, _, out in group)
            err = failed(plain[i], plain[i].offset + start, n, e)
            if not collect:
                raise err from e
            return [err]
        # In pieces of a few blocks, so that both cores hash the last read too.
        step = max(block, _HASH_PIECE // block * block)
        for i, start, out in group:
            for s in range(0, out.nbytes, step):
                piece = out[s : s + step]

                def unhashed(f: Future[list[CorruptCheckpoint]], piece: np.ndarray = piece) -> None:
                    if f.cancelled():  # the load failed first: bytes nobody checked go
                        piece.fill(0)

                hashes.submit(functools.partial(hash_direct, i, start + s, piece), unhashed)
        return []

    problems: list[CorruptCheckpoint] = []
    try:
        direct = _straight_in(handle, entries, plain, into or ())
        rest = [i for i in range(len(entries)) if i not in direct]
        windows = plan_reads([entries[i] for i in rest], block, k.read_window)
        for w in windows:
            for p in w.parts:
                p.entry = rest[p.entry]
        pooled = bool(windows) and handle.can_read_into(buffers.READS.probe)
        one = read_window if pooled else read_inline
        tasks: list[tuple[int, Callable[[], list[CorruptCheckpoint]]]] = [
            (w.offset, functools.partial(one, w)) for w in windows
        ]
        for group in _direct_groups(plain, direct, max(block, k.read_window // block * block)):
            at = plain[group[0][0]].offset + group[0][1]
            tasks.append((at, functools.partial(read_direct, group)))
        tasks.sort(key=lambda t: t[0])  # in file order: the disk sees one stream
        pool = iopool.executor(readers)
        try:
            for found in iopool.wait_all([pool.submit(fn) for _, fn in tasks]):
                problems.extend(found)
        except BaseException:
            hashes.cancel()
            raise
        problems.extend(hashes.wait())
    finally:
        handle.close()
    return problems


def _straight_in(
    handle: ReadHandle,
    entries: Sequence[IndexEntry | EntryRead],
    plain: Sequence[IndexEntry],
    into: Sequence[np.ndarray | None],
) -> dict[int, np.ndarray]:
    """The entries read straight into their destinations (into[i]: all of entry i): each
    that holds a whole page of the file and whose memory the handle can read into, and
    each smaller one beside such an entry in the file, or beside a small one that is.

    A small entry's bytes go through scratch pages either way, so it is read with its
    neighbours: in the direct read beside it, else in a pooled window with the others.
    Read alone, each was a device request of its own: a 2 GiB model's 66 norm weights
    held a reading thread 30-80 ms each behind the large reads (bench/README.md, issue 16
    sixteenth pass)."""
    given: dict[int, np.ndarray] = {}
    for i, out in enumerate(into):
        r = entries[i]
        if out is None or not plain[i].length:
            continue
        if isinstance(r, EntryRead) and r.ranges is not None:
            continue  # part of the entry: its covering blocks go through a window
        if out.nbytes != plain[i].length:
            raise ValueError(f"key {plain[i].key!r}: a destination of the wrong size")
        given[i] = out
    large = {i for i in given if holds_page(plain[i].offset, plain[i].length)}
    direct = {i: given[i] for i in large if handle.can_read_into(given[i], plain[i].offset)}
    order = sorted(range(len(plain)), key=lambda i: plain[i].offset)
    small = [i for i in order if i in given and i not in large]
    if direct and small:
        before = {b: a for a, b in zip(order, order[1:], strict=False)}
        after = {a: b for a, b in zip(order, order[1:], strict=False)}
        for nearest, run in ((before, small), (after, small[::-1])):
            for i in run:  # in file order, then back: a run of small ones joins whole
                if i not in direct and nearest.get(i) in direct:
                    direct[i] = given[i]
    return direct


def _direct_groups(
    entries: Sequence[IndexEntry], direct: dict[int, np.ndarray], span: int
) -> list[list[tuple[int, int, np.ndarray]]]:
    """The reads straight into destinations: each entry cut in pieces of `span` bytes
    (whole blocks), and neighbouring pieces in the file (spans_join) joined into one read
    of at most `span` bytes, so that a model of many small tensors is read in few large
    reads."""
    groups: list[list[tuple[int, int, np.ndarray]]] = []
    size = 0
    end = -1
    for i in sorted(direct, key=lambda i: entries[i].offset):
        e, out = entries[i], direct[i]
        for s in range(0, e.length, span):
            piece = out[s : min(e.length, s + span)]
            at = e.offset + s
            if groups and spans_join(end, at) and size + piece.nbytes <= span:
                groups[-1].append((i, s, piece))
                size += piece.nbytes
            else:
                groups.append([(i, s, piece)])
                size = piece.nbytes
            end = at + piece.nbytes
    return groups


class _Hashes:
    """The hash tasks of one read_entries call, submitted by its read tasks as their bytes
    land. wait() once every read task has ended (so no more are submitted): the problems
    found, the first failure raised after cancelling the rest; cancel() on a failed read.
    A task's `done` callback runs however it ends, cancelled included (it frees a buffer,
    or zeroes unchecked bytes)."""

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool = pool
        self._lock = threading.Lock()
        self._futures: list[Future[list[CorruptCheckpoint]]] = []

    def submit(
        self,
        fn: Callable[[], list[CorruptCheckpoint]],
        done: Callable[[Future[list[CorruptCheckpoint]]], None],
    ) -> None:
        f = self._pool.submit(fn)
        f.add_done_callback(done)
        with self._lock:
            self._futures.append(f)

    def wait(self) -> list[CorruptCheckpoint]:
        with self._lock:
            futures = list(self._futures)
        return [p for found in iopool.wait_all(futures) for p in found]

    def cancel(self) -> None:
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            f.cancel()
        for f in futures:  # the running ones still use the caller's memory: wait for them
            if not f.cancelled():
                try:
                    f.result()
                except BaseException:  # noqa: BLE001, S110 - the read's failure is raised
                    pass


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
    try:
        data = handle.read(w.offset, w.length)
    except StorageError as e:
        err = _failed(storage, path, entries[w.parts[0].entry], w.offset, w.length, e)
        if not collect:
            raise err from e
        return [err]
    return _check_parts(storage, path, w, data, entries, collect, sink, progress)


def _read_pooled(handle: ReadHandle, w: ReadWindow, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Window `w` read into a pooled buffer (buffers.READS, waiting while `limit` are out):
    (the buffer, to give back once its bytes are consumed; the window's bytes in it). The
    bytes lie where they lie in a page of the file (a version-5 shard's entries start
    inside one), so that the read goes straight into the buffer. A failed read gives the
    buffer back and raises."""
    phase = w.offset % ALIGN
    buf = buffers.READS.take(phase + w.length, limit)
    try:
        handle.read_into(w.offset, buf[phase:])
    except BaseException:
        buffers.READS.give(buf)
        raise
    return buf, buf[phase:]


def check_window_pooled(
    storage: Storage,
    path: str,
    handle: ReadHandle,
    w: ReadWindow,
    entries: Sequence[IndexEntry],
    hash_pool: ThreadPoolExecutor,
    limit: int,
    failed: Callable[[BaseException], None],
) -> Future[list[CorruptCheckpoint]]:
    """As check_window, but the window is read into a pooled buffer (waiting while `limit`
    are out) and checked by a task on `hash_pool`, which gives the buffer back: the
    reading thread is free for the next transfer while the bytes are hashed. The check's
    failure goes to `failed` as well as to the returned future."""
    try:
        buf, data = _read_pooled(handle, w, limit)
    except StorageError as e:
        raise _failed(storage, path, entries[w.parts[0].entry], w.offset, w.length, e) from e

    def check() -> list[CorruptCheckpoint]:
        try:
            return _check_parts(storage, path, w, data, entries, False, None, None)
        except BaseException as e:
            failed(e)
            raise
        finally:
            buffers.READS.give(buf)

    return hash_pool.submit(check)


def _check_parts(
    storage: Storage,
    path: str,
    w: ReadWindow,
    data: np.ndarray,
    entries: Sequence[IndexEntry],
    collect: bool,
    sink: Sink | None,
    progress: Callable[[int], None] | None,
) -> list[CorruptCheckpoint]:
    """Check the blocks of window `w`, read into `data`; verified ones go to the sink."""
    bad: list[CorruptCheckpoint] = []
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
