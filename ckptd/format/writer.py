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
    items: Sequence[WriteItem], offsets: Sequence[int], size: int, window: int
) -> list[tuple[int, int, list[Piece]]]:
    out = []
    j = 0
    n = len(items)
    for start in range(0, size, window):
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
    """Write, fsync and verify one rank's shard and its index; return what to commit.

    On any failure the shard's files are removed and the error names job, step, rank and
    shard file; nothing is left for a commit to pick up.

    image, offsets: a staging buffer laid out as the file (page-aligned, padding zeroed)
    and each item's offset in it. Only the ranges of `items` are written, straight from
    the image with no bounce copy; ranges of the image that hold chunks this rank does
    not write (another replica does) stay holes in a sparse file.
    """
    if verify not in ("full", "size"):
        raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
    k = knobs.get()
    block, align = k.block_size, k.alignment
    sdir = layout.step_dir(step)
    shard_name = layout.shard_name(rank, generation)
    index_name = layout.index_name(rank, generation)
    shard_path = f"{sdir}/{shard_name}"
    index_path = f"{sdir}/{index_name}"
    if image is not None:
        if offsets is None or len(offsets) != len(items):
            raise ValueError("a staged image needs the offset of every item")
        size = image.nbytes
        covered = sum(_round_up(it.data.nbytes, align) for it in items)
    else:
        offsets, size = plan_offsets([it.data.nbytes for it in items], align)
        covered = size
    ctx = f"job {job!r} step {step} rank {rank} shard {storage.url}/{shard_path}"
    threads = io_threads or k.io_threads
    st = stats if stats is not None else ShardWriteStats()
    t0 = time.perf_counter()
    # Block hashes computed earlier (a multi-rank save hashes before planning) are reused.
    precomputed = digests is not None
    hashes = (
        digests
        if digests is not None
        else [[""] * hashing.n_blocks(it.data.nbytes, block) for it in items]
    )

    def hash_group(group: list[tuple[int, int]]) -> None:
        for i, b in group:
            data = items[i].data
            hashes[i][b] = hashing.digest(data[b * block : (b + 1) * block])

    storage.makedirs(f"{sdir}/{layout.SHARDS_DIR}")
    # Reuse a retired file only when every byte of it will be overwritten.
    reuse = (
        recycle.take(storage, size) if k.recycle_files > 0 and size and covered == size else None
    )
    handle = storage.open_write(
        shard_path,
        size,
        preallocate=k.preallocate if preallocate is None else preallocate,
        reuse=reuse,
    )
    try:
        if image is not None:
            windows = _image_windows(image, items, offsets, align, k.io_window)
        else:
            windows = _windows(items, offsets, size, k.io_window)
        groups = [] if precomputed else _hash_groups(items, block, k.io_window)
        pool = iopool.executor(threads)
        futures: list[Future[None]] = []
        for i in range(max(len(windows), len(groups))):
            if i < len(windows):
                w_off, w_len, pieces = windows[i]
                futures.append(pool.submit(_write_window, handle, w_off, w_len, pieces, progress))
            if i < len(groups):
                futures.append(pool.submit(hash_group, groups[i]))
        _wait_all(futures)
        handle.finish()
    except BaseException as e:
        handle.abort()
        _remove_quietly(storage, shard_path)
        _reraise(e, ctx)
    st.write_s = time.perf_counter() - t0
    st.bytes = size

    entries = [
        IndexEntry(
            key=it.key,
            dtype=it.dtype,
            shape=list(it.shape),
            chunk_offsets=list(it.chunk_offsets),
            chunk_sizes=list(it.chunk_sizes),
            offset=off,
            length=it.data.nbytes,
            blake3=hashes[i],
            file=shard_name,
        )
        for i, (it, off) in enumerate(zip(items, offsets, strict=True))
    ]
    index = ShardIndex(
        job=job,
        step=step,
        generation=generation,
        rank=rank,
        world_size=world_size,
        shard=shard_name,
        shard_size=size,
        block_size=block,
        alignment=align,
        entries=entries,
    )
    index_bytes = index.to_bytes()
    t1 = time.perf_counter()
    try:
        storage.write_atomic(index_path, index_bytes)
        _verify_written(storage, shard_path, index_path, index_bytes, index, verify, threads, ctx)
    except BaseException as e:
        _remove_quietly(storage, shard_path)
        _remove_quietly(storage, index_path)
        _reraise(e, ctx)
    st.verify_s = time.perf_counter() - t1
    return ShardInfo(
        rank=rank,
        path=shard_name,
        size=size,
        index=index_name,
        index_size=len(index_bytes),
        index_blake3=hashing.digest(index_bytes),
    )


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
    _wait_all([pool.submit(run, g) for g in groups])
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


def _wait_all(futures: Sequence[Future[None]]) -> None:
    first: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            if first is None:
                first = e
                for g in futures:
                    g.cancel()
    if first is not None:
        raise first


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
        from ckptd.format.reader import verify_entries

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
