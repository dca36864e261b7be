"""Reading one committed step's tensors whole, verified: what every export format writes.

The formats (`ckptd.export` for safetensors and torch, `ckptd.export.zarr`) share these:
which tensors an export holds and under which names (`select`), a reader that fills a
caller's buffer with one tensor's bytes, every block checked against its blake3 (`Reader`),
and the step's header (`header_metadata`). Its own module so both format modules import
it, and neither the other.

Names: an export names each tensor by the user's key, not the stored entry key. The
stored key is the flatten's (clients/python/ckpt/_flatten.py): components escaped ('/' as
%2F), the root path as '.', and '#n' added where two paths would be one key, so {"": a,
".": b} is stored as '.' and '.#1'. The state tree in the manifest holds the user's own
dict keys, so `user_keys` walks it and joins each tensor's path with '/' ("" and "." stay
"" and "."). Where two tensors would get one name ({"a/b": x} beside {"a": {"b": y}}), or a
name the format reserves, the export is refused, naming both: never a silent rename.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ckptd.errors import CkptError, StateMismatch
from ckptd.format import dtypes, values
from ckptd.format.boxes import BoxRead, read_boxes, saved_entry
from ckptd.format.checkpoint import OpenCheckpoint


class KeyCollision(CkptError, ValueError):
    """Two tensors would be exported under one name (or under a name the format reserves)."""


@dataclasses.dataclass
class Tensor:
    key: str  # the name it is exported under: the user's key (module docstring)
    stored: str  # its entry key in the checkpoint: what the reader reads
    dtype: str
    shape: list[int]
    nbytes: int


def user_keys(state: object) -> dict[str, str]:
    """{stored entry key: the user's key} for every tensor the state tree refers to.

    The user's key is the tensor's path in the user's state, its dict keys as the user
    wrote them, joined by '/'. A tensor reached by two paths (tied weights) is stored once,
    under its first path in the walk (as the flatten named it): that path names it here.
    """
    out: dict[str, str] = {}
    stack: list[tuple[object, tuple[str, ...]]] = [(state, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        ((tag, body),) = node.items()
        if tag in values.TENSOR_TAGS:
            out.setdefault(body, "/".join(path))
            continue
        children: list[tuple[object, tuple[str, ...]]] = []
        if tag in ("list", "tuple"):
            children = [(c, (*path, str(i))) for i, c in enumerate(body)]
        elif tag == "dict":
            children = [(v, (*path, values.key_text(values.decode_scalar(k)))) for k, v in body]
        elif tag == "stateful":
            children = [(body, path)]
        elif tag == "per_rank":
            children = [(v, (*path, f"@rank{r}")) for r, v in body]
        stack.extend(reversed(children))  # first child first: the flatten's order
    return out


def select(
    ck: OpenCheckpoint, keys: Sequence[str] | None, *, reserved: Sequence[str] = ()
) -> list[Tensor]:
    """The step's tensors whose keys match any pattern ('x' also selects 'x/*'), sorted by
    exported name. A pattern is matched against the user's keys; one that matches none of
    them is matched against the stored keys (what `ckptctl inspect` shows: 'a%2Fb').

    Refuses, naming both, two selected tensors that one name would hold, and a tensor
    whose name the format reserves (`reserved`)."""
    names = user_keys(ck.manifest.state)
    every = [(names.get(stored, stored), stored) for stored in sorted(ck.chunks)]
    chosen: set[str] = set()
    unmatched = []
    for p in keys or ():
        hits = {s for k, s in every if _matches(k, p)} or {s for _, s in every if _matches(s, p)}
        if not hits:
            unmatched.append(p)
        chosen |= hits
    if unmatched:
        raise StateMismatch(
            f"{ck.storage.url} step {ck.step}: --keys {', '.join(map(repr, unmatched))} "
            "matches no tensor (see `ckptctl inspect` for the keys)"
        )
    out = []
    for key, stored in every:
        if keys is not None and stored not in chosen:
            continue
        e = saved_entry(ck, stored)
        out.append(
            Tensor(
                key, stored, e.dtype, list(e.shape), math.prod(e.shape) * dtypes.itemsize(e.dtype)
            )
        )
    _refuse_collisions(ck, out, reserved)
    return sorted(out, key=lambda t: t.key)


def _matches(key: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(key, pattern + "/*")


def _refuse_collisions(ck: OpenCheckpoint, tensors: list[Tensor], reserved: Sequence[str]) -> None:
    where = f"{ck.storage.url} step {ck.step}"
    first: dict[str, Tensor] = {}
    for t in tensors:
        if t.key in reserved:
            raise KeyCollision(
                f"{where}: the key {t.key!r}{_stored(t)} is a name this format reserves for "
                "itself; export it with another --format, or leave it out with --keys"
            )
        other = first.setdefault(t.key, t)
        if other is not t:
            raise KeyCollision(
                f"{where}: two tensors would both be exported as {t.key!r} (stored as "
                f"{other.stored!r} and {t.stored!r}: a dict key holding '/' names the same "
                "path as nested dicts); rename one in the state, or export them one at a time "
                f"by their stored keys (--keys {glob.escape(other.stored)!r})"
            )


def _stored(t: Tensor) -> str:
    return f" (stored as {t.stored!r})" if t.stored != t.key else ""


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
            [BoxRead(t.stored, [0] * len(t.shape), t.shape, out)],
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
