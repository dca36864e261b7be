"""Reading one committed step's tensors whole, verified: what every export format writes.

The formats (`ckptd.export` for safetensors and torch, `ckptd.export.zarr`) share these:
which tensors an export holds (`select`), a reader that fills a caller's buffer with one
tensor's bytes, every block checked against its blake3 (`Reader`), and the step's header
(`header_metadata`). Its own module so both format modules import it, and neither the other.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ckptd.errors import StateMismatch
from ckptd.format import dtypes
from ckptd.format.boxes import BoxRead, read_boxes, saved_entry
from ckptd.format.checkpoint import OpenCheckpoint


@dataclasses.dataclass
class Tensor:
    key: str
    dtype: str
    shape: list[int]
    nbytes: int


def select(ck: OpenCheckpoint, keys: Sequence[str] | None) -> list[Tensor]:
    """The step's tensors whose keys match any pattern ('x' also selects 'x/*'), sorted."""
    out = []
    matched: set[str] = set()
    for key in sorted(ck.chunks):
        if keys is not None:
            hits = {
                p for p in keys if fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(key, p + "/*")
            }
            if not hits:
                continue
            matched |= hits
        e = saved_entry(ck, key)
        out.append(
            Tensor(key, e.dtype, list(e.shape), math.prod(e.shape) * dtypes.itemsize(e.dtype))
        )
    unmatched = [p for p in keys or () if p not in matched]
    if unmatched:
        raise StateMismatch(
            f"{ck.storage.url} step {ck.step}: --keys {', '.join(map(repr, unmatched))} "
            "matches no tensor (see `ckptctl inspect` for the keys)"
        )
    return out


class Reader:
    """Reads whole tensors of one step into caller buffers, counting bytes for progress."""

    def __init__(
        self,
        ck: OpenCheckpoint,
        progress: Callable[[int], None] | None = None,
        threads: int | None = None,
    ):
        self.ck = ck
        self.progress = progress
        self.threads = threads
        self.bytes_read = 0

    def read(self, t: Tensor, out: np.ndarray) -> np.ndarray:
        """Fill `out` (uint8, t.nbytes) with the tensor's bytes, C order, verified."""
        self.bytes_read += read_boxes(
            self.ck,
            [BoxRead(t.key, [0] * len(t.shape), t.shape, out)],
            threads=self.threads,
            progress=self.progress,
        )
        return out


def header_metadata(ck: OpenCheckpoint) -> dict[str, Any]:
    m = ck.manifest
    return {
        "job": m.job,
        "step": m.step,
        "generation": m.generation,
        "world_size": m.world_size,
        "created_unix": m.created_unix,
        "metadata": m.metadata,
    }
