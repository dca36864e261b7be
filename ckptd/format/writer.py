"""Shard writer: one file per rank, parallel positional writes, blake3 per block, fsync.

The file is laid out before a byte moves: every entry starts at an aligned offset and the
file is padded to the alignment, so the writer can cut it into fixed windows and write
them from a small thread pool, each window one pwrite (O_DIRECT from a bounce buffer, or
pwritev straight from the tensors' memory). Hash tasks for the same bytes are interleaved
with the writes in the same pool: blake3 and the I/O calls both release the GIL, so the
disk and the cores are busy at once. Only after the data is durable is the index written,
and only after verification does the caller get a ShardInfo it may commit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from ckptd import iopool, knobs
from ckptd.errors import CkptError, CorruptCheckpoint, ShardSizeMismatch, StorageError
from ckptd.faults import crash_point
from ckptd.format import hashing, layout, recycle
from ckptd.format.manifest import IndexEntry, ShardIndex, ShardInfo
from ckptd.format.reader import verify_entries
from ckptd.storage.base import Piece, Storage, WriteHandle


@dataclasses.dataclass
class WriteItem:
    """One tensor chunk to write: its description and its bytes (1-D uint8, contiguous)."""

    key: str
    dtype: str
    shape: list[int]
    chunk_offsets: list[int]
    chunk_sizes: list[int]
    data: np.ndarray


@dataclasses.dataclass
class ShardWriteStats:
    bytes: int = 0
    write_s: float = 0.0
    verify_s: float = 0.0


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def plan_offsets(sizes: Sequence[int], alignment: int) -> tuple[list[int], int]:
    """Aligned byte offset of each entry of the given sizes, in order, and the padded file size."""
    offsets = []
    pos = 0
    for n in sizes:
        offsets.append(pos)
        pos = _round_up(pos + n, alignment)
    return offsets, pos


def _windows(
    items: Sequence[WriteItem],
    offsets: Sequence[int],
    size: int,
    window: int,
    start_at: int = 0,
) -> list[tuple[int, int, list[Piece]]]:
    """Windows of [start_at, size) with the pieces of the (offset-sorted) items in each."""
    out = []
    j = 0
    n = len(items)
    for start in range(start_at, size, window):
        end = min(size, start + window)
        pieces: list[Piece] = []
        while j < n and offsets[j] + items[j].data.nbytes <= start:
            j += 1
        k = j
        while k < n and offsets[k] < end:
            off, arr = offsets[k], items[k].data
            lo, hi = max(start, off), min(end, off + arr.nbytes)
            if hi > lo:
                pieces.append((lo, arr[lo - off : hi - off]))
            k += 1
        out.append((start, end - start, pieces))
    return out


def _image_windows(
    image: np.ndarray, items: Sequence[WriteItem], offsets: Sequence[int], align: int, window: int
) -> list[tuple[int, int, list[Piece]]]:
    """Windows of the image covering the items' (aligned) ranges, neighbours merged."""
    ranges: list[list[int]] = []
    for off, it in sorted(zip(offsets, items, strict=True), key=lambda x: x[0]):
        end = min(image.nbytes, _round_up(off + it.data.nbytes, align))
        if end <= off:
            continue
        if ranges and ranges[-1][1] == off:
            ranges[-1][1] = end
        else:
            ranges.append([off, end])
    out = []
    for lo, hi in ranges:
        for start in range(lo, hi, window):
            end = min(hi, start + window)
            out.append((start, end - start, [(start, image[start:end])]))
    return out


