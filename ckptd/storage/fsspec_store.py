"""Storage through fsspec (memory://, s3://, gs://, ...): the portable path.

Object stores have no positional writes, so a shard streams up while it is written
(ckptd.storage.object_writes): on S3 a multipart upload whose parts go as they fill,
completed at `finish()`; elsewhere an in-order `fs.open(..., "wb")` file. Neither holds
the whole shard. Reads are ranged GETs, a window's several in flight; every request that
moves a shard's bytes is time-bounded and retried (ckptd.storage.retry). Whole committed
steps are copied up with the bulk `put` (ckptd.format.mirror).

An object PUT (and a completed multipart upload) is atomic: readers see the whole object
or none, so `write_atomic` is one PUT there; on other fsspec filesystems it is
write-to-temporary then move. The manifest is written last with `create_only`, the store's own
conditional write (`mode="create"`): S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`,
Azure `If-None-Match: *`; memory:// does the same in-process; other stores fall back to
an exists check, then the write (racy between two writers; `atomic_create_only` says
which; see docs/tiers.md). On S3 an unfinished multipart upload is part of its tree:
listed by `listdir` and `pending_uploads`, aborted by `remove_tree`.

Object stores have no empty directories: `makedirs` creates nothing there, and a prefix
exists only while an object lies under it. Listings are not cached (another process, or
a killed one, may have changed the store since).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import fsspec
import numpy as np
from fsspec.asyn import sync

from ckptd import knobs
from ckptd.errors import CheckpointExists, InvalidManifest, ShardMissing, StorageError
from ckptd.storage import counters, retry
from ckptd.storage.base import PendingUpload, ReadHandle, Storage, WriteHandle
from ckptd.storage.object_writes import MultipartWriteHandle, SequentialWriteHandle, part_size
from ckptd.storage.paths import check_relative


class FsspecReadHandle(ReadHandle):
    """Ranged GETs. On a store with an event loop (s3fs, gcsfs, adlfs) a read is cut into
    GETs of `store_get_size`, at most `store_get_concurrency` in flight, each one
    time-bounded and retried (ckptd.storage.retry), into one buffer of the read's size:
    a rank holds (reads in flight) x the read window, whatever the shard's size."""

    def __init__(self, storage: FsspecStorage, path: str):
        self.path = path
        self._storage = storage
        self._full = storage.full(path)
        self.size = storage.size(path)

    def read(self, offset: int, length: int) -> np.ndarray:
        st = self._storage
        try:
            if st.fs.async_impl:
                data: bytes | bytearray = sync(st.fs.loop, self._read_ranges, offset, length)
            else:
                data = retry.call_blocking(
                    f"read of {st.url}/{self.path}",
                    partial(st.fs.cat_file, self._full, start=offset, end=offset + length),
                )
                counters.read(len(data))
        except (OSError, TimeoutError) as e:
            raise StorageError(
                f"read of {st.url}/{self.path} at offset {offset} failed: {type(e).__name__}: {e}"
            ) from e
        if len(data) != length:
            raise StorageError(
                f"short read of {st.url}/{self.path} at offset {offset}: "
                f"{len(data)} of {length} bytes"
            )
        return np.frombuffer(data, dtype=np.uint8)

    async def _read_ranges(self, offset: int, length: int) -> bytearray:
        k = knobs.get()
        step = max(1, k.store_get_size)
        out = bytearray(length)
        view = memoryview(out)
        gate = asyncio.Semaphore(max(1, k.store_get_concurrency))
        fs, url = self._storage.fs, self._storage.url

        async def get(lo: int) -> None:
            hi = min(offset + length, lo + step)
            async with gate:
                got = await retry.call(
                    f"GET bytes {lo}-{hi} of {url}/{self.path}",
                    partial(fs._cat_file, self._full, start=lo, end=hi),
                )
            counters.read(len(got))
            if len(got) != hi - lo:
                raise StorageError(
                    f"short read of {url}/{self.path} at offset {lo}: {len(got)} of {hi - lo} bytes"
                )
            view[lo - offset : hi - offset] = got

        tasks = [asyncio.ensure_future(get(lo)) for lo in range(offset, offset + length, step)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return out

    def close(self) -> None:
        pass


# Stores where one PUT is atomic and there are no real directories.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
# fsspec's own local filesystem: its paths are real files.
LOCAL_PROTOCOLS = frozenset({"file", "local"})
# Stores whose pipe_file(mode="create") is an atomic create-if-absent: S3 If-None-Match: *,
# GCS ifGenerationMatch=0, Azure Blob If-None-Match: * (adlfs overwrite=False), memory's
# in-process check.
NATIVE_CREATE_ONLY = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})


