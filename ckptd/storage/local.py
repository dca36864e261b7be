"""Local (and parallel) filesystem storage: the fast path.

Writes are positional (pwrite/pwritev) from a thread pool owned by the caller, so several
windows are in flight at once. With O_DIRECT each thread copies its window into a
page-aligned bounce buffer of its own (a memcpy, ~20 GB/s, with the GIL released) and
writes that, except the whole pages of any piece whose memory is aligned like its file
offset, which go straight from that memory in the same pwritev (direct_segments); where
the filesystem refuses O_DIRECT (tmpfs, some FUSE mounts) the handle falls back to
buffered writes, and then starts write-back of every window at once (sync_file_range) so
the final fsync has little left to do.

Confinement: every path is validated as relative and safe, and must resolve (realpath)
inside the root; the final component is opened with O_NOFOLLOW and must be a regular
file, so a symlink or FIFO posing as a shard is refused instead of followed or blocked on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ckptd.errors import CheckpointExists, InvalidManifest, ShardMissing, StorageError, UnsafePath
from ckptd.storage import counters
from ckptd.storage.base import (
    PAGE,
    DirFiles,
    Piece,
    ReadHandle,
    Storage,
    WriteHandle,
    holds_page,
    spans_join,
)
from ckptd.storage.location import local_dir
from ckptd.storage.paths import check_relative

ALIGN = PAGE
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int
_SYNC_FILE_RANGE_WRITE = 2


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _in_phase(mem: np.ndarray, offset: int) -> bool:
    """Whether memory lies in its page as the file offset does in its page: O_DIRECT can
    move the whole pages between them with no copy."""
    return (_addr(mem) - offset) % ALIGN == 0


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """memcpy with the GIL released (ctypes drops it for foreign calls)."""
    n = src.nbytes
    if n:
        ctypes.memmove(_addr(dst), _addr(src), n)


_madvise = getattr(_libc, "madvise", None)
if _madvise is not None:
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_FAULT_PIECE = 64 << 20


def map_populated(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """Anonymous private memory of `size` bytes, every page faulted in writable, with the
    GIL released while the kernel does it (a background mapping does not stall the thread
    that trains or loads: CPython's mmap holds the GIL through MAP_POPULATE, about 0.7 s a
    GiB here). madvise(MADV_POPULATE_WRITE) through ctypes, which drops the GIL; where the
    kernel lacks it, a ctypes memset of each piece (the same page faults, also GIL-free).
    Returns the mapping (close it to free) and a uint8 view of it."""
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _advise_huge(mm)
    buf = np.frombuffer(mm, dtype=np.uint8)
    base = _addr(buf)
    if _madvise is None or _madvise(base, size, _MADV_POPULATE_WRITE) != 0:
        for off in range(0, size, _FAULT_PIECE):
            ctypes.memset(base + off, 0, min(_FAULT_PIECE, size - off))
    return mm, buf


def thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"); "" where
    the kernel has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def _advise_huge(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages (THP "madvise", the common default) for memory that
    O_DIRECT transfers go to or from: a request to the device carries at most
    max_segments runs of physically contiguous memory (254 on a virtio disk), so into 4 KiB
    pages scattered by earlier allocations a 32 MiB read goes as requests of about 1 MiB,
    and into 2 MiB pages as requests of max_sectors_kb (4 MiB there). On the 2-core VM a
    verify of a 2.13 GB shard read into the pooled buffers ran at 0.58-0.69 of a cold read
    of the same file beside it, and at 0.83-1.03 with this (bench/README.md, issue 16
    fifth pass)."""
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


_MIN_BOUNCE = (32 << 20) + 2 * ALIGN  # one read window plus alignment slack: rarely regrown


