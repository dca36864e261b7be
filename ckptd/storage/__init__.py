"""Where checkpoint bytes go: a fast local path and an fsspec path, one interface."""

from __future__ import annotations

import os

from ckptd.storage.base import Piece, ReadHandle, Storage, WriteHandle
from ckptd.storage.local import LocalStorage


def open_storage(path: str | os.PathLike[str], *, create: bool = False) -> Storage:
    """A Storage for a job directory: a local path, file://, or any fsspec URL."""
    p = os.fspath(path)
    if "://" in p and not p.startswith("file://"):
        from ckptd.storage.fsspec_store import FsspecStorage

        return FsspecStorage(p)
    if p.startswith("file://"):
        p = p[len("file://") :]
    from ckptd import knobs

    k = knobs.get()
    return LocalStorage(p, direct_io=k.direct_io, early_writeback=k.early_writeback, create=create)


__all__ = ["LocalStorage", "Piece", "ReadHandle", "Storage", "WriteHandle", "open_storage"]
