"""Shard writes to fsspec stores that stream: bytes leave while the shard is written.

An object store has no positional writes, and the shard writer writes a file's windows
from a thread pool, roughly in ascending order but concurrently. Holding the whole file
until `finish()` would put a second copy of the shard in RAM (the staging image is the
first), so the handles here send bytes as soon as they can and hold only what cannot go
yet:

- `MultipartWriteHandle` (s3://): a multipart upload. The file is cut into parts of
  `part_size(...)`; the windows covering a part fill its buffer and the part goes up
  (UploadPart, numbered by its position, in any order) when its last byte arrives, at most
  `upload_concurrency` at once (a writer that completes one more waits for a slot).
  `finish()` completes the upload, and only then does the object exist; `abort()` or any
  failure cancels what is in flight and aborts the upload, so neither a partial object
  nor pending parts are left. A file of one part or less is one PUT at `finish()`.
  Held: (parts in flight + parts partly filled) x the part size. Every request (create,
  each UploadPart, complete, abort) is time-bounded and retried on transient failures
  (ckptd.storage.retry); a part that still fails fails the shard, naming the part and
  the cause.
- `SequentialWriteHandle` (memory://, gs://, file://, ...): windows that arrive ahead of
  the next byte to send wait in memory; the contiguous run from there is written in order
  to `fs.open(target, "wb")`, which uploads in blocks. The target is a temporary renamed
  at `finish()`, except on an object store, where an upload becomes an object only when
  its file is closed (abort discards it). Held: the windows ahead of the frontier.

Both keep `buffered` and its high-water mark `high_water` (bytes held by the handle) for
tests and benchmarks. A range the writer never writes (a hole of a sparse layout) is
zeros: the multipart handle sends zero parts for it at finish; the sequential one holds
what follows a hole until finish. Bytes are counted (ckptd.storage.counters) per part or
block as it reaches the store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
from fsspec.asyn import sync
from fsspec.spec import AbstractBufferedFile

from ckptd import knobs
from ckptd.errors import StorageError
from ckptd.storage import counters, retry
from ckptd.storage.base import Piece, WriteHandle

MIN_PART = 5 << 20  # S3's smallest part (except the last)
MAX_PARTS = 10_000  # S3's most parts in one upload


def part_size(size: int, k: knobs.Knobs) -> int:
    """The multipart part size for a file of `size` bytes.

    `upload_part_size`, raised to S3's 5 MiB minimum and to what 10,000 parts need; when
    at least a write window, a multiple of it, so that a window never spans two parts.
    """
    part = max(k.upload_part_size, MIN_PART, -(-size // MAX_PARTS))
    if part >= k.io_window:
        part = -(-part // k.io_window) * k.io_window
    return part


def _copy_into(buf: bytearray, base: int, lo: int, hi: int, pieces: Sequence[Piece]) -> None:
    """Copy the pieces' bytes in file range [lo, hi) into `buf`, which holds the file from
    offset `base`; the rest of the range stays as it is (zeros in a fresh buffer)."""
    view = np.frombuffer(buf, dtype=np.uint8)
    for off, arr in pieces:
        a, b = max(off, lo), min(off + arr.nbytes, hi)
        if b > a:
            view[a - base : b - base] = arr[a - off : b - off]


class _Held:
    """The bytes a handle holds, and their high-water mark."""

    def __init__(self) -> None:
        self.buffered = 0
        self.high_water = 0

    def add(self, n: int) -> None:
        self.buffered += n
        self.high_water = max(self.high_water, self.buffered)


class MultipartWriteHandle(WriteHandle):
    """A shard streamed to S3 as a multipart upload (see the module docstring)."""

    def __init__(
        self,
        fs: Any,
        *,
        url: str,
        path: str,
        full: str,
        size: int,
        put: Callable[[str, bytearray], None],
    ):
        self.path, self.size = path, size
        self._fs, self._url, self._put = fs, url, put
        self._bucket, self._key, _ = fs.split_path(full)
        k = knobs.get()
        self.part_size = part_size(size, k)
        self.concurrency = max(1, k.upload_concurrency)
        self.n_parts = max(1, -(-size // self.part_size))
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an upload in flight ended
        self._slots = threading.Semaphore(self.concurrency)
        self._parts: dict[int, tuple[bytearray, list[int]]] = {}  # partly filled: buf, [filled]
        self._inflight: dict[int, concurrent.futures.Future[str]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # touched only on the fsspec loop
        self._etags: dict[int, str] = {}
        self._error: StorageError | None = None
        self._closed = False
        self._held = _Held()
        self._upload_id: str | None = None
        if self.n_parts > 1:
            try:
                mpu = self._call("create_multipart_upload", Bucket=self._bucket, Key=self._key)
            except (OSError, TimeoutError) as e:
                raise StorageError(
                    f"could not start the multipart upload of {url}/{path} ({size} bytes): "
                    f"{e}; check the store's credentials and endpoint, then retry"
                ) from e
            self._upload_id = str(mpu["UploadId"])

    # -- what tests and benchmarks read --------------------------------------------------
    @property
    def buffered(self) -> int:
        return self._held.buffered

    @property
    def high_water(self) -> int:
        return self._held.high_water

    def _range(self, p: int) -> tuple[int, int]:
        lo = p * self.part_size
        return lo, min(self.size, lo + self.part_size)

    # -- the WriteHandle -----------------------------------------------------------------
    def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        end = offset + length
        if length <= 0:
            return
        for p in range(offset // self.part_size, (end - 1) // self.part_size + 1):
            p_lo, p_hi = self._range(p)
            lo, hi = max(offset, p_lo), min(end, p_hi)
            with self._lock:
                self._check_open()
                held = self._parts.get(p)
                if held is None:
                    # Fresh memory reads as zeros: the range's bytes without a piece.
                    held = self._parts[p] = (bytearray(p_hi - p_lo), [0])
                    self._held.add(p_hi - p_lo)
            buf, filled = held
            _copy_into(buf, p_lo, lo, hi, pieces)  # disjoint ranges: no lock needed
            with self._lock:
                filled[0] += hi - lo
                if filled[0] > len(buf):
                    raise StorageError(
                        f"{self._url}/{self.path}: bytes {lo}-{hi} of part {p + 1} were "
                        "written twice; a shard's ranges are written once (a bug in the caller)"
                    )
                complete = filled[0] == len(buf) and self._upload_id is not None
                if complete:
                    del self._parts[p]
            if complete:
                self._send(p, buf)

    def finish(self) -> None:
        try:
            if self._upload_id is None:
                with self._lock:
                    self._check_open()
                    held = self._parts.pop(0, None)
                buf = held[0] if held is not None else bytearray(self.size)
                self._put(self.path, buf)  # one PUT; its errors name the object already
                counters.wrote(len(buf))
            else:
                self._send_holes()
                with self._lock:
                    # Not the futures: a future's waiters wake before its callback ran.
                    while self._inflight:
                        self._settled.wait()
                    self._check_open()
                    parts = [
                        {"PartNumber": p + 1, "ETag": e} for p, e in sorted(self._etags.items())
                    ]
                if len(parts) != self.n_parts:
                    raise self._failure(f"{len(parts)} of {self.n_parts} parts were uploaded")
                self._complete(parts)
                self._upload_id = None  # completed: nothing to abort
        except BaseException:
            self.abort()
            raise
        with self._lock:
            self._closed = True

    def abort(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for buf, _ in self._parts.values():
                self._held.buffered -= len(buf)
            self._parts.clear()
            futures = list(self._inflight.values())
        for f in futures:
            f.cancel()
        if self._upload_id is None and not futures:
            return
        try:
            sync(self._fs.loop, self._abort_async)
        except Exception:  # noqa: BLE001 - an abort runs while a failure is being raised
            # The save fails either way, and raising here would hide why; the parts are
            # never part of an object, and the next removal of the step's files (the
            # coordinator's abort, a later save of the step, `ckptctl gc`) aborts the
            # upload (FsspecStorage.remove_tree).
            pass

    # -- internals -----------------------------------------------------------------------
    def _check_open(self) -> None:
        """Raise the first part's failure, or refuse a closed handle (lock held)."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise StorageError(
                f"{self._url}/{self.path}: the upload was already finished or aborted"
            )

    def _failure(self, what: str) -> StorageError:
        return StorageError(
            f"upload of {self._url}/{self.path} ({self.size} bytes, {self.n_parts} parts of "
            f"{self.part_size}) failed: {what}; the multipart upload is aborted and the step "
            "is not committed; check the store's credentials, endpoint and quota, then retry"
        )

    def _send_holes(self) -> None:
        """Send what the writer never completed: ranges it did not write are zeros."""
        for p in range(self.n_parts):
            with self._lock:
                self._check_open()
                if p in self._etags or p in self._inflight:
                    continue
                held = self._parts.pop(p, None)
                if held is None:
                    lo, hi = self._range(p)
                    held = (bytearray(hi - lo), [hi - lo])
                    self._held.add(hi - lo)
            self._send(p, held[0])

    def _send(self, p: int, buf: bytearray) -> None:
        """Upload part p (its buffer is counted in `buffered` until the upload ends)."""
        self._slots.acquire()  # back-pressure: at most `concurrency` parts in flight
        with self._lock:
            if self._error is not None or self._closed:
                self._held.buffered -= len(buf)
                self._slots.release()
                self._check_open()
                return
            fut = asyncio.run_coroutine_threadsafe(self._upload_part(p, buf), self._fs.loop)
            self._inflight[p] = fut
        n = len(buf)
        fut.add_done_callback(lambda f: self._sent(p, n, f))

    def _call(self, method: str, **kw: Any) -> Any:
        """One multipart-upload request from this thread, under the retry policy."""
        what = f"{method} of {self._url}/{self.path}"
        call = partial(self._fs._call_s3, method, **kw)
        return sync(self._fs.loop, retry.call, what, call)

    def _complete(self, parts: list[dict[str, Any]]) -> None:
        try:
            self._call(
                "complete_multipart_upload",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        except (OSError, TimeoutError) as e:
            # A complete retried after its first attempt landed (the answer lost) finds
            # no upload: the object is there whole when it has the shard's size (S3
            # creates it atomically; the key is this save's generation's alone).
            if isinstance(e, FileNotFoundError) and self._exists_whole():
                return
            raise self._failure(f"completing the upload failed: {e}") from e

    def _exists_whole(self) -> bool:
        try:
            head = self._call("head_object", Bucket=self._bucket, Key=self._key)
        except (OSError, TimeoutError):
            return False
        return int(head.get("ContentLength", -1)) == self.size

    async def _upload_part(self, p: int, buf: bytearray) -> str:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        lo, hi = self._range(p)
        try:
            out = await retry.call(
                f"part {p + 1} of {self.n_parts} (bytes {lo}-{hi}) of {self._url}/{self.path}",
                partial(
                    self._fs._call_s3,
                    "upload_part",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    PartNumber=p + 1,
                    Body=buf,
                ),
            )
            return str(out["ETag"])
        finally:
            if task is not None:
                self._tasks.discard(task)

    def _sent(self, p: int, n: int, f: concurrent.futures.Future[str]) -> None:
        with self._lock:
            self._inflight.pop(p, None)
            self._held.buffered -= n
            if f.cancelled():
                pass
            elif (e := f.exception()) is not None:
                if self._error is None:
                    lo, hi = self._range(p)
                    err = self._failure(f"part {p + 1} (bytes {lo}-{hi}): {retry.describe(e)}")
                    err.__cause__ = e
                    self._error = err
            else:
                self._etags[p] = f.result()
                counters.wrote(n)
            self._settled.notify_all()
        self._slots.release()

    async def _abort_async(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._upload_id is not None:
            await retry.call(
                f"abort of the multipart upload of {self._url}/{self.path}",
                partial(
                    self._fs._call_s3,
                    "abort_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                ),
            )
            self._upload_id = None


class SequentialWriteHandle(WriteHandle):
    """A shard streamed in order to an fsspec file (see the module docstring)."""

    def __init__(
        self,
        fs: Any,
        *,
        url: str,
        path: str,
        full: str,
        size: int,
        object_store: bool,
    ):
        self.path, self.size = path, size
        self._fs, self._url, self._full = fs, url, full
        # An object store's upload is invisible until its file closes; elsewhere the file
        # is visible while it grows, so it grows under another name.
        self._target = full if object_store else f"{full}.tmp"
        self._lock = threading.Lock()  # the pending windows and the flags
        self._file_lock = threading.Lock()  # the file: one writer at a time, in order
        self._pending: dict[int, bytearray] = {}
        self._frontier = 0  # every byte before it has been handed to the file
        self._closed = False
        self._held = _Held()
        self._file: Any = None
        try:
            self._file = fs.open(self._target, "wb")
        except OSError as e:
            raise self._failure(f"could not create {self._target}: {e}") from e

    @property
    def buffered(self) -> int:
        return self._held.buffered

    @property
    def high_water(self) -> int:
        return self._held.high_water

    def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        if length <= 0:
            return
        buf = bytearray(length)
        _copy_into(buf, offset, offset, offset + length, pieces)
        with self._lock:
            if self._closed:
                raise self._failure("the upload was already finished or aborted")
            self._pending[offset] = buf
            self._held.add(length)
        self._drain()

    def _drain(self) -> None:
        """Hand the contiguous run at the frontier to the file, in order."""
        with self._file_lock:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    buf = self._pending.pop(self._frontier, None)
                if buf is None:
                    return
                try:
                    self._file.write(buf)
                except OSError as e:
                    raise self._failure(f"writing at offset {self._frontier}: {e}") from e
                counters.wrote(len(buf))
                with self._lock:
                    self._frontier += len(buf)
                    self._held.buffered -= len(buf)

    def finish(self) -> None:
        try:
            self._fill_holes()
            try:
                self._file.close()  # an object store's upload becomes the object here
                if self._target != self._full:
                    self._fs.mv(self._target, self._full)
            except OSError as e:
                raise self._failure(str(e)) from e
        except BaseException:
            self.abort()
            raise
        with self._lock:
            self._closed = True

    def _fill_holes(self) -> None:
        """Zeros for ranges the writer never wrote, so that what follows them can go."""
        window = knobs.get().io_window
        while True:
            with self._lock:
                if self._closed:
                    raise self._failure("the upload was already finished or aborted")
                if self._frontier >= self.size:
                    return
                later = [o for o in self._pending if o > self._frontier]
                gap_end = min([*later, self.size])
                n = min(window, gap_end - self._frontier)
                if self._frontier not in self._pending:
                    self._pending[self._frontier] = bytearray(n)
                    self._held.add(n)
            self._drain()

    def abort(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
            self._held.buffered = 0
        with self._file_lock:
            f, self._file = self._file, None
        if isinstance(f, AbstractBufferedFile):  # an object store's file (gcsfs, adlfs, ...)
            try:
                f.discard()  # cancels its pending upload
            except Exception:  # noqa: BLE001 - a client's own error (gcsfs HttpError)
                # An unfinished upload is no object either way; a store that cannot
                # cancel it (an emulator's 501) lets it expire.
                pass
            f.closed = True  # never closed: its __del__ would commit what it holds
        elif f is not None:
            f.close()
        try:
            if self._fs.exists(self._target):
                self._fs.rm(self._target)
        except OSError:
            pass  # the caller removes the file as well

    def _failure(self, what: str) -> StorageError:
        return StorageError(
            f"upload of {self._url}/{self.path} ({self.size} bytes) failed: {what}; the step "
            "is not committed; check the store's credentials, endpoint and free space, then "
            "retry"
        )