def _item_windows(
    items: Sequence[WriteItem], offsets: Sequence[int], align: int, window: int
) -> list[tuple[int, int, list[Piece]]]:
    """Windows covering the items' aligned ranges (gaps between ranges are not written)."""
    order = sorted(range(len(items)), key=lambda i: offsets[i])
    ranges: list[list[int]] = []
    for i in order:
        off, end = offsets[i], _round_up(offsets[i] + items[i].data.nbytes, align)
        if end <= off:
            continue
        if ranges and ranges[-1][1] == off:
            ranges[-1][1] = end
        else:
            ranges.append([off, end])
    sorted_items = [items[i] for i in order]
    sorted_offsets = [offsets[i] for i in order]
    out: list[tuple[int, int, list[Piece]]] = []
    for lo, hi in ranges:
        for start, length, pieces in _windows(
            sorted_items, sorted_offsets, hi, window, start_at=lo
        ):
            out.append((start, length, pieces))
    return out


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
        recycle_ok: bool = True,
        preallocate: bool | None = None,
        io_threads: int | None = None,
    ):
        k = knobs.get()
        self.storage, self.job, self.step, self.rank = storage, job, step, rank
        self.world_size, self.generation, self.size = world_size, generation, size
        self.block, self.align, self.window = k.block_size, k.alignment, k.io_window
        self.threads = io_threads or k.io_threads
        sdir = layout.step_dir(step)
        self.shard_name = layout.shard_name(rank, generation)
        self.index_name = layout.index_name(rank, generation)
        self.shard_path = f"{sdir}/{self.shard_name}"
        self.index_path = f"{sdir}/{self.index_name}"
        self.ctx = f"job {job!r} step {step} rank {rank} shard {storage.url}/{self.shard_path}"
        self._open = False
        try:
            storage.makedirs(f"{sdir}/{layout.SHARDS_DIR}")
            # Reuse a retired file only when every byte of it will be overwritten.
            reuse = (
                recycle.take(storage, size) if recycle_ok and k.recycle_files > 0 and size else None
            )
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
        digests: list[list[str]] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[str]]:
        """Write items at their offsets (from `image` when given); returns block hashes."""
        block = self.block
        hashes = (
            digests
            if digests is not None
            else [[""] * hashing.n_blocks(it.data.nbytes, block) for it in items]
        )

        def hash_group(group: list[tuple[int, int]]) -> None:
            for i, b in group:
                hashes[i][b] = hashing.digest(items[i].data[b * block : (b + 1) * block])

        try:
            if image is not None:
                windows = _image_windows(image, items, offsets, self.align, self.window)
            else:
                windows = _item_windows(items, offsets, self.align, self.window)
            groups = [] if digests is not None else _hash_groups(items, block, self.window)
            pool = iopool.executor(self.threads)
            futures: list[Future[None]] = []
            for i in range(max(len(windows), len(groups))):
                if i < len(windows):
                    w_off, w_len, pieces = windows[i]
                    futures.append(
                        pool.submit(_write_window, self.handle, w_off, w_len, pieces, progress)
                    )
                if i < len(groups):
                    futures.append(pool.submit(hash_group, groups[i]))
            iopool.wait_all(futures)
        except BaseException as e:
            self.abort()
            _reraise(e, self.ctx)
        return hashes

    def finish(
        self,
        items: Sequence[WriteItem],
        offsets: Sequence[int],
        digests: list[list[str]],
        *,
        verify: str = "full",
        stats: ShardWriteStats | None = None,
    ) -> ShardInfo:
        """fsync, write the index of `items` (what this shard holds), verify; the ShardInfo."""
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
        t0 = time.perf_counter()
        try:
            self.handle.finish()
            self._open = False
        except BaseException as e:
            self.abort()
            _reraise(e, self.ctx)
        if stats is not None:
            stats.write_s += time.perf_counter() - t0  # the fsync belongs to writing
        entries = [
            IndexEntry(
                key=it.key,
                dtype=it.dtype,
                shape=list(it.shape),
                chunk_offsets=list(it.chunk_offsets),
                chunk_sizes=list(it.chunk_sizes),
                offset=off,
                length=it.data.nbytes,
                blake3=digests[i],
                file=self.shard_name,
            )
            for i, (it, off) in enumerate(zip(items, offsets, strict=True))
        ]
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
        )

    def abort(self) -> None:
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
    image: np.ndarray | None = None,
    offsets: Sequence[int] | None = None,
) -> ShardInfo:
    """Write, fsync and verify one rank's shard and its index in one go (see ShardWriter).

    Without `image` the items are laid out one after another (aligned). With `image`,
    `offsets` give each item's place in it (a staging buffer laid out as the file); only
    the items' ranges are written, so ranges holding chunks another replica writes stay
    holes of a sparse file.
    """
    if verify not in ("full", "size"):
        raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
    align = knobs.get().alignment
    if image is not None:
        if offsets is None or len(offsets) != len(items):
            raise ValueError("a staged image needs the offset of every item")
        size = image.nbytes
        covered = sum(_round_up(it.data.nbytes, align) for it in items)
    else:
        offsets, size = plan_offsets([it.data.nbytes for it in items], align)
        covered = size
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
        recycle_ok=covered == size,
        preallocate=preallocate,
        io_threads=io_threads,
    )
    hashes = w.write(items, offsets, image=image, digests=digests, progress=progress)
    st.write_s = time.perf_counter() - t0
    return w.finish(items, offsets, hashes, verify=verify, stats=st)


def hash_items(items: Sequence[WriteItem], *, threads: int | None = None) -> list[list[str]]:
    """Block hashes of every item, on a thread pool (blake3 releases the GIL)."""
    k = knobs.get()
    block = k.block_size
    hashes = [[""] * hashing.n_blocks(it.data.nbytes, block) for it in items]

    def run(group: list[tuple[int, int]]) -> None:
        for i, b in group:
            hashes[i][b] = hashing.digest(items[i].data[b * block : (b + 1) * block])

    groups = _hash_groups(items, block, k.io_window)
    if len(groups) <= 1:
        for g in groups:
            run(g)
        return hashes
    pool = iopool.executor(threads or k.io_threads)
    iopool.wait_all([pool.submit(run, g) for g in groups])
    return hashes


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
) -> None:
    size = storage.size(shard_path)
    if size != index.shard_size:
        raise ShardSizeMismatch(
            f"{shard_path} is {size} bytes after writing, expected {index.shard_size}"
        )
    reread = storage.read_bytes(index_path, limit=len(index_bytes) + 1)
    if reread != index_bytes:
        raise CorruptCheckpoint(f"{index_path} reads back different from what was written")
    if verify == "full":
        problems = verify_entries(
            storage, shard_path, index.entries, index.block_size, threads=threads
        )
        if problems:
            raise problems[0]


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
