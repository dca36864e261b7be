"""Storage through fsspec (memory://, s3://, gs://, ...): the portable path.

Object stores have no positional writes, so a shard streams up while it is written
(ckptd.storage.object_writes): on S3 a multipart upload whose parts go as they fill,
completed at `finish()`; elsewhere an in-order `fs.open(..., "wb")` file. Neither holds
the whole shard. Reads are ranged GETs (`cat_file(start, end)`); whole committed steps
are copied up with the bulk `put` (ckptd.format.mirror).

An object PUT (and a completed multipart upload) is atomic: readers see the whole object
or none, so `write_atomic` is one PUT there; on other fsspec filesystems it is
write-to-temporary then move. The manifest is written last with `create_only`: S3's
`If-None-Match: *` (s3fs `mode="create"`) refuses to replace an existing manifest
atomically; memory:// does the same in-process; other stores (gs://, ...) fall back to
an exists check, then the write (racy between two writers; see docs/tiers.md).

Object stores have no empty directories: `makedirs` creates nothing there, and a prefix
exists only while an object lies under it. Listings are not cached (another process, or
a killed one, may have changed the store since).
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Callable

import fsspec
import numpy as np

from ckptd import knobs
from ckptd.errors import CheckpointExists, InvalidManifest, ShardMissing, StorageError
from ckptd.storage import counters
from ckptd.storage.base import ReadHandle, Storage, WriteHandle
from ckptd.storage.object_writes import MultipartWriteHandle, SequentialWriteHandle, part_size
from ckptd.storage.paths import check_relative


class FsspecReadHandle(ReadHandle):
    def __init__(self, storage: FsspecStorage, path: str):
        self.path = path
        self._storage = storage
        self._full = storage.full(path)
        self.size = storage.size(path)

    def read(self, offset: int, length: int) -> np.ndarray:
        try:
            data = self._storage.fs.cat_file(self._full, start=offset, end=offset + length)
        except OSError as e:
            raise StorageError(
                f"read of {self._storage.url}/{self.path} at offset {offset} failed: {e}"
            ) from e
        counters.read(len(data))
        if len(data) != length:
            raise StorageError(
                f"short read of {self._storage.url}/{self.path} at offset {offset}: "
                f"{len(data)} of {length} bytes"
            )
        return np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        pass


# Stores where one PUT is atomic and there are no real directories.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
# fsspec's own local filesystem: its paths are real files.
LOCAL_PROTOCOLS = frozenset({"file", "local"})
# Stores whose pipe_file(mode="create") is an atomic create-if-absent.
NATIVE_CREATE_ONLY = frozenset({"s3", "s3a", "memory"})


class FsspecStorage(Storage):
    def __init__(self, url: str, **storage_options: object):
        protocol = str(fsspec.core.split_protocol(url)[0] or "file")
        if protocol in OBJECT_STORES:
            # Another process (or a killed one) changes the store behind our back.
            storage_options.setdefault("use_listings_cache", False)
        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as e:
            # Unknown scheme (a typo) or a known one whose package is not installed.
            raise StorageError(
                f"job {url}: no storage for the URL scheme {protocol!r} ({e}); fix the URL "
                "(a local path, file://, s3://, gs://, memory://, ...) or install the fsspec "
                "package for it (s3fs, gcsfs, adlfs)"
            ) from None
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.protocol = protocol
        self.object_store = protocol in OBJECT_STORES
        self.native_create_only = protocol in NATIVE_CREATE_ONLY
        self._lock = threading.Lock()

    def _upload_options(self, size: int) -> dict[str, object]:
        if self.protocol not in ("s3", "s3a"):
            return {}
        k = knobs.get()
        return {"chunksize": part_size(size, k), "max_concurrency": k.upload_concurrency}

    def upload(self, path: str, data: bytes | bytearray, *, create_only: bool = False) -> None:
        """One object from memory: a PUT, or a multipart upload when large (s3fs)."""
        full = self.full(path)
        mode = "create" if create_only else "overwrite"
        try:
            self.fs.pipe_file(full, data, mode=mode, **self._upload_options(len(data)))
        except FileExistsError:
            raise CheckpointExists(
                f"{self.url}/{path} already exists and is never replaced: another writer "
                "committed this step first; save under a new step, or remove it (ckptctl gc)"
            ) from None
        except OSError as e:
            raise StorageError(
                f"upload of {self.url}/{path} ({len(data)} bytes) failed: {e}; the step is not "
                "committed; check the store's credentials, endpoint and free space, then retry"
            ) from e

    def put_files(self, pairs: list[tuple[str, str]]) -> None:
        """Bulk upload of local files [(local path, relative path)], concurrently (fsspec `put`)."""
        if not pairs:
            return
        largest = max(os.path.getsize(lp) for lp, _ in pairs)
        try:
            self.fs.put(
                [lp for lp, _ in pairs],
                [self.full(rp) for _, rp in pairs],
                **self._upload_options(largest),
            )
            for lp, _ in pairs:
                counters.wrote(os.path.getsize(lp))
        except OSError as e:
            raise StorageError(
                f"bulk upload of {len(pairs)} files to {self.url} failed: {e}"
            ) from e

    def full(self, path: str) -> str:
        if path == "":
            return self.root
        check_relative(path)
        return posixpath.join(self.root, path)

    def makedirs(self, path: str) -> None:
        full = self.full(path)
        if not self.object_store:
            self.fs.makedirs(full, exist_ok=True)

    def open_write(
        self, path: str, size: int, *, preallocate: bool = False, reuse: str | None = None
    ) -> WriteHandle:
        full = self.full(path)
        if self.protocol in ("s3", "s3a"):
            return MultipartWriteHandle(
                self.fs, url=self.url, path=path, full=full, size=size, put=self.upload
            )
        return SequentialWriteHandle(
            self.fs, url=self.url, path=path, full=full, size=size, object_store=self.object_store
        )

    def open_read(self, path: str, *, cold: bool = False) -> ReadHandle:
        return FsspecReadHandle(self, path)

    def write_atomic(self, path: str, data: bytes) -> None:
        full = self.full(path)
        counters.wrote_small(len(data))
        if self.object_store:
            self.upload(path, data)  # one PUT: atomic on an object store
            return
        tmp = f"{full}.tmp"
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, full)
        except OSError as e:
            raise StorageError(f"write of {self.url}/{path} failed: {e}") from e

    def create_only(
        self, path: str, data: bytes, *, before_publish: Callable[[], None] | None = None
    ) -> None:
        if self.native_create_only:  # S3: If-None-Match: *; memory: open(mode="xb")
            if before_publish is not None:
                before_publish()  # one PUT: nothing is staged before it
            self.upload(path, data, create_only=True)
            counters.wrote_small(len(data))
            return
        # Others (gs://...): check, then write (racy).
        super().create_only(path, data, before_publish=before_publish)

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        n = self.size(path)
        if n > limit:
            raise InvalidManifest(
                f"{self.url}/{path} is {n} bytes, over the {limit}-byte limit of this read; "
                "refusing to read it"
            )
        data: bytes = self.fs.cat_file(self.full(path))
        counters.read_small(len(data))
        return data

    def size(self, path: str) -> int:
        full = self.full(path)
        try:
            info = self.fs.info(full)
        except FileNotFoundError:
            raise ShardMissing(f"{self.url}/{path} is missing") from None
        if info.get("type") != "file":
            raise ShardMissing(f"{self.url}/{path} is not a file")
        return int(info["size"])

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self.full(path)))

    def listdir(self, path: str) -> list[str]:
        full = self.full(path)
        try:
            names = self.fs.ls(full, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(str(n).rstrip("/")) for n in names)

    def remove_tree(self, path: str) -> None:
        full = self.full(path)
        if self.fs.exists(full):
            self.fs.rm(full, recursive=True)

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(self.full(src), self.full(dst), recursive=True)

    # -- capabilities --------------------------------------------------------------------
    @property
    def supports_reuse(self) -> bool:
        return False  # a shard is a new upload: there are no blocks to reuse

    def local_path(self, path: str) -> str | None:
        full = self.full(path)  # confined like every other path
        return full if self.protocol in LOCAL_PROTOCOLS else None
