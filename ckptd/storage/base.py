"""The storage seam: where a job's bytes go.

A `Storage` holds one job directory; every path it takes is '/'-separated and relative to
that directory, and is confined to it. The call order of a save:

    makedirs(step/shards)                       directories durable (parents fsynced)
    h = open_write(step/shards/rank-R.bin, n)   per rank
    h.write(offset, length, pieces) ...         from many threads, positional
    h.finish()                                  data and directory entry durable
    write_atomic(step/shards/rank-R.json, b)    tmp, fsync, rename, fsync dir
    create_only(step/MANIFEST.json, b)          last: the commit point (never replaces one)

Reads: `open_read(path, cold=...)` gives a handle whose `read(offset, length)` is safe to
call from many threads; with cold=True the bytes come from the device, not the page cache
(O_DIRECT, or posix_fadvise DONTNEED where O_DIRECT is refused).

Capabilities: a caller that can do better on some backends asks the storage, never tests
for a backend class (zarr-python's `Store.supports_*`). Every backend answers them, and a
wrapper (a faulty or slow storage in the tests) passes them on to what it wraps:

    supports_reuse      open_write(reuse=...) renames an existing file into place and
                        overwrites it in its allocated blocks (shard recycling); where
                        False, `reuse` is ignored
    local_path(path)    the path's absolute name on a local filesystem, for a caller that
                        hands real files to another tool (a bulk upload); None where the
                        bytes live elsewhere (an object store, memory://)
    atomic_create_only  create_only is the store's own create-if-absent (S3, GCS, Azure
                        conditional writes); where False it checks, then writes
    pending_uploads(p)  multipart uploads under p that are not objects (S3); remove_tree
                        aborts those under the tree, `ckptctl gc` lists and aborts strays

Storage knows nothing of the checkpoint format: which file is the commit point is the
caller's business (`create_only`'s `before_publish` lets it act at the moment a file is
about to become visible), and so are the limits on what it reads (`read_bytes`' limit).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ckptd.errors import CheckpointExists

# A piece of a write: (absolute file offset, 1-D contiguous uint8 array).
Piece = tuple[int, np.ndarray]

PAGE = 4096  # the unit of a cold (O_DIRECT) read: spans of one scatter read join by it


def spans_join(end: int, at: int) -> bool:
    """Whether a span starting at `at` may follow one ending at `end` in one read_spans
    call: at or after that end, inside the page that holds it or the page after. So
    neighbours share a page or lie in neighbouring pages (a packed shard, entries placed
    by their memory's page phase, a small entry between large ones), and no page between
    them is read for nothing."""
    return end <= at < -(-end // PAGE) * PAGE + PAGE


def holds_page(offset: int, length: int) -> bool:
    """Whether a whole page of the file lies inside [offset, offset + length): a cold read
    can put only such pages straight into memory, the rest go through scratch pages."""
    return -(-offset // PAGE) * PAGE + PAGE <= offset + length


@dataclasses.dataclass(frozen=True, order=True)
class PendingUpload:
    """An upload the store holds parts of, not (yet) an object: a save in flight, or the
    debris of one that was killed or whose abort failed (billed until aborted)."""

    path: str  # relative to the job directory, like every Storage path
    upload_id: str
    initiated: str = ""


class WriteHandle(abc.ABC):
    path: str
    size: int

    @abc.abstractmethod
    def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        """Write file range [offset, offset+length): pieces where given, zeros elsewhere.

        Pieces lie inside the range and do not overlap. Thread-safe for disjoint ranges.
        """

    @abc.abstractmethod
    def finish(self) -> None:
        """Make the data durable (fsync) and close. Raises StorageError on failure."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close without making anything durable; the caller removes the file."""


class ReadHandle(abc.ABC):
    path: str
    size: int

    @abc.abstractmethod
    def read(self, offset: int, length: int) -> np.ndarray:
        """Bytes [offset, offset+length) as a uint8 array.

        The array may be a per-thread buffer reused by this thread's next read: consume
        it (hash, copy) before reading again. Raises StorageError on a short read.
        """

    def can_read_into(self, out: np.ndarray, offset: int = 0) -> bool:
        """Whether read_into(offset, out) reads straight into `out` (no copy through a
        buffer of the handle's); the reader then hashes the bytes where they landed."""
        return False

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Bytes [offset, offset+out.nbytes) into `out` (uint8, C-contiguous)."""
        out[:] = self.read(offset, out.nbytes)

    def read_spans(self, spans: Sequence[tuple[int, np.ndarray]]) -> None:
        """read_into of each (offset, out), ascending, each span joining the one before
        (spans_join): a handle that can reads them all with one call (a scatter read)."""
        for offset, out in spans:
            self.read_into(offset, out)

    @abc.abstractmethod
    def close(self) -> None: ...


class Storage(abc.ABC):
    url: str
    # Where writes go to the device straight from memory that lies in its page as the
    # file offset does (O_DIRECT), other memory through a copy: the least piece that goes
    # straight. A save then lays entries of that size out where their memory is
    # (writer.memory_phases) and spares the copy. None: writes take any memory alike.
    phased_from: int | None = None

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create a directory (and parents) under the root, durably."""

    @abc.abstractmethod
    def open_write(
        self, path: str, size: int, *, preallocate: bool = False, reuse: str | None = None
    ) -> WriteHandle:
        """Create `path` of `size` bytes for positional writes.

        reuse: an existing file to rename into place and overwrite (its blocks are already
        allocated, which writes faster than a new file); ignored where unsupported or when
        another writer took it first.
        """

    @abc.abstractmethod
    def open_read(self, path: str, *, cold: bool = False) -> ReadHandle: ...

    @abc.abstractmethod
    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace `path` with `data` atomically and durably."""

    def create_only(
        self, path: str, data: bytes, *, before_publish: Callable[[], None] | None = None
    ) -> None:
        """Write `path` atomically unless it exists; raises CheckpointExists when it does.

        before_publish: called once, at the last moment before `path` becomes visible
        (after its bytes are durable in a temporary file where the backend writes one,
        else just before the write; where the store refuses atomically, also before a
        write it then refuses); the committing caller's crash point lives there.

        This default checks, then writes: two writers racing between the check and the
        write can both succeed (the later replaces the earlier). Backends whose store
        offers an atomic create-if-absent (S3 `If-None-Match: *`) override it.
        """
        if self.exists(path):
            raise CheckpointExists(f"{self.url}/{path} already exists; it is never replaced")
        if before_publish is not None:
            before_publish()
        self.write_atomic(path, data)

    @abc.abstractmethod
    def read_bytes(self, path: str, *, limit: int) -> bytes:
        """Whole small file; raises InvalidManifest when it exceeds `limit` bytes.

        The limit bounds the memory a read of an untrusted file can take; the caller
        chooses it (and says which setting raises it).
        """

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of a regular file; raises ShardMissing when absent or not a regular file."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names in a directory ('' is the root); [] when it does not exist."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove a file or directory tree; no error when absent."""

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Rename within the root, durably (both directories fsynced)."""

    def files_in(self, path: str) -> DirFiles:
        """The files of one directory, for a caller that looks at many of them (the
        coordinator checks a node's shards): close it when done. Local storage opens the
        directory once and checks each name against it; elsewhere, plain calls."""
        return DirFiles(self, path)

    # -- capabilities (see the module docstring) -----------------------------------------
    @property
    @abc.abstractmethod
    def supports_reuse(self) -> bool:
        """Whether open_write(reuse=...) overwrites an existing file in its blocks."""

    @abc.abstractmethod
    def local_path(self, path: str) -> str | None:
        """The absolute local-filesystem name of `path` (confined), or None."""

    @property
    def atomic_create_only(self) -> bool:
        """Whether `create_only` is the store's own atomic create-if-absent (True), or
        this default's check-then-write, racy between two writers (False)."""
        return False

    def pending_uploads(self, path: str = "") -> list[PendingUpload]:
        """Unfinished multipart uploads under `path` ('' is the job): a store that bills
        parts outside objects (S3) lists them; elsewhere there are none ([])."""
        return []

    def abort_upload(self, upload: PendingUpload) -> None:
        """Abort one of `pending_uploads`' uploads (its parts are deleted)."""
        raise NotImplementedError(f"{self.url} has no multipart uploads to abort")


class DirFiles:
    """size / read_bytes of files in one directory, by name (see Storage.files_in)."""

    def __init__(self, storage: Storage, path: str):
        self.storage, self.path = storage, path

    def size(self, name: str) -> int:
        return self.storage.size(f"{self.path}/{name}")

    def read_bytes(self, name: str, *, limit: int) -> bytes:
        return self.storage.read_bytes(f"{self.path}/{name}", limit=limit)

    def close(self) -> None:
        pass

    def __enter__(self) -> DirFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OpenDirs:
    """The directories a batch of lookups goes through (the coordinator's check of a
    node's reports, a commit's look at every shard), each opened once (Storage.files_in)
    and closed together; one that cannot be opened fails only the lookups in it."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, str], DirFiles] = {}

    def where(self, st: Storage, path: str) -> tuple[DirFiles, str]:
        """The open directory of `path` (relative to `st`'s root) and the file's name."""
        d, _, name = path.rpartition("/")
        key = (id(st), d)
        got = self._open.get(key)
        if got is None:
            got = self._open[key] = st.files_in(d)
        return got, name

    def size(self, st: Storage, path: str) -> int:
        d, name = self.where(st, path)
        return d.size(name)

    def __enter__(self) -> OpenDirs:
        return self

    def __exit__(self, *exc: object) -> None:
        for d in self._open.values():
            d.close()
        self._open.clear()
