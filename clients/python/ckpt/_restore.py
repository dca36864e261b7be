"""Restore a checkpoint's node tree into a user's state, in place.

Planning comes first and touches nothing: the saved tree is walked beside the target,
every mismatch (missing key, dtype, shape) is collected, and every tensor gets a
destination (the target tensor itself when it is a contiguous CPU tensor of the right
dtype and shape, else a new buffer copied in afterwards). Only when the plan is whole are
bytes read, straight into those destinations, block by verified block. Objects with
load_state_dict() get their state after all reads, children before parents.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, MutableMapping, MutableSequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ckpt._flatten import PerRank, is_stateful, tensor_bytes
from ckptd.errors import InvalidManifest, StateMismatch
from ckptd.format import dtypes, values
from ckptd.format.checkpoint import Chunk, OpenCheckpoint
from ckptd.format.manifest import IndexEntry
from ckptd.format.reader import read_entries
from ckptd.storage.local import copy_into


@dataclasses.dataclass
class _Dest:
    """Where one saved key's bytes go: the box [offsets, offsets+sizes) of the tensor."""

    key: str
    buffer: torch.Tensor | np.ndarray  # contiguous, CPU, of the saved dtype, shaped like the box
    bytes: np.ndarray  # uint8 view of buffer
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.detach().copy_(src)


