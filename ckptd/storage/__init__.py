"""Where checkpoint bytes go: a fast local path and an fsspec path, one interface."""

from __future__ import annotations

import os

from ckptd import knobs
from ckptd.storage.base import Piece, ReadHandle, Storage, WriteHandle
from ckptd.storage.local import LocalStorage
from ckptd.storage.location import JobLocation


def open_storage(path: str | os.PathLike[str] | JobLocation, *, create: bool = False) -> Storage:
    """A Storage for a job directory: a local path, file://, or any fsspec URL."""
    loc = JobLocation.of(path)
    if loc.is_url:
        # Imported here: fsspec (and its plugins) cost ~70 ms that a local job never needs.
        from ckptd.storage.fsspec_store import FsspecStorage

        return FsspecStorage(loc.path)
    k = knobs.get()
    return LocalStorage(
        loc.path, direct_io=k.direct_io, early_writeback=k.early_writeback, create=create
    )


__all__ = [
    "JobLocation",
    "LocalStorage",
    "Piece",
    "ReadHandle",
    "Storage",
    "WriteHandle",
    "open_storage",
]
