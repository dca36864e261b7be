"""Which tensors and values differ between two committed steps (`ckptctl diff`).

Cheap first: the shard indexes hold a blake3 per block of every chunk, so two tensors saved
with the same chunk layout and block size are compared from the indexes alone, without
reading a byte of tensor data. When the layouts differ (the job was resharded between the
steps, or the block size changed), the per-chunk hashes are not comparable: each side's
logical tensor is then assembled from its chunks (every block verified as it is read) and
hashed whole. That costs memory of the tensor's size, which is acceptable for a tool run by
hand. Non-tensor values are compared as the JSON the manifest stores.

Beside the hashes, each floating-point tensor in both steps gets its norm before and after
from the health stats in the indexes (ckptd.format.health, no read either): a norm that
grew or shrank by more than `factor`, or NaN/Inf values the earlier step did not have,
stand out.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, health, reader, values
from ckptd.storage import Storage

SAME, CHANGED, ADDED, REMOVED = "same", "changed", "added", "removed"


@dataclasses.dataclass
class KeyDiff:
    key: str
    kind: str  # "tensor" or "value"
    status: str  # SAME, CHANGED, ADDED or REMOVED
    by: str = (
        ""  # how it was decided: index (block hashes), read (logical hash), dtype, shape, json
    )
    detail: str = ""
    # A floating-point tensor in both steps with stats: health.NormChange.to_json() (norms
    # before and after, their ratio, non-finite counts, flags); None otherwise.
    norm: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def flags(self) -> list[str]:
        return list(self.norm["flags"]) if self.norm else []


@dataclasses.dataclass
class DiffReport:
    step_a: int
    step_b: int
    keys: list[KeyDiff]
    bytes_read: int = 0  # tensor bytes read for the fallback comparison

    def of(self, status: str) -> list[KeyDiff]:
        return [k for k in self.keys if k.status == status]

    @property
    def stand_out(self) -> list[KeyDiff]:
        """Tensors whose norm jumped or that gained NaN/Inf values (health.compare)."""
        return [k for k in self.keys if k.flags]

    @property
    def identical(self) -> bool:
        return all(k.status == SAME for k in self.keys)


def diff_checkpoints(
    storage: Storage,
    step_a: int,
    step_b: int,
    *,
    progress: Callable[[int], None] | None = None,
    factor: float = health.DEFAULT_JUMP,
) -> DiffReport:
    """Compare two committed steps of one job; raises CkptError when either cannot be opened
    or a block read for the fallback comparison fails verification. factor: a norm that
    changes by more than this (either way) stands out."""
    a, b = ckfmt.open_checkpoint(storage, step_a), ckfmt.open_checkpoint(storage, step_b)
    norms = health.compare(health.key_health(a), health.key_health(b), factor=factor)
    report = DiffReport(a.step, b.step, [])
    for key in sorted(a.chunks.keys() | b.chunks.keys()):
        if key not in b.chunks:
            report.keys.append(KeyDiff(key, "tensor", REMOVED))
        elif key not in a.chunks:
            report.keys.append(KeyDiff(key, "tensor", ADDED))
        else:
            kd = _tensor_diff(a, b, key, report, progress)
            change = norms.get(key)
            if change is not None and change.a is not None and change.b is not None:
                kd.norm = change.to_json()
            report.keys.append(kd)
    va, vb = dict(_plain_values(a.manifest.state)), dict(_plain_values(b.manifest.state))
    for key in sorted(va.keys() | vb.keys()):
        if key not in vb:
            report.keys.append(KeyDiff(key, "value", REMOVED))
        elif key not in va:
            report.keys.append(KeyDiff(key, "value", ADDED))
        else:
            same = _canon(va[key]) == _canon(vb[key])
            report.keys.append(KeyDiff(key, "value", SAME if same else CHANGED, "json"))
    return report


def _tensor_diff(
    a: ckfmt.OpenCheckpoint,
    b: ckfmt.OpenCheckpoint,
    key: str,
    report: DiffReport,
    progress: Callable[[int], None] | None,
) -> KeyDiff:
    ea, eb = a.chunks[key][0].entry, b.chunks[key][0].entry
    if ea.dtype != eb.dtype:
        return KeyDiff(key, "tensor", CHANGED, "dtype", f"{ea.dtype} -> {eb.dtype}")
    if ea.shape != eb.shape:
        return KeyDiff(key, "tensor", CHANGED, "shape", f"{ea.shape} -> {eb.shape}")
    ha, hb = _box_digests(a, key), _box_digests(b, key)
    if ha.keys() == hb.keys() and a.manifest.block_size == b.manifest.block_size:
        diff = [box for box in ha if ha[box] != hb[box]]
        detail = f"{len(diff)} of {len(ha)} chunk(s) differ" if diff else ""
        return KeyDiff(key, "tensor", CHANGED if diff else SAME, "index", detail)
    da, db = _logical_digest(a, key, report, progress), _logical_digest(b, key, report, progress)
    return KeyDiff(
        key, "tensor", SAME if da == db else CHANGED, "read", "chunk layouts differ; compared whole"
    )


def _box_digests(ck: ckfmt.OpenCheckpoint, key: str) -> dict[tuple[Any, ...], str]:
    """{(chunk offsets, chunk sizes): digest over the chunk's block hashes}, from the index."""
    return {
        (tuple(c.entry.chunk_offsets), tuple(c.entry.chunk_sizes)): hashing.chunk_digest(
            c.entry.blake3
        )
        for c in ck.chunks[key]
    }


def _logical_digest(
    ck: ckfmt.OpenCheckpoint,
    key: str,
    report: DiffReport,
    progress: Callable[[int], None] | None,
) -> str:
    """blake3 of the whole tensor's bytes in C order, assembled from its (verified) chunks."""
    first = ck.chunks[key][0].entry
    shape = list(first.shape)
    elems = math.prod(first.chunk_sizes)
    item = first.length // elems if elems else 1
    whole = np.zeros([*shape, item], dtype=np.uint8)
    for c in ck.chunks[key]:
        e = c.entry
        buf = np.empty(e.length, dtype=np.uint8)

        def sink(_: int, at: int, data: Any, buf: np.ndarray = buf) -> None:
            view = np.frombuffer(data, dtype=np.uint8)
            n = min(len(view), len(buf) - at)
            buf[at : at + n] = view[:n]

        for f, piece in ck.pieces(e):  # its own shard, a lender's, or blocks of both

            def piece_sink(
                i: int, at: int, data: Any, start: int = piece.start, sink: Any = sink
            ) -> None:
                sink(i, start + at, data)

            reader.read_entries(
                ck.storage,
                ck.files[f],
                [piece],
                ck.manifest.block_size,
                sink=piece_sink,
                cold=False,
            )
        report.bytes_read += e.length
        if progress is not None:
            progress(e.length)
        box = tuple(slice(o, o + s) for o, s in zip(e.chunk_offsets, e.chunk_sizes, strict=True))
        whole[box] = buf.reshape([*e.chunk_sizes, item])
    return hashing.digest(whole.data)


def _plain_values(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(key, JSON node) of every non-tensor leaf, keyed like the tensors (a/b/0, x/@rank1)."""
    if isinstance(node, dict) and len(node) == 1:
        ((tag, body),) = node.items()
        if tag in values.TENSOR_TAGS:
            return
        if tag in ("list", "tuple"):
            for i, child in enumerate(body):
                yield from _plain_values(child, (*path, str(i)))
            return
        if tag == "dict":
            for k, child in body:
                yield from _plain_values(
                    child, (*path, values.key_component(values.decode_scalar(k)))
                )
            return
        if tag == "stateful":
            yield from _plain_values(body, path)
            return
        if tag == "per_rank":
            for r, child in body:
                yield from _plain_values(child, (*path, f"@rank{r}"))
            return
    yield "/".join(path) or ".", node


def _canon(node: Any) -> str:
    return json.dumps(node, sort_keys=True, separators=(",", ":"))
