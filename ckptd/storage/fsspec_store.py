"""Storage through fsspec (memory://, s3://, gs://, ...): the portable path.

Object stores have no positional writes, so a shard is assembled in host memory and
uploaded in one call at `finish()`; reads are ranged GETs (`cat_file(start, end)`).
"Atomic" replace is write-to-temporary then move; on object stores the manifest is the
only file a reader trusts, and it is written last.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Sequence

import fsspec
import numpy as np

from ckptd.errors import InvalidManifest, ShardMissing, StorageError
from ckptd.format.layout import check_relative
from ckptd.storage.base import Piece, ReadHandle, Storage, WriteHandle


class FsspecWriteHandle(WriteHandle):
    def __init__(self, storage: FsspecStorage, path: str, size: int):
        self.path = path
        self.size = size
        self._storage = storage
        self._buf = np.zeros(size, dtype=np.uint8)

    def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
        for off, arr in pieces:
            self._buf[off : off + arr.nbytes] = arr

    def finish(self) -> None:
        full = self._storage.full(self.path)
        try:
            with self._storage.fs.open(full, "wb") as f:
                f.write(memoryview(self._buf))  # type: ignore[arg-type]
        except OSError as e:
            raise StorageError(f"upload of {self._storage.url}/{self.path} failed: {e}") from e
        finally:
            self._buf = np.zeros(0, dtype=np.uint8)

    def abort(self) -> None:
        self._buf = np.zeros(0, dtype=np.uint8)


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
        if len(data) != length:
            raise StorageError(
                f"short read of {self._storage.url}/{self.path} at offset {offset}: "
                f"{len(data)} of {length} bytes"
            )
        return np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        pass


class FsspecStorage(Storage):
    def __init__(self, url: str, **storage_options: object):
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self._lock = threading.Lock()

    def full(self, path: str) -> str:
        if path == "":
            return self.root
        check_relative(path)
        return posixpath.join(self.root, path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self.full(path), exist_ok=True)

    def open_write(
        self, path: str, size: int, *, preallocate: bool = False, reuse: str | None = None
    ) -> WriteHandle:
        return FsspecWriteHandle(self, path, size)

    def open_read(self, path: str, *, cold: bool = False) -> ReadHandle:
        return FsspecReadHandle(self, path)

    def write_atomic(self, path: str, data: bytes) -> None:
        full = self.full(path)
        tmp = f"{full}.tmp"
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, full)
        except OSError as e:
            raise StorageError(f"write of {self.url}/{path} failed: {e}") from e

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        n = self.size(path)
        if n > limit:
            raise InvalidManifest(
                f"{self.url}/{path} is {n} bytes, over the {limit}-byte limit; refusing to parse it"
            )
        data: bytes = self.fs.cat_file(self.full(path))
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
            names = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(str(n).rstrip("/")) for n in names)

    def remove_tree(self, path: str) -> None:
        full = self.full(path)
        if self.fs.exists(full):
            self.fs.rm(full, recursive=True)

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(self.full(src), self.full(dst), recursive=True)