class _Bounce(threading.local):
    """A page-aligned buffer per thread, grown on demand, never shared.

    Pre-faulted and huge-page advised (map_populated): an O_DIRECT transfer into fresh
    pages pays for faulting and pinning each one, and huge pages mean fewer to pin.
    """

    buf: np.ndarray | None = None
    least = _MIN_BOUNCE

    def get(self, n: int) -> np.ndarray:
        if self.buf is None or self.buf.nbytes < n:
            size = -(-max(n, self.least) // ALIGN) * ALIGN
            # Advised before it is faulted in (MAP_POPULATE at mmap time faulted 4 KiB
            # pages first, left to khugepaged to merge later).
            _, self.buf = map_populated(size)
        return self.buf[:n]


_bounce = _Bounce()


class _Scratch(_Bounce):
    """The scratch pages of a scatter read (tails, padding): small, per thread, so a
    reading thread does not hold a window-sized bounce buffer for a few pages."""

    least = 64 * ALIGN


_scratch = _Scratch()


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creates, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(full: str) -> None:
    """os.makedirs, then fsync the parent of every directory it created: a new directory's
    entry survives a power cut only once its parent is fsynced (without this, a job
    directory created by the first save, and every checkpoint in it, could vanish)."""
    missing = []
    d = full
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        missing.append(d)
        d = os.path.dirname(d)
    os.makedirs(full, exist_ok=True)
    for d in reversed(missing):
        fsync_dir(os.path.dirname(d))


def write_atomic(
    full: str, data: bytes, *, before_publish: Callable[[], None] | None = None
) -> None:
    """Replace `full` with `data`: a temporary file, fsync, rename, fsync of the directory.

    before_publish runs with the bytes durable under the temporary name, before the rename
    makes them visible. The temporary is removed when anything fails.
    """
    tmp = f"{full}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_NOFOLLOW, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if before_publish is not None:
            before_publish()
        os.rename(tmp, full)
        fsync_dir(os.path.dirname(full))
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# The least of a piece worth a transfer of its own, straight from its memory: below it the
# piece is copied into the bounce buffer with its neighbours (an iovec per few KiB would
# cost the disk more, in smaller requests, than the copy costs the cores).
_STRAIGHT_MIN = 64 << 10
# The least entry a save lays out where its memory lies in its page (Storage.phased_from):
# the copy that spares is its size, the padding it may cost up to a page; and a state of
# small tensors stays format version 2.
PHASED_FROM = 1 << 20
_IOV_PER_CALL = 512  # IOV_MAX is 1024


def direct_segments(
    offset: int, n: int, pieces: Sequence[Piece], bounce: Callable[[int], np.ndarray]
) -> list[np.ndarray]:
    """The memory an O_DIRECT write of file bytes [offset, offset + n) takes, in order.

    O_DIRECT wants the memory of a transfer aligned like the file offset it goes to. Of a
    piece whose memory is (its address and its file offset agree modulo ALIGN: a page-
    aligned tensor at a page-aligned offset), the whole pages go straight from it; every
    other byte (the rest of those pieces, the other pieces, the zeros between them) is
    copied into the bounce buffer at its own place in the window, so each run of bounced
    bytes starts and ends page-aligned as well. Without such a piece this is one copy of
    the window into the bounce buffer, as it always was; with one page-aligned tensor
    covering the window, no copy at all. `offset` and `n` are page multiples.
    """
    straight: list[tuple[int, int, np.ndarray]] = []  # [a, b) of the file, from arr
    for off, arr in pieces:
        if not _in_phase(arr, off):
            continue
        a = _round_up(off)
        b = (off + arr.nbytes) // ALIGN * ALIGN
        if b - a >= _STRAIGHT_MIN:
            straight.append((a, b, arr[a - off : b - off]))
    if len(straight) == 1 and straight[0][0] == offset and straight[0][1] == offset + n:
        return [straight[0][2]]
    buf = bounce(n)
    base = _addr(buf)
    pos, s = offset, 0
    for off, arr in pieces:  # the bounced bytes, and zeros where no piece is
        if off > pos:
            ctypes.memset(base + pos - offset, 0, off - pos)
        end = off + arr.nbytes
        if s < len(straight) and off <= straight[s][0] < end:
            a, b, _ = straight[s]
            s += 1
            copy_into(buf[off - offset :], arr[: a - off])
            copy_into(buf[b - offset :], arr[b - off :])
        else:
            copy_into(buf[off - offset :], arr)
        pos = end
    if offset + n > pos:
        ctypes.memset(base + pos - offset, 0, offset + n - pos)
    out: list[np.ndarray] = []
    pos = offset
    for a, b, mem in straight:
        if a > pos:
            out.append(buf[pos - offset : a - offset])
        out.append(mem)
        pos = b
    if offset + n > pos:
        out.append(buf[pos - offset : n])
    return out


class LocalWriteHandle(WriteHandle):
    def __init__(
        self,
        storage: LocalStorage,
        path: str,
        full: str,
        size: int,
        preallocate: bool,
        *,
        recycled: bool = False,
    ):
        self.path = path
        self.size = size
        self.recycled = recycled
        self._full = full
        self._dir = os.path.dirname(full)
        self._storage = storage
        # A recycled file keeps its blocks: no O_TRUNC, and ftruncate only trims the tail.
        flags = os.O_WRONLY | os.O_CREAT | _O_NOFOLLOW | (0 if recycled else os.O_TRUNC)
        self.direct = False
        fd = -1
        if storage.direct_io and _O_DIRECT and size % ALIGN == 0:
            try:
                fd = os.open(full, flags | _O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise storage.io_error("create", path, e) from e
        if fd < 0:
            try:
                fd = os.open(full, flags, 0o644)
            except OSError as e:
                raise storage.io_error("create", path, e) from e
        self._fd = fd
        try:
            if recycled:
                os.ftruncate(fd, size)
                if preallocate and size:
                    os.posix_fallocate(fd, 0, size)
            elif preallocate and size:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            raise storage.io_error("allocate", path, e) from e
        self._writeback = (
            storage.early_writeback and not self.direct and _sync_file_range is not None
        )
        self._lock = threading.Lock()
        self._fell_back = False

    def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        try:
            if self.direct:
                self._write_direct(offset, length, pieces)
            else:
                self._write_buffered(offset, length, pieces)
        except OSError as e:
            raise self._storage.io_error("write", self.path, e, offset=offset) from e

    def _write_direct(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        n = _round_up(length)
        views: list[memoryview | bytes] = [
            s.data for s in direct_segments(offset, n, pieces, _bounce.get)
        ]
        done = 0
        while done < n:
            try:
                if len(views) == 1:
                    w = os.pwrite(self._fd, views[0], offset + done)
                else:
                    w = os.pwritev(self._fd, views[:_IOV_PER_CALL], offset + done)
                counters.wrote(max(w, 0))
            except OSError as e:
                # Some filesystems accept O_DIRECT at open and refuse it at write.
                if e.errno != errno.EINVAL or done:
                    raise
                self._reopen_buffered()
                self._write_buffered(offset, length, pieces)
                return
            # A short write (the disk filled up, a signal) goes on from where it stopped,
            # so the next call reports the real cause (ENOSPC); only a block-aligned rest
            # can go on with O_DIRECT.
            if w <= 0 or (done + w < n and (done + w) % ALIGN):
                raise OSError(errno.EIO, f"short write: {done + max(w, 0)} of {n} bytes")
            done += w
            views = _skip(views, w)

    def _reopen_buffered(self) -> None:
        with self._lock:
            if self.direct:
                fd = os.open(self._full, os.O_WRONLY | _O_NOFOLLOW)
                old, self._fd, self.direct = self._fd, fd, False
                os.close(old)

    def _write_buffered(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        views: list[memoryview | bytes] = []
        pos = offset
        for off, arr in pieces:
            if off > pos:
                views.append(bytes(off - pos))
            views.append(memoryview(arr))  # type: ignore[arg-type]
            pos = off + arr.nbytes
        if offset + length > pos:
            views.append(bytes(offset + length - pos))
        total = length
        done = 0
        while done < total:
            n = os.pwritev(self._fd, views, offset + done)
            counters.wrote(max(n, 0))
            if n <= 0:
                raise OSError(errno.EIO, f"short write: {done} of {total} bytes")
            done += n
            if done < total:  # rare: continue after a short write
                views = _skip(views, n)
        if self._writeback and _sync_file_range is not None:
            _sync_file_range(self._fd, offset, length, _SYNC_FILE_RANGE_WRITE)

    def finish(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as e:
            # Never retried: after a failed fsync the kernel may have dropped the dirty
            # pages, so a second fsync can "succeed" without the data being on disk.
            os.close(self._fd)
            raise self._storage.io_error("fsync", self.path, e) from e
        os.close(self._fd)
        try:
            fsync_dir(self._dir)
        except OSError as e:
            raise self._storage.io_error("fsync directory of", self.path, e) from e

    def abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def _skip(views: list[memoryview | bytes], n: int) -> list[memoryview | bytes]:
    """What is left of `views` after their first n bytes were written."""
    out: list[memoryview | bytes] = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(memoryview(v)[n:])
        n = 0
    return out


_SPANS_PER_CALL = 256  # a span takes at most 3 iovecs; IOV_MAX is 1024
# (start offset, the iovecs of one preadv from it, (into, from a scratch page) copies after)
_ScatterPlan = tuple[int, list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]


class LocalReadHandle(ReadHandle):
    def __init__(self, storage: LocalStorage, path: str, full: str, cold: bool):
        self.path = path
        self._storage = storage
        st = storage.lstat_regular(path, full)
        self.size = st.st_size
        flags = os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK
        self.direct = False
        fd = -1
        if cold and storage.direct_io and _O_DIRECT:
            try:
                fd = os.open(full, flags | _O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise storage.io_error("open", path, e) from e
        if fd < 0:
            try:
                fd = os.open(full, flags)
            except OSError as e:
                raise storage.io_error("open", path, e) from e
            if cold:
                # Drops clean cached pages, so what follows is read from the device.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._fd = fd

    def read(self, offset: int, length: int) -> np.ndarray:
        try:
            if self.direct:
                start = offset - offset % ALIGN
                end = min(_round_up(offset + length), _round_up(self.size))
                buf = _bounce.get(end - start)
                try:
                    got = os.preadv(self._fd, [buf], start)  # type: ignore[list-item]
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._reopen_buffered()
                    return self.read(offset, length)
                counters.read(got)
                head = offset - start
                if got < head + length:
                    raise OSError(errno.EIO, f"short read at {offset}: file ends early")
                return buf[head : head + length]
            buf = _bounce.get(length)
            got = os.preadv(self._fd, [buf], offset)  # type: ignore[list-item]
            counters.read(got)
            if got < length:
                raise OSError(errno.EIO, f"short read at {offset}: {got} of {length} bytes")
            return buf
        except OSError as e:
            raise self._storage.io_error("read", self.path, e, offset=offset) from e

    def can_read_into(self, out: np.ndarray, offset: int = 0) -> bool:
        # O_DIRECT needs the memory where it is in its page as the file offset is in its
        # (the bytes before the first whole page and after the last go through the bounce
        # buffer); a buffered read goes anywhere.
        return not self.direct or _in_phase(out, offset)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        n = out.nbytes
        if self.direct and offset % ALIGN and _in_phase(out, offset):
            if not self._scatter([(offset, out)]):
                # Short (the file ends early: the error comes from the aligned read), or
                # refused: the bytes up to the file's next page, then an aligned read.
                head = min(n, -offset % ALIGN)
                copy_into(out[:head], self.read(offset, head))
                if n > head:
                    self.read_into(offset + head, out[head:])
            return
        body = n - n % ALIGN if self.direct else n
        if self.direct and (offset % ALIGN or _addr(out) % ALIGN):
            body = 0  # not aligned: all of it through the bounce buffer
        done = 0
        try:
            while done < body:
                got = os.preadv(self._fd, [out[done:body]], offset + done)  # type: ignore[list-item]
                counters.read(max(got, 0))
                if got <= 0 or (self.direct and got % ALIGN and done + got < body):
                    raise OSError(
                        errno.EIO, f"short read at {offset + done}: {got} of {body - done} bytes"
                    )
                done += got
        except OSError as e:
            if self.direct and e.errno == errno.EINVAL and not done:
                self._reopen_buffered()
                self.read_into(offset, out)
                return
            raise self._storage.io_error("read", self.path, e, offset=offset + done) from e
        if n > body:
            copy_into(out[body:], self.read(offset + body, n - body))

    def read_spans(self, spans: Sequence[tuple[int, np.ndarray]]) -> None:
        # One preadv per _SPANS_PER_CALL spans: each span's whole pages straight into its
        # memory, the partial pages (a span's first and last, shared by neighbours that
        # meet inside a page, or all of a small span) into scratch pages of this thread,
        # copied in after.
        for at in range(0, len(spans), _SPANS_PER_CALL):
            part = spans[at : at + _SPANS_PER_CALL]
            if not self._scatter(part):
                for offset, out in part:
                    self.read_into(offset, out)

    def _scatter(self, spans: Sequence[tuple[int, np.ndarray]]) -> bool:
        """One scatter read of joined spans (spans_join); False (nothing read) where it
        cannot be one. Under O_DIRECT a span that holds a whole page of the file must lie
        in its page of memory as its file offset does (can_read_into)."""
        for (off, out), (nxt, _) in zip(spans, spans[1:], strict=False):
            if not spans_join(off + out.nbytes, nxt):
                return False
        planned = self._direct_iov(spans) if self.direct else self._buffered_iov(spans)
        if planned is None:
            return False
        start, iov, copies = planned
        need = spans[-1][0] + spans[-1][1].nbytes - start
        try:
            got = os.preadv(self._fd, iov, start)  # type: ignore[arg-type]
        except OSError as e:
            if self.direct and e.errno == errno.EINVAL:
                self._reopen_buffered()
                return False
            raise self._storage.io_error("read", self.path, e, offset=start) from e
        counters.read(max(got, 0))
        if got < need:  # a short read (rare on a regular file): span by span instead
            return False
        for into, page in copies:
            copy_into(into, page)
        return True

    @staticmethod
    def _direct_iov(spans: Sequence[tuple[int, np.ndarray]]) -> _ScatterPlan | None:
        """The file's pages from the first span's to the last's, in order: each whole page
        of a span straight into its memory, every other page (partial, or shared by two
        spans) a scratch page with a copy into each span's part of it. Joined spans leave
        no page between them, so a span takes at most two scratch pages."""
        scratch = _scratch.get(2 * len(spans) * ALIGN)
        iov: list[np.ndarray] = []
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        k = 0
        start = spans[0][0] - spans[0][0] % ALIGN
        next_page = start  # the file offset the next iovec reads at
        for off, out in spans:
            end = off + out.nbytes
            body = body_end = -1  # no whole page: all of it through scratch
            if holds_page(off, out.nbytes):
                if not _in_phase(out, off):
                    return None
                body, body_end = _round_up(off), end - end % ALIGN
            pos = off
            while pos < end:
                if pos == body:
                    iov.append(out[body - off : body_end - off])
                    pos = next_page = body_end
                    continue
                page = pos - pos % ALIGN
                if page == next_page:  # a new page; else the last scratch page, shared
                    iov.append(scratch[k * ALIGN : (k + 1) * ALIGN])
                    k += 1
                    next_page += ALIGN
                n = min(end, page + ALIGN) - pos
                copies.append(
                    (out[pos - off : pos - off + n], iov[-1][pos - page : pos - page + n])
                )
                pos += n
        return start, iov, copies

    @staticmethod
    def _buffered_iov(spans: Sequence[tuple[int, np.ndarray]]) -> _ScatterPlan:
        """Each span's memory, and scratch for the bytes between it and the next."""
        ends = [off + out.nbytes for off, out in spans]
        gaps = [nxt - end for end, (nxt, _) in zip(ends, spans[1:], strict=False)]
        scratch = _scratch.get(sum(gaps))
        iov: list[np.ndarray] = []
        used = 0
        for (_, out), gap in zip(spans, [*gaps, 0], strict=True):
            iov.append(out)
            if gap:
                iov.append(scratch[used : used + gap])
                used += gap
        return spans[0][0], iov, []

    def _reopen_buffered(self) -> None:
        # Accepted at open, refused at read (some FUSE mounts): read through the cache,
        # after dropping it.
        fd = os.open(self._storage.full(self.path), os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        old, self._fd, self.direct = self._fd, fd, False
        os.close(old)

    def close(self) -> None:
        os.close(self._fd)


class LocalStorage(Storage):
    def __init__(
        self,
        root: str,
        *,
        direct_io: bool = True,
        early_writeback: bool = True,
        create: bool = False,
    ):
        self.root = local_dir(root)
        self.url = self.root
        self.direct_io = direct_io
        self.phased_from = PHASED_FROM if direct_io and _O_DIRECT else None
        self.early_writeback = early_writeback
        if create:
            if os.path.lexists(self.root) and not os.path.isdir(self.root):
                raise StorageError(
                    errno.ENOTDIR,
                    f"job {self.root} is a file, not a directory: a job is a directory of "
                    "checkpoints; save to another path, or move the file away",
                )
            try:
                makedirs_durable(self.root)
            except OSError as e:
                raise self.io_error("creating the job directory", "", e) from e

    # -- paths -------------------------------------------------------------------------
    def full(self, path: str) -> str:
        """Absolute path for a confined relative path; refuses symlinked directories."""
        if path == "":
            return self.root
        check_relative(path)
        # The root was resolved once (local_dir); only it and the directories below it can
        # be symlinks now: one lstat each, not realpath's walk of every component from "/"
        # (a coordinator checks thousands of shards a save, each through here).
        d = self.root
        for part in ("", *path.split("/")[:-1]):
            d = os.path.join(d, part) if part else d
            try:
                st = os.lstat(d)
            except OSError:
                break  # missing (or not a directory): the operation itself fails with that
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePath(
                    f"{path!r} under {self.root} passes through a symlink ({d} -> "
                    f"{os.path.realpath(d)}); ckptd does not follow symlinks out of the "
                    "checkpoint directory"
                )
        return os.path.join(self.root, path)

    def lstat_regular(self, path: str, full: str) -> os.stat_result:
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            raise ShardMissing(f"{full} is missing") from None
        except OSError as e:
            raise self.io_error("stat", path, e) from e
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePath(f"{full} is a symlink; ckptd refuses to follow it")
        if not stat.S_ISREG(st.st_mode):
            raise ShardMissing(f"{full} is not a regular file (a FIFO, device or directory)")
        return st

    def io_error(
        self, op: str, path: str, e: OSError, *, offset: int | None = None
    ) -> StorageError:
        where = f" at offset {offset}" if offset is not None else ""
        hint = ""
        if e.errno == errno.ENOSPC:
            hint = "; the filesystem is full: free space or retire old checkpoints (ckptctl gc)"
        elif e.errno == errno.EIO:
            hint = "; the device reported an I/O error: check the disk, nothing was committed"
        elif e.errno == errno.EROFS:
            hint = (
                "; the filesystem is mounted read-only: load and resume from it work, save "
                "to a writable path"
            )
        elif e.errno == errno.ENOTDIR:
            hint = "; a component of the path is a file, not a directory: pick another path"
        err = StorageError(
            e.errno or errno.EIO,
            f"{op} {os.path.join(self.root, path)}{where} failed: {e.strerror or e}{hint}",
        )
        return err

    # -- Storage -----------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        full = self.full(path)
        try:
            makedirs_durable(full)
        except OSError as e:
            raise self.io_error("mkdir", path, e) from e

    def open_write(
        self, path: str, size: int, *, preallocate: bool = False, reuse: str | None = None
    ) -> WriteHandle:
        full = self.full(path)
        recycled = False
        if reuse is not None:
            try:
                self.lstat_regular(reuse, self.full(reuse))
                os.rename(self.full(reuse), full)  # atomic: two writers never get one file
                recycled = True
            except (OSError, ShardMissing, UnsafePath):
                recycled = False
        return LocalWriteHandle(self, path, full, size, preallocate, recycled=recycled)

    def open_read(self, path: str, *, cold: bool = False) -> ReadHandle:
        return LocalReadHandle(self, path, self.full(path), cold)

    def write_atomic(self, path: str, data: bytes) -> None:
        full = self.full(path)
        try:
            write_atomic(full, data)
            counters.wrote_small(len(data))
        except OSError as e:
            raise self.io_error("write", path, e) from e

    def create_only(
        self, path: str, data: bytes, *, before_publish: Callable[[], None] | None = None
    ) -> None:
        # Check, then write (as the default): racy between two writers, see Storage.
        if self.exists(path):
            raise CheckpointExists(f"{self.url}/{path} already exists; it is never replaced")
        full = self.full(path)
        try:
            write_atomic(full, data, before_publish=before_publish)
            counters.wrote_small(len(data))
        except OSError as e:
            raise self.io_error("write", path, e) from e

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        full = self.full(path)
        st = self.lstat_regular(path, full)
        _check_limit(full, st.st_size, limit)  # refused before a byte is read
        try:
            fd = os.open(full, os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK)
            try:
                data = os.read(fd, limit + 1)
            finally:
                os.close(fd)
        except OSError as e:
            raise self.io_error("read", path, e) from e
        return _counted_small_read(full, data, limit)

    def size(self, path: str) -> int:
        full = self.full(path)
        return self.lstat_regular(path, full).st_size

    def files_in(self, path: str) -> DirFiles:
        return LocalDirFiles(self, path)

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.full(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.full(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_tree(self, path: str) -> None:
        full = self.full(path)
        if os.path.islink(full) or os.path.isfile(full):
            os.unlink(full)
        elif os.path.isdir(full):
            shutil.rmtree(full)
        else:
            return
        try:
            fsync_dir(os.path.dirname(full))
        except OSError:
            pass

    def rename(self, src: str, dst: str) -> None:
        s, d = self.full(src), self.full(dst)
        try:
            os.rename(s, d)
            fsync_dir(os.path.dirname(d))
            if os.path.dirname(s) != os.path.dirname(d):
                fsync_dir(os.path.dirname(s))
        except OSError as e:
            raise self.io_error("rename", f"{src} -> {dst}", e) from e

    # -- capabilities --------------------------------------------------------------------
    @property
    def supports_reuse(self) -> bool:
        return True

    def local_path(self, path: str) -> str | None:
        return self.full(path)


def _check_limit(where: str, size: int, limit: int) -> None:
    """A small read (a manifest, an index) refuses a file larger than its caller allows."""
    if size > limit:
        raise InvalidManifest(
            f"{where} is {size} bytes, over the {limit}-byte limit of this read; refusing to "
            "read it"
        )


def _counted_small_read(where: str, data: bytes, limit: int) -> bytes:
    """A small read's bytes (read with one byte to spare), counted, refused if the file
    grew past the limit between its stat and its read."""
    counters.read_small(len(data))
    if len(data) > limit:
        raise InvalidManifest(f"{where} grew over the {limit}-byte limit while being read")
    return data


class LocalDirFiles(DirFiles):
    """A directory's files through its descriptor: the directory is checked once (no
    symlink from the root down: `full`, then O_NOFOLLOW on the directory itself), each file
    by name relative to it (fstatat / openat, never following a link). A coordinator
    checking a node's shards makes two system calls a file instead of a dozen."""

    def __init__(self, storage: LocalStorage, path: str):
        super().__init__(storage, path)
        self.local = storage
        self.dir = os.path.join(storage.root, path)  # for messages; checked at first use
        self.fd: int | None = None

    def _dir_fd(self, name: str) -> int:
        """The directory, opened at the first file; an error names that file (and is
        raised again for the next one: nothing is kept of a directory that failed)."""
        if self.fd is None:
            full = self.local.full(f"{self.path}/{name}")  # the directories above it
            try:
                self.fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW)
            except FileNotFoundError:
                raise ShardMissing(f"{full} is missing") from None
            except OSError as e:
                if os.path.islink(self.dir):
                    raise UnsafePath(
                        f"{full}: its directory {self.dir} is a symlink; ckptd does not "
                        "follow symlinks out of the checkpoint directory"
                    ) from None
                raise self.local.io_error("open", f"{self.path}/{name}", e) from e
        return self.fd

    def _name(self, name: str) -> str:
        check_relative(name)
        if "/" in name:
            raise UnsafePath(f"{name!r} is not one name in {self.path}")
        return name

    def _regular(self, name: str, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePath(f"{self.dir}/{name} is a symlink; ckptd refuses to follow it")
        if not stat.S_ISREG(st.st_mode):
            raise ShardMissing(
                f"{self.dir}/{name} is not a regular file (a FIFO, device or directory)"
            )

    def size(self, name: str) -> int:
        try:
            st = os.stat(self._name(name), dir_fd=self._dir_fd(name), follow_symlinks=False)
        except FileNotFoundError:
            raise ShardMissing(f"{self.dir}/{name} is missing") from None
        except OSError as e:
            raise self.local.io_error("stat", f"{self.path}/{name}", e) from e
        self._regular(name, st)
        return st.st_size

    def read_bytes(self, name: str, *, limit: int) -> bytes:
        try:
            fd = os.open(
                self._name(name),
                os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK,
                dir_fd=self._dir_fd(name),
            )
        except FileNotFoundError:
            raise ShardMissing(f"{self.dir}/{name} is missing") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(
                    f"{self.dir}/{name} is a symlink; ckptd refuses to follow it"
                ) from None
            raise self.local.io_error("read", f"{self.path}/{name}", e) from e
        try:
            st = os.fstat(fd)
            self._regular(name, st)
            _check_limit(f"{self.dir}/{name}", st.st_size, limit)
            data = os.read(fd, limit + 1)
        except OSError as e:
            raise self.local.io_error("read", f"{self.path}/{name}", e) from e
        finally:
            os.close(fd)
        return _counted_small_read(f"{self.dir}/{name}", data, limit)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
