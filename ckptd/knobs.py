"""Tunable settings, with environment overrides and a context manager for tests.

Defaults come from bench/save_restore.py on a 2-core VM with a virtual ext4 disk; every
knob can be overridden by the environment variable named beside it, or per call where
the API takes the argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a boolean (use 1 or 0)")


@dataclasses.dataclass(frozen=True)
class Knobs:
    # Hash block: the unit a partial read can verify. A rank that loads part of a saved
    # chunk at another world size reads whole blocks at the ends of its range (and all of
    # a chunk smaller than a block), so the block bounds resharding's extra reads: with
    # 16 MiB, a 2 GiB state saved at 1 and loaded at 2 read ~1.8x its size (bench/restore.py:
    # 0.56x the 2 -> 2 load); with 1 MiB, 0.95x. Cost: a 64-byte digest per MiB in the index.
    block_size: int = 1 << 20
    # Entries start at multiples of this inside a shard file (O_DIRECT, mmap); with
    # phased_layout, where their memory is in such a multiple.
    alignment: int = 4096
    # On: a save that writes tensors from their own memory under O_DIRECT lays each entry
    # out at its memory's place in a page (format version 5, manifest.PHASED_VERSION), so
    # the disk could take the bytes straight from the tensor. Off (the default): entries at
    # page-aligned offsets (version 2, readable by ckptd before version 5). Since such a
    # save copies each window into huge-page buffers as it hashes it (writer._Staged), the
    # phased places spared no copy in a write of more than one window, and they cost loads:
    # a page-aligned destination (huge pages, the bench's) had to take every byte through
    # the pooled buffers, and one in the file's phase was read into straight, in torch's
    # 4 KiB pages, which the disk fills slower than the pooled copy costs. 2.13 GB, 5
    # alternated reps: loads into a huge-page destination 0.907 s from version 2 against
    # 0.961 from version 5, into torch tensors 0.934 against 1.049; the recycled save 0.723
    # against 0.745, new-file saves within the noise (bench/README.md, eighteenth pass).
    phased_layout: bool = False
    # Largest single positional write/read; also the bounce-buffer size for O_DIRECT.
    # 32 MiB: a one-rank save(verify="full") of 2.13 GB, write and early read-back
    # overlapped, ran at 0.97 of the same disk's overlapped write + read-back in 32 MiB
    # windows, and at 0.84 in 8 MiB ones (3 interleaved reps; save(size) 1.30-1.34 s
    # against 1.56-1.84 s): fewer, larger windows keep the disk busier. (Then each window
    # was also a hash task in the writes' slots; the hashing has its own threads since.)
    io_window: int = 32 << 20
    # Largest single read. Cold O_DIRECT reads ran 1.2-1.3x faster in 32 MiB windows than
    # in 8 MiB ones here (verify and load, interleaved A/B, 3 reps).
    read_window: int = 32 << 20
    io_threads: int = 4
    # A load's or verify's reads and their hashing are apart (ckptd.format.reader): these
    # threads only read (a system call each, next to no CPU), so several reads stay in
    # flight while the hash threads hold the cores; with 4, reads waited for a core on 2
    # busy cores and the disk idled (bench/README.md, issue 16 fourth pass).
    read_threads: int = 8
    # Reads into the pooled buffers in flight at once, at most read_threads: a verify's, and
    # a load's into memory it cannot read into straight (CUDA tensors, strided boxes). On
    # the 2-core VM a verify with 4, 6 or 8 ran within the noise of each other
    # (bench/README.md, nineteenth pass); the H200 machine's cold read of the same files was
    # best at 8 x 64 MiB, so bench/gpu.py also loads into CUDA tensors with 8 (the pooled
    # buffers number this + the hash threads, read_window bytes each).
    pooled_reads: int = 4
    # Threads that hash what a load or verify reads; 0: one per CPU this process may run
    # on, at most 8 (`hashers`).
    hash_threads: int = 0
    # O_DIRECT for shard writes and cold reads; falls back to buffered where refused.
    direct_io: bool = True
    # Start write-back of each window right after writing it (Linux sync_file_range),
    # so the disk works while later windows are still being copied and hashed.
    early_writeback: bool = True
    preallocate: bool = False
    # Keep retired steps' shard files (up to this many per job) to overwrite in later saves.
    recycle_files: int = 8
    max_manifest_bytes: int = 256 << 20
    max_index_bytes: int = 256 << 20
    max_entries_per_shard: int = 1_000_000
    # Object stores (s3fs): a shard larger than twice this goes up as a multipart upload
    # in parts of this size (raised when 10,000 parts would not hold the shard), with
    # `upload_concurrency` parts in flight per shard. S3's smallest part is 5 MiB.
    upload_part_size: int = 32 << 20
    upload_concurrency: int = 8
    # Object stores: every request is cut off after this many seconds and retried on
    # throttling and transient errors, `store_attempts` tries in all, with exponential
    # backoff (full jitter) from `store_backoff_s` up to `store_backoff_max_s`
    # (ckptd.storage.retry). A part that keeps failing aborts the save.
    store_request_timeout_s: float = 120.0
    store_attempts: int = 5
    store_backoff_s: float = 0.5
    store_backoff_max_s: float = 10.0
    # Object-store reads: a read window is fetched as ranged GETs of this size, at most
    # `store_get_concurrency` in flight per window (read windows x this per rank). The
    # default is one GET per window (`io_threads` windows in flight): on moto, the only
    # store measured here, a ranged GET costs the whole object, so more, smaller GETs
    # timed out under load (bench/README.md, s3_save_rss.py).
    store_get_size: int = 32 << 20
    store_get_concurrency: int = 8
    # Loads under a process group: each stored byte is read by one rank and sent to the
    # ranks that need it (ckpt._shared_read), in windows of at most this many bytes in
    # flight per rank; the receivers re-check the blocks they get against the index.
    shared_read: bool = True
    # A load into CUDA tensors streams each verified block to the device as it is hashed
    # (ckpt._to_device) through this many bytes of pinned host memory, in slots of
    # `device_load_slot` (torch's host cache keeps them for the next load); 0: each
    # block is copied from the reader's pageable buffer, a blocking copy on a side stream.
    device_load_ring: int = 128 << 20
    device_load_slot: int = 8 << 20
    shared_window: int = 256 << 20
    verify_received: bool = True
    # Record each floating-point chunk's NaN/Inf counts, sum of squares and max |x| in the
    # shard index, computed as its blocks are hashed (ckptd.format.tensorstats). Off: no
    # stats (a load with require_finite then treats the step's health as unknown).
    health_stats: bool = True

    @property
    def hashers(self) -> int:
        """hash_threads, 0 resolved to the CPUs this process may run on (at most 8)."""
        if self.hash_threads > 0:
            return self.hash_threads
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 2
        return max(1, min(8, cpus))


def _from_env() -> Knobs:
    d = Knobs()
    return Knobs(
        block_size=_env_int("CKPT_BLOCK_SIZE", d.block_size),
        alignment=d.alignment,
        io_window=_env_int("CKPT_IO_WINDOW", d.io_window),
        read_window=_env_int("CKPT_READ_WINDOW", d.read_window),
        io_threads=_env_int("CKPT_IO_THREADS", d.io_threads),
        read_threads=_env_int("CKPT_READ_THREADS", d.read_threads),
        pooled_reads=_env_int("CKPT_POOLED_READS", d.pooled_reads),
        hash_threads=_env_int("CKPT_HASH_THREADS", d.hash_threads),
        direct_io=_env_bool("CKPT_DIRECT_IO", d.direct_io),
        phased_layout=_env_bool("CKPT_PHASED_LAYOUT", d.phased_layout),
        early_writeback=_env_bool("CKPT_EARLY_WRITEBACK", d.early_writeback),
        preallocate=_env_bool("CKPT_PREALLOCATE", d.preallocate),
        recycle_files=_env_int("CKPT_RECYCLE_FILES", d.recycle_files),
        max_manifest_bytes=_env_int("CKPT_MAX_MANIFEST_BYTES", d.max_manifest_bytes),
        max_index_bytes=_env_int("CKPT_MAX_INDEX_BYTES", d.max_index_bytes),
        max_entries_per_shard=_env_int("CKPT_MAX_ENTRIES_PER_SHARD", d.max_entries_per_shard),
        upload_part_size=_env_int("CKPT_UPLOAD_PART_SIZE", d.upload_part_size),
        upload_concurrency=_env_int("CKPT_UPLOAD_CONCURRENCY", d.upload_concurrency),
        store_request_timeout_s=_env_float(
            "CKPT_STORE_REQUEST_TIMEOUT_S", d.store_request_timeout_s
        ),
        store_attempts=_env_int("CKPT_STORE_ATTEMPTS", d.store_attempts),
        store_backoff_s=_env_float("CKPT_STORE_BACKOFF_S", d.store_backoff_s),
        store_backoff_max_s=_env_float("CKPT_STORE_BACKOFF_MAX_S", d.store_backoff_max_s),
        store_get_size=_env_int("CKPT_STORE_GET_SIZE", d.store_get_size),
        store_get_concurrency=_env_int("CKPT_STORE_GET_CONCURRENCY", d.store_get_concurrency),
        shared_read=_env_bool("CKPT_SHARED_READ", d.shared_read),
        device_load_ring=_env_int("CKPT_DEVICE_LOAD_RING", d.device_load_ring),
        device_load_slot=_env_int("CKPT_DEVICE_LOAD_SLOT", d.device_load_slot),
        shared_window=_env_int("CKPT_SHARED_WINDOW", d.shared_window),
        verify_received=_env_bool("CKPT_VERIFY_RECEIVED", d.verify_received),
        health_stats=_env_bool("CKPT_HEALTH_STATS", d.health_stats),
    )


_current: Knobs | None = None


def get() -> Knobs:
    global _current
    if _current is None:
        _current = _from_env()
    return _current


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Knobs]:
    """Temporarily change knobs (tests and benchmarks)."""
    global _current
    old = get()
    _current = dataclasses.replace(old, **changes)
    try:
        yield _current
    finally:
        _current = old
