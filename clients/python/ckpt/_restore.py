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

from ckpt._flatten import is_stateful, tensor_bytes
from ckptd.errors import StateMismatch
from ckptd.format import dtypes, values
from ckptd.format.checkpoint import Chunk, OpenCheckpoint
from ckptd.format.manifest import IndexEntry
from ckptd.format.reader import read_entries
from ckptd.storage.local import copy_into


@dataclasses.dataclass
class _Dest:
    """Where one saved key's bytes go."""

    key: str
    buffer: torch.Tensor | np.ndarray  # contiguous, CPU, of the saved dtype and shape
    bytes: np.ndarray  # uint8 view of buffer


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.detach().copy_(src)


class Planner:
    def __init__(self, ckpt: OpenCheckpoint, *, strict: bool = True):
        self.ckpt = ckpt
        self.strict = strict
        self.dests: dict[str, _Dest] = {}
        self.after_read: list[Callable[[], None]] = []
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
        if tag in ("ndarray", "npscalar"):
            arr = self._ndarray(body, target, path)
            return arr[()] if tag == "npscalar" else arr
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
            return self.restore(body[1], target, path)
        raise StateMismatch(f"{path}: unknown node tag {tag!r}")

    def _dict(self, body: list[Any], target: Any, path: str) -> Any:
        saved = {values.decode_scalar(k): v for k, v in body}
        if isinstance(target, MutableMapping):
            extra = [k for k in target if k not in saved]
            if extra and self.strict:
                self.missing.extend(f"{path}/{k}" for k in extra)
            for k, v in saved.items():
                target[k] = self.restore(v, target.get(k), f"{path}/{k}")
            return target
        return {k: self.restore(v, None, f"{path}/{k}") for k, v in saved.items()}

    def _list(self, body: list[Any], target: Any, path: str) -> Any:
        if isinstance(target, MutableSequence) and not isinstance(target, (str, bytes)):
            new = [
                self.restore(c, target[i] if i < len(target) else None, f"{path}/{i}")
                for i, c in enumerate(body)
            ]
            target[:] = new
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
        if key in self.dests:
            buf = self.dests[key].buffer
            assert isinstance(buf, torch.Tensor)
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

    def _ndarray(self, key: str, target: Any, path: str) -> np.ndarray:
        entry, _ = self._saved(key, path)
        shape = tuple(entry.shape)
        np_dtype = np.dtype(entry.dtype)
        if key in self.dests and isinstance(self.dests[key].buffer, np.ndarray):
            return self.dests[key].buffer  # type: ignore[return-value]
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

    def read(self, threads: int | None = None) -> int:
        """Read every planned key, verified; returns bytes read."""
        per_shard: dict[str, tuple[list[IndexEntry], list[np.ndarray]]] = {}
        total = 0
        for key, dest in self.dests.items():
            for chunk in self.ckpt.chunks[key]:
                if not chunk.entry.is_full:
                    raise StateMismatch(
                        f"{self.ckpt.storage.url} step {self.ckpt.step}: key {key!r} is stored in "
                        "chunks; loading sharded checkpoints needs a newer ckpt"
                    )
                path = self.ckpt.shard_path(chunk.shard)
                entries, sinks = per_shard.setdefault(path, ([], []))
                entries.append(chunk.entry)
                sinks.append(dest.bytes)
                total += chunk.entry.length
                break  # a full chunk covers the key; replicas are not read twice

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
        for fn in self.after_read:
            fn()
        return total