class FsspecStorage(Storage):
    def __init__(self, url: str, **storage_options: object):
        protocol = str(fsspec.core.split_protocol(url)[0] or "file")
        if protocol in OBJECT_STORES:
            # Another process (or a killed one) changes the store behind our back.
            storage_options.setdefault("use_listings_cache", False)
        if protocol in ("s3", "s3a"):
            # One retry policy (ckptd.storage.retry), not botocore's underneath it: its
            # backoff would outlast an attempt's time bound and hide the cause (a 503
            # would read as a timeout). s3fs's own quick loop on SlowDown stays.
            storage_options.setdefault(
                "config_kwargs", {"retries": {"mode": "standard", "total_max_attempts": 1}}
            )
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
        """One object from memory: a PUT, or a multipart upload when large (s3fs); each
        attempt time-bounded, transient failures retried (ckptd.storage.retry)."""
        full = self.full(path)
        mode = "create" if create_only else "overwrite"
        what = f"upload of {self.url}/{path}"
        opts = self._upload_options(len(data))
        try:
            if self.fs.async_impl:
                put = partial(self.fs._pipe_file, full, data, mode=mode, **opts)
                sync(self.fs.loop, retry.call, what, put)
            else:
                retry.call_blocking(what, partial(self.fs.pipe_file, full, data, mode=mode, **opts))
        except FileExistsError:
            # A create retried (here or in the client library) after its first attempt
            # landed and the answer was lost finds its own bytes: that is this write.
            if create_only and self._holds(full, data):
                return
            raise CheckpointExists(
                f"{self.url}/{path} already exists and is never replaced: another writer "
                "committed this step first; save under a new step, or remove it (ckptctl gc)"
            ) from None
        except (OSError, TimeoutError) as e:
            raise StorageError(
                f"upload of {self.url}/{path} ({len(data)} bytes) failed: "
                f"{retry.describe(e)}; the step is not committed; check the store's "
                "credentials, endpoint and free space, then retry"
            ) from e

    def _holds(self, full: str, data: bytes | bytearray) -> bool:
        try:
            return bool(self.fs.cat_file(full) == data)
        except OSError:
            return False

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
        if self.native_create_only:  # the store's own conditional write (NATIVE_CREATE_ONLY)
            if before_publish is not None:
                before_publish()  # one PUT: nothing is staged before it
            self.upload(path, data, create_only=True)
            counters.wrote_small(len(data))
            return
        # Others (file://, ...): check, then write, racy between two writers; such a store
        # says so (atomic_create_only is False) and is never called create-only.
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
            names = {
                posixpath.basename(str(n).rstrip("/"))
                for n in self.fs.ls(full, detail=False, refresh=True)
            }
        except FileNotFoundError:
            names = set()
        # An unfinished multipart upload is an entry too: a killed rank's shard is no
        # object, and its step must still be listed for retention and gc to remove it.
        base = f"{path.rstrip('/')}/" if path else ""
        for u in self.pending_uploads(path):
            if u.path.startswith(base) and len(u.path) > len(base):
                names.add(u.path[len(base) :].split("/", 1)[0])
        return sorted(names)

    def remove_tree(self, path: str) -> None:
        full = self.full(path)
        if self.fs.exists(full):
            self.fs.rm(full, recursive=True)
        # A multipart upload under the tree (a killed rank's, an abort that failed) is
        # part of it: the debris of an unfinished save, billed until aborted.
        for u in self.pending_uploads(path):
            self.abort_upload(u)

    # -- multipart uploads left behind -----------------------------------------------
    def pending_uploads(self, path: str = "") -> list[PendingUpload]:
        if self.protocol not in ("s3", "s3a"):
            return []  # see Storage.pending_uploads: no parts billed outside an object
        bucket, key, _ = self.fs.split_path(self.full(path))
        prefix = key.rstrip("/")
        out: list[PendingUpload] = []
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            try:
                page = self.fs.call_s3("list_multipart_uploads", **kw)
            except OSError as e:
                raise StorageError(
                    f"listing the unfinished multipart uploads under {self.url}/{path} failed: {e}"
                ) from e
            for u in page.get("Uploads", []):
                k = str(u["Key"])
                if prefix and k != prefix and not k.startswith(prefix + "/"):
                    continue  # rank-1.bin is not under rank-1.bin.x
                rel = k[len(self.fs.split_path(self.root)[1].rstrip("/")) :].lstrip("/")
                out.append(PendingUpload(rel, str(u["UploadId"]), str(u.get("Initiated", ""))))
            if not page.get("IsTruncated"):
                return sorted(out)
            kw["KeyMarker"] = page.get("NextKeyMarker", "")
            kw["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def abort_upload(self, upload: PendingUpload) -> None:
        bucket, key, _ = self.fs.split_path(self.full(upload.path))
        what = f"abort of the multipart upload of {self.url}/{upload.path}"
        call = partial(
            self.fs._call_s3,
            "abort_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload.upload_id,
        )
        try:
            sync(self.fs.loop, retry.call, what, call)
        except FileNotFoundError:
            pass  # aborted or completed meanwhile: nothing left to bill
        except (OSError, TimeoutError) as e:
            raise StorageError(f"{what} failed: {e}; run `ckptctl gc` again") from e

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(self.full(src), self.full(dst), recursive=True)

    # -- capabilities --------------------------------------------------------------------
    @property
    def supports_reuse(self) -> bool:
        return False  # a shard is a new upload: there are no blocks to reuse

    @property
    def atomic_create_only(self) -> bool:
        return self.native_create_only

    def local_path(self, path: str) -> str | None:
        full = self.full(path)  # confined like every other path
        return full if self.protocol in LOCAL_PROTOCOLS else None