class Planner:
    def __init__(self, ckpt: OpenCheckpoint, *, strict: bool = True, rank: int = 0):
        self.ckpt = ckpt
        self.rank = rank
        self.strict = strict
        self.dests: dict[str, _Dest] = {}
        self.after_read: list[Callable[[], None]] = []
        # Assignments into the caller's dicts and lists, applied after every read succeeded,
        # so a load that fails (mismatch, corruption) leaves the containers untouched.
        self.mutations: list[Callable[[], Any]] = []
        self.problems: list[str] = []
        self.missing: list[str] = []

    # -- walking ---------------------------------------------------------------------
    def restore(self, node: Any, target: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node
        ((tag, body),) = node.items()
        if tag in ("float", "bytes"):
            return values.decode_scalar(node)
        if tag == "tensor":
            return self._tensor(body, target, path)
        if tag == "ndarray":
            return self._ndarray(body, target, path)
        if tag == "npscalar":
            # A numpy scalar is an immutable value, not a buffer to fill later: read its
            # few bytes (verified) now, while planning.
            arr = self._ndarray(body, None, path)
            dest = self.dests.pop(body)
            self._read_now(body, dest)
            return arr[()]
        if tag == "stateful":
            if target is not None and is_stateful(target):
                sub = self.restore(body, target.state_dict(), path)
                self.after_read.append(lambda: target.load_state_dict(sub))
                return target
            return self.restore(body, None, path)
        if tag == "dict":
            return self._dict(body, target, path)
        if tag == "list":
            return self._list(body, target, path)
        if tag == "tuple":
            t = target if isinstance(target, tuple) and len(target) == len(body) else None
            return tuple(
                self.restore(c, t[i] if t else None, f"{path}/{i}") for i, c in enumerate(body)
            )
        if tag == "per_rank":
            mine = [n for r, n in body if r == self.rank]
            inner = target.value if isinstance(target, PerRank) else target
            if not mine:
                self.problems.append(
                    f"{path}: the checkpoint holds per-rank values for ranks "
                    f"{sorted(r for r, _ in body)[:8]}, none for rank {self.rank}"
                )
                return target
            value = self.restore(mine[0], inner, path)
            if isinstance(target, PerRank):
                target.value = value
                return target
            return value
        raise StateMismatch(f"{path}: unknown node tag {tag!r}")

    def _dict(self, body: list[Any], target: Any, path: str) -> Any:
        saved = {values.decode_scalar(k): v for k, v in body}
        if isinstance(target, MutableMapping):
            extra = [k for k in target if k not in saved]
            if extra and self.strict:
                self.missing.extend(f"{path}/{k}" for k in extra)
            for k, v in saved.items():
                value = self.restore(v, target.get(k), f"{path}/{k}")
                # Containers change only once the load succeeded (see read()).
                self.mutations.append(functools.partial(target.__setitem__, k, value))
            return target
        return {k: self.restore(v, None, f"{path}/{k}") for k, v in saved.items()}

    def _list(self, body: list[Any], target: Any, path: str) -> Any:
        if isinstance(target, MutableSequence) and not isinstance(target, (str, bytes)):
            new = [
                self.restore(c, target[i] if i < len(target) else None, f"{path}/{i}")
                for i, c in enumerate(body)
            ]
            self.mutations.append(functools.partial(target.__setitem__, slice(None), new))
            return target
        return [self.restore(c, None, f"{path}/{i}") for i, c in enumerate(body)]

    # -- leaves ----------------------------------------------------------------------
    def _saved(self, key: str, path: str) -> tuple[IndexEntry, list[Chunk]]:
        chunks = self.ckpt.chunks[key]
        return chunks[0].entry, chunks

    def _tensor(self, key: str, target: Any, path: str) -> Any:
        entry, _ = self._saved(key, path)
        dtype = dtypes.from_name(entry.dtype)
        shape = tuple(entry.shape)
        if type(target).__name__ == "DTensor":
            return self._dtensor(key, target, dtype, shape, path)
        if key in self.dests:
            buf = self.dests[key].buffer
            if not isinstance(buf, torch.Tensor):
                raise InvalidManifest(
                    f"{self.ckpt.storage.url} step {self.ckpt.step}: key {key!r} is referenced "
                    "both as a tensor and as a numpy value; the manifest was edited"
                )
            if isinstance(target, torch.Tensor) and target is not buf:
                if self._check(target, dtype, shape, path):
                    self.after_read.insert(0, functools.partial(_copy, target, buf))
                return target
            return buf
        if isinstance(target, torch.Tensor):
            if not self._check(target, dtype, shape, path):
                return target
            if (
                target.device.type == "cpu"
                and target.is_contiguous()
                and not target.is_conj()
                and not target.is_neg()
            ):
                t = target.detach()
                self.dests[key] = _Dest(key, t, tensor_bytes(t))
                return target
            buf = torch.empty(shape, dtype=dtype)
            self.dests[key] = _Dest(key, buf, tensor_bytes(buf))
            # Runs before load_state_dict callbacks (they were appended later).
            self.after_read.insert(0, functools.partial(_copy, target, buf))
            return target
        buf = torch.empty(shape, dtype=dtype)
        self.dests[key] = _Dest(key, buf, tensor_bytes(buf))
        return buf

    def _dtensor(
        self, key: str, target: Any, dtype: torch.dtype, shape: tuple[int, ...], path: str
    ) -> Any:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if target.dtype != dtype or tuple(target.shape) != shape:
            self._check(target, dtype, shape, path)
            return target
        local = target.to_local()
        sizes, offsets = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        if local.device.type == "cpu" and local.is_contiguous():
            t = local.detach()
        else:
            t = torch.empty(tuple(sizes), dtype=dtype)
            self.after_read.insert(0, functools.partial(_copy, local, t))
        self.dests[key] = _Dest(key, t, tensor_bytes(t), tuple(offsets), tuple(sizes))
        return target

    def _ndarray(self, key: str, target: Any, path: str) -> np.ndarray:
        entry, _ = self._saved(key, path)
        shape = tuple(entry.shape)
        try:
            np_dtype = np.dtype(entry.dtype)
        except TypeError:
            raise InvalidManifest(
                f"{self.ckpt.storage.url} step {self.ckpt.step}: key {key!r} is tagged as a numpy "
                f"value but its dtype {entry.dtype} has no numpy equivalent; the manifest was edited"
            ) from None
        if key in self.dests:
            known = self.dests[key].buffer
            if isinstance(known, np.ndarray):
                return known
            raise InvalidManifest(
                f"{self.ckpt.storage.url} step {self.ckpt.step}: key {key!r} is referenced both "
                "as a tensor and as a numpy value; the manifest was edited"
            )
        if (
            isinstance(target, np.ndarray)
            and target.dtype == np_dtype
            and target.shape == shape
            and target.flags.c_contiguous
            and target.flags.writeable
        ):
            arr = target
        else:
            arr = np.empty(shape, dtype=np_dtype)
        raw = arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, dtype=np.uint8)
        self.dests[key] = _Dest(key, arr, raw)
        return arr

    def _check(
        self, target: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], path: str
    ) -> bool:
        if target.dtype != dtype or tuple(target.shape) != shape:
            self.problems.append(
                f"{path}: the checkpoint holds {dtypes.name_of(dtype)}{list(shape)}, "
                f"the state has {target.dtype}{list(target.shape)}"
            )
            return False
        return True

    # -- reading ---------------------------------------------------------------------
    def check(self) -> None:
        if self.problems or self.missing:
            lines = list(self.problems)
            if self.missing:
                lines.append(
                    "keys in the state but not in the checkpoint: "
                    + ", ".join(self.missing[:20])
                    + (f" (+{len(self.missing) - 20} more)" if len(self.missing) > 20 else "")
                )
            raise StateMismatch(
                f"{self.ckpt.storage.url} step {self.ckpt.step}: the state does not match the "
                "checkpoint; nothing was loaded:\n  " + "\n  ".join(lines)
            )

    def _read_now(self, key: str, dest: _Dest) -> None:
        chunk = self.ckpt.chunks[key][0]
        read_entries(
            self.ckpt.storage,
            self.ckpt.shard_path(chunk.shard),
            [chunk.entry],
            self.ckpt.manifest.block_size,
            sink=lambda i, start, data: copy_into(dest.bytes[start:], data),
            cold=False,
        )

    def read(self, threads: int | None = None) -> int:
        """Read every planned key, verified; returns bytes read.

        A saved chunk whose box equals the wanted box is read straight into the
        destination. Otherwise every saved chunk that overlaps the wanted box is read
        (verified) into a temporary and its overlap copied in: correct for any world
        size; a later planner reads only the overlapping ranges.
        """
        per_shard: dict[str, tuple[list[IndexEntry], list[np.ndarray]]] = {}
        copies: list[Callable[[], None]] = []
        total = 0
        for key, dest in self.dests.items():
            for chunk, sink in self._sources(key, dest, copies):
                path = self.ckpt.shard_path(chunk.shard)
                entries, sinks = per_shard.setdefault(path, ([], []))
                entries.append(chunk.entry)
                sinks.append(sink)
                total += chunk.entry.length

        def load_shard(path: str) -> None:
            entries, sinks = per_shard[path]

            def sink(i: int, start: int, data: np.ndarray) -> None:
                copy_into(sinks[i][start:], data)

            read_entries(
                self.ckpt.storage,
                path,
                entries,
                self.ckpt.manifest.block_size,
                sink=sink,
                threads=threads,
            )

        if len(per_shard) == 1:
            load_shard(next(iter(per_shard)))
        elif per_shard:
            with ThreadPoolExecutor(min(4, len(per_shard))) as pool:
                list(pool.map(load_shard, per_shard))
        for fn in copies:
            fn()
        for fn in self.mutations:
            fn()
        for fn in self.after_read:
            fn()
        return total

    def _sources(
        self, key: str, dest: _Dest, copies: list[Callable[[], None]]
    ) -> list[tuple[Chunk, np.ndarray]]:
        chunks = self.ckpt.chunks[key]
        shape = tuple(chunks[0].entry.shape)
        offsets = dest.offsets or (0,) * len(shape)
        sizes = dest.sizes or shape
        for c in chunks:
            if tuple(c.entry.chunk_offsets) == offsets and tuple(c.entry.chunk_sizes) == sizes:
                return [(c, dest.bytes)]
        if not isinstance(dest.buffer, torch.Tensor):
            raise StateMismatch(f"key {key!r}: numpy values saved in chunks cannot be reassembled")
        out: list[tuple[Chunk, np.ndarray]] = []
        covered = 0
        for c in chunks:
            lo = [max(o, co) for o, co in zip(offsets, c.entry.chunk_offsets, strict=True)]
            hi = [
                min(o + n, co + cn)
                for o, n, co, cn in zip(
                    offsets, sizes, c.entry.chunk_offsets, c.entry.chunk_sizes, strict=True
                )
            ]
            if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)) and shape:
                continue
            tmp = torch.empty(tuple(c.entry.chunk_sizes), dtype=dest.buffer.dtype)
            out.append((c, tensor_bytes(tmp)))
            copies.append(
                functools.partial(
                    _copy_box, dest.buffer, offsets, tmp, tuple(c.entry.chunk_offsets), lo, hi
                )
            )
            n = 1
            for lo_, h in zip(lo, hi, strict=True):
                n *= h - lo_
            covered += n
        want = 1
        for n in sizes:
            want *= n
        if covered != want:
            raise StateMismatch(
                f"{self.ckpt.storage.url} step {self.ckpt.step}: key {key!r}: the saved chunks cover "
                f"{covered} of the {want} elements this rank needs"
            )
        return out


def _copy_box(
    dst: torch.Tensor,
    dst_offsets: tuple[int, ...],
    src: torch.Tensor,
    src_offsets: tuple[int, ...],
    lo: list[int],
    hi: list[int],
) -> None:
    d, s = dst, src
    for dim, (a, b) in enumerate(zip(lo, hi, strict=True)):
        d = d.narrow(dim, a - dst_offsets[dim], b - a)
        s = s.narrow(dim, a - src_offsets[dim], b - a)
    d.copy_(s)
