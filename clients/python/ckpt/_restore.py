"""Restore a checkpoint's node tree into a user's state, in place, at any world size.

Planning comes first and touches nothing: the saved tree is walked beside the target,
every mismatch (missing key, dtype, shape) is collected, and every tensor gets a
destination: the box of the global tensor this rank wants (the whole tensor, or a
DTensor's local shard) and a buffer for it (the target tensor itself when it is a
contiguous CPU tensor of the saved dtype, else a staging buffer copied in afterwards:
pinned for CUDA targets, the saved dtype when casting). Then, for every saved chunk of
that tensor that overlaps the wanted box, only the hash blocks covering the overlap are
read (ckptd.format.reshard), verified, and copied from the I/O buffer straight into the
destination; a saved chunk of the same box as the wanted one is one contiguous read.
Objects with load_state_dict() get their state after all reads, children before parents;
assignments into the caller's dicts and lists happen only after every read succeeded.

A tensor the target has no tensor for (a load into {}) is made new, as it was saved
where the tree says so: requires_grad, an nn.Parameter, and views of one storage rebuilt
over one buffer (values.view_groups) so that they share memory again. Loads into the
target's own tensors keep the target's tensors as they are and ignore all of that.

`prepare_step` opens and plans one step of one storage; its `read` reads it, this rank
alone or through a shared read (ckpt._shared_read). The policy around it (which step,
which tier's copy, who reads what, what a failure means, the ranks agreeing) is
ckpt._load's.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import mmap
import time
from collections.abc import Callable, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch

from ckpt._flatten import PerRank, is_stateful, readable_in_place, tensor_bytes
from ckpt._to_device import DeviceLoads
from ckptd.errors import InvalidManifest, StateMismatch
from ckptd.format import checkpoint as ckfmt
from ckptd.format import dtypes, layout, values
from ckptd.format.boxes import (
    BoxPlan,
    BoxRead,
    ByteDest,
    plan_boxes,
    read_boxes,
    saved_entry,
)
from ckptd.format.checkpoint import OpenCheckpoint
from ckptd.format.manifest import IndexEntry
from ckptd.storage.base import Storage
from ckptd.storage.local import ALIGN


@dataclasses.dataclass(frozen=True)
class LoadResult:
    step: int
    path: str
    bytes: int  # bytes read from storage (whole hash blocks), all verified
    seconds: float
    tensors: int = 0
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    state: Any = None  # the restored state (the object passed in, or a new structure)
    # strict=False: keys the state has and the checkpoint lacks (left as they were), and
    # saved keys the state has no place for (not loaded).
    missing_keys: list[str] = dataclasses.field(default_factory=list)
    unexpected_keys: list[str] = dataclasses.field(default_factory=list)
    # The load policy's account (ckpt._load): fell_back_from is the first step tried when
    # an older one was loaded; fallback_reason every copy that failed (also when another
    # tier's copy of the same step loaded); quarantined the steps whose copies this rank
    # marked.
    fell_back_from: int | None = None
    fallback_reason: str | None = None
    quarantined: list[int] = dataclasses.field(default_factory=list)
    # require_finite: the steps passed over because their stats count NaN or Inf values.
    unhealthy: list[int] = dataclasses.field(default_factory=list)
    # The tier whose copy of the step loaded (ckpt._load: "memory" this node's, "peer"
    # another node's, "local" the job's directory, "mirror"); "" outside a tier.
    tier: str = ""
    # Per shard file this rank took bytes from (its path in the job's layout): where they
    # came from, "local" / "mirror" or, from a memory tier, "memory" (this node's) or
    # "peer:node<N>", "+"-joined when a shared read got them from several (ckpt._provenance);
    # empty outside a tier and for an integration's own loader.
    shard_tiers: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclasses.dataclass
class _Dest:
    """Where one saved key's bytes go: the box [offsets, offsets+sizes) of the tensor."""

    key: str
    # Contiguous, of the saved dtype, shaped like the box: on the CPU, or a device tensor
    # the verified bytes are streamed to (ckpt._to_device).
    buffer: torch.Tensor | np.ndarray
    bytes: np.ndarray | ByteDest  # uint8 view of a CPU buffer; a device buffer's ByteDest
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()


# numpy's own dtypes; values saved from numpy arrays are always one of these.
_NUMPY_DTYPES = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
    "complex64 complex128".split()
)


def _box(d: _Dest) -> BoxRead:
    return BoxRead(d.key, d.offsets, d.sizes, d.bytes)


_ALIGNED_FROM = 1 << 20


def _empty(shape: Sequence[int], dtype: torch.dtype, phase: int = 0) -> torch.Tensor:
    """A new CPU tensor for a load to fill; from 1 MiB on, in memory of its own (an
    anonymous mmap, freed with the tensor) `phase` bytes into a page, as its bytes lie in
    the shard file, so an O_DIRECT read lands in it with no bounce copy
    (ckptd.format.reader)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < _ALIGNED_FROM:
        return torch.empty(tuple(shape), dtype=dtype)
    mem = mmap.mmap(-1, phase + nbytes)
    # A storage of exactly the tensor's bytes (a larger one would make it a view).
    return (
        torch.frombuffer(mem, dtype=torch.uint8, offset=phase, count=nbytes)
        .view(dtype)
        .view(tuple(shape))
    )


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.detach().copy_(src)


def _join(path: str, component: str) -> str:
    return f"{path}/{component}" if path else component


def matching(patterns: Sequence[str], key: str) -> list[str]:
    """The patterns of a load's `keys` that select the saved key `key` (a pattern also
    selects everything under it: 'model' is 'model' and 'model/*')."""
    return [
        p for p in patterns if fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(key, p + "/*")
    ]


def keys_patterns(keys: str | Sequence[str] | None) -> list[str] | None:
    """A load's `keys` argument as a list of glob patterns (None: every key)."""
    if keys is None:
        return None
    pats = [keys] if isinstance(keys, str) else list(keys)
    if not all(isinstance(p, str) and p for p in pats):
        raise ValueError(f"keys must be glob patterns (non-empty strings), got {keys!r}")
    return pats


class Planner:
    """Plans one load of one committed step into one target, then reads it.

    strict: keys the target has and the checkpoint lacks are an error (else reported in
        `missing`); saved keys the target's (non-empty) dicts lack are added (else reported
        in `unexpected` and skipped). An empty dict in the target is always filled.
    keys: glob patterns over the saved keys ('model/*', 'optim/state/*/exp_avg'); a pattern
        also selects everything under it ('model' is 'model' and 'model/*'). Only selected
        values are loaded; the rest of the target is left alone.
    cast: allow loading into tensors of another dtype (converted after the read).
    """

    def __init__(
        self,
        ckpt: OpenCheckpoint,
        *,
        strict: bool = True,
        rank: int = 0,
        keys: str | Sequence[str] | None = None,
        cast: bool = False,
    ):
        self.ckpt = ckpt
        self.rank = rank
        self.strict = strict
        self.cast = cast
        self.patterns = keys_patterns(keys)
        self._matched: set[str] = set()
        self.dests: dict[str, _Dest] = {}
        self.after_read: list[Callable[[], None]] = []
        # Assignments into the caller's dicts and lists, applied after every read succeeded,
        # so a load that fails (mismatch, corruption) leaves the containers untouched.
        self.mutations: list[Callable[[], Any]] = []
        self.problems: list[str] = []
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        # The tensors made new for a load into {} (the object a key's references share),
        # and the buffers of the view groups they are views of (checked before any
        # tensor memory is allocated).
        self.made: dict[str, torch.Tensor] = {}
        self.groups = values.view_groups(
            ckpt.manifest.state, self._geometry, f"{ckpt.storage.url} step {ckpt.step}"
        )
        self.bases: dict[str, torch.UntypedStorage] = {}
        self._box_plan: BoxPlan | None = None
        self.devices = DeviceLoads()

    def _file_phase(self, key: str) -> int:
        """Where a key's bytes start in a page of its shard file (a version-5 shard's
        entries start inside one), when one saved chunk holds the key: a tensor made for
        it starts there in its page too. 0 otherwise."""
        chunks = self.ckpt.chunks.get(key, ())
        return chunks[0].entry.offset % ALIGN if len(chunks) == 1 else 0

    @property
    def _where(self) -> str:
        return f"{self.ckpt.storage.url} step {self.ckpt.step}"

    # -- selection -------------------------------------------------------------------
    def _match(self, key: str) -> bool:
        if self.patterns is None:
            return True
        hits = matching(self.patterns, key)
        self._matched.update(hits)
        return bool(hits)

    def _wanted(self, node: Any, path: str) -> bool:
        """Whether any value under this saved node is selected by `keys`."""
        if self.patterns is None:
            return True
        if not isinstance(node, dict):
            return self._match(path)
        ((tag, body),) = node.items()
        if tag in values.TENSOR_TAGS:
            return self._match(values.tensor_key(body))
        if tag in ("float", "bytes"):
            return self._match(path)
        if tag == "stateful":
            return self._wanted(body, path)
        if tag == "dict":
            return any(
                self._wanted(v, _join(path, values.key_component(values.decode_scalar(k))))
                for k, v in body
            )
        if tag in ("list", "tuple"):
            return any(self._wanted(c, _join(path, str(i))) for i, c in enumerate(body))
        if tag == "per_rank":
            return any(self._wanted(n, _join(path, f"@rank{r}")) for r, n in body if r == self.rank)
        return self._match(path)

    def _target_selected(self, value: Any, path: str) -> bool:
        """Whether a value of the target (absent from the checkpoint) is selected by `keys`."""
        if self.patterns is None or self._match(path):
            return True
        if isinstance(value, PerRank):
            return self._target_selected(value.value, _join(path, f"@rank{self.rank}"))
        if isinstance(value, MutableMapping):
            return any(
                self._target_selected(v, _join(path, values.key_component(k)))
                for k, v in value.items()
            )
        if isinstance(value, (list, tuple)):
            return any(self._target_selected(v, _join(path, str(i))) for i, v in enumerate(value))
        return False

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
            self._read_dests([dest])
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
                self.restore(c, t[i] if t else None, _join(path, str(i)))
                for i, c in enumerate(body)
            )
        if tag == "per_rank":
            mine = [n for r, n in body if r == self.rank]
            inner = target.value if isinstance(target, PerRank) else target
            if not mine:
                if not self.strict:
                    self.missing.append(_join(path, f"@rank{self.rank}"))
                    return target
                self.problems.append(
                    f"/{path}: the checkpoint holds per-rank values for ranks "
                    f"{sorted(r for r, _ in body)[:8]}, none for rank {self.rank}"
                )
                return target
            value = self.restore(mine[0], inner, _join(path, f"@rank{self.rank}"))
            if isinstance(target, PerRank):
                target.value = value
                return target
            return value
        raise StateMismatch(f"/{path}: unknown node tag {tag!r}")

    def _dict(self, body: list[Any], target: Any, path: str) -> Any:
        saved = {values.decode_scalar(k): v for k, v in body}
        if isinstance(target, MutableMapping):
            fill = not target  # an empty dict takes whatever the checkpoint holds
            for k in target:
                if k not in saved:
                    kpath = _join(path, values.key_component(k))
                    if self._target_selected(target[k], kpath):
                        self.missing.append(kpath)
            for k, v in saved.items():
                kpath = _join(path, values.key_component(k))
                if not self._wanted(v, kpath):
                    continue
                if k not in target and not fill and not self.strict:
                    self.unexpected.append(kpath)
                    continue
                value = self.restore(v, target.get(k), kpath)
                # Containers change only once the load succeeded (see read()).
                self.mutations.append(functools.partial(target.__setitem__, k, value))
            return target
        return {
            k: self.restore(v, None, _join(path, values.key_component(k)))
            for k, v in saved.items()
            if self._wanted(v, _join(path, values.key_component(k)))
        }

    def _list(self, body: list[Any], target: Any, path: str) -> Any:
        if isinstance(target, MutableSequence) and not isinstance(target, (str, bytes)):
            if self.patterns is not None:
                if len(target) != len(body):
                    self.problems.append(
                        f"/{path}: the checkpoint's list has {len(body)} items, the state's "
                        f"{len(target)}; a partial load (keys=) does not change a list's length"
                    )
                    return target
                for i, c in enumerate(body):
                    if self._wanted(c, _join(path, str(i))):
                        value = self.restore(c, target[i], _join(path, str(i)))
                        self.mutations.append(functools.partial(target.__setitem__, i, value))
                return target
            new = [
                self.restore(c, target[i] if i < len(target) else None, _join(path, str(i)))
                for i, c in enumerate(body)
            ]
            self.mutations.append(functools.partial(target.__setitem__, slice(None), new))
            return target
        return [self.restore(c, None, _join(path, str(i))) for i, c in enumerate(body)]

    # -- leaves ----------------------------------------------------------------------
    def _saved(self, key: str) -> IndexEntry:
        return saved_entry(self.ckpt, key)

    def _geometry(self, key: str) -> tuple[list[int], int]:
        entry = self._saved(key)
        return entry.shape, dtypes.itemsize(entry.dtype)

    def _tensor(self, body: Any, target: Any, path: str) -> Any:
        key = values.tensor_key(body)
        entry = self._saved(key)
        dtype = dtypes.from_name(entry.dtype)
        shape = tuple(entry.shape)
        if type(target).__name__ == "DTensor":
            return self._dtensor(key, target, dtype, shape, path)
        if key in self.dests:
            buf = self.dests[key].buffer
            if not isinstance(buf, torch.Tensor):
                raise InvalidManifest(
                    f"{self._where}: key {key!r} is referenced "
                    "both as a tensor and as a numpy value; the manifest was edited"
                )
            if isinstance(target, torch.Tensor) and target is not buf:
                if self._check(target, dtype, shape, path):
                    self.after_read.insert(0, functools.partial(_copy, target, buf))
                return target
            return self.made.get(key, buf)
        if isinstance(target, torch.Tensor):
            if not self._check(target, dtype, shape, path):
                return target
            self._into(key, target, dtype, (0,) * len(shape), shape)
            return target
        attrs = body if isinstance(body, dict) else {}
        if "view" in attrs:
            buf = self._view(key, attrs["view"]["storage"], dtype, shape)
        else:
            buf = _empty(shape, dtype, self._file_phase(key))
            self.dests[key] = _Dest(key, buf, tensor_bytes(buf), (0,) * len(shape), shape)
        made = self.made[key] = self._as_saved(key, buf, attrs)
        return made

    def _view(self, key: str, group: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
        """A new tensor over its view group's buffer, where it sat in its saved storage."""
        g = self.groups[group]
        base = self.bases.get(group)
        if base is None:
            # Zeroed: bytes of the range no loaded key covers are never seen uninitialized.
            base = self.bases[group] = torch.zeros(g.span, dtype=torch.uint8).untyped_storage()
        offset, stride = g.members[key]
        t = torch.empty(0, dtype=dtype).set_(base, offset, shape, stride)
        # Views that share bytes are each read into a buffer of their own and copied in
        # after the reads: no two reads write one byte at once.
        self._into(key, t, dtype, (0,) * len(shape), shape, direct=g.disjoint)
        return t

    def _as_saved(self, key: str, t: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
        """`t` with the requires_grad and Parameter-ness it was saved with."""
        grad = bool(attrs.get("requires_grad", False))
        if grad and not (t.dtype.is_floating_point or t.dtype.is_complex):
            raise InvalidManifest(
                f"{self._where}: key {key!r} is marked requires_grad but its dtype "
                f"{dtypes.name_of(t.dtype)} cannot require gradients; the manifest was edited"
            )
        if attrs.get("parameter"):
            return torch.nn.Parameter(t, requires_grad=grad)
        return t.requires_grad_(grad)

    def _into(
        self,
        key: str,
        target: torch.Tensor,
        dtype: torch.dtype,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        *,
        direct: bool = True,
    ) -> None:
        """Make `target` (a tensor shaped like the box) the destination of `key`
        (read straight into it when it can be and `direct`, else staged and copied)."""
        if direct and readable_in_place(target, dtype):
            t = target.detach()
            self.dests[key] = _Dest(key, t, tensor_bytes(t), offsets, sizes)
            return
        streamed = (
            self.devices.dest(self.ckpt, key, target, dtype, offsets, sizes) if direct else None
        )
        if streamed is not None:
            self.dests[key] = _Dest(key, target.detach(), streamed, offsets, sizes)
            return
        # Staged in a CPU tensor, then copied into the target (a blocking copy_; for a
        # device target, host-to-device: a cast, or a box filled in strided runs, such as
        # a DTensor sharded on a dimension after the first). Pageable, not pinned: pinning
        # (cudaHostAlloc) a load's worth of memory cost more than the copies it speeds up
        # (a 10 GB load on an H200, 2026-12-04: 0.69 GB/s with fresh pinned buffers, 1.48
        # when torch's host cache had them, at 55 GB/s pinned H2D), and torch's cache
        # would keep that much host memory pinned for the rest of the process.
        buf = _empty(sizes, dtype, self._file_phase(key) if offsets == (0,) * len(sizes) else 0)
        copy = functools.partial(_copy, target, buf)
        self.dests[key] = _Dest(key, buf, tensor_bytes(buf), offsets, sizes)
        # Runs before load_state_dict callbacks (they were appended later).
        self.after_read.insert(0, copy)

    def _dtensor(
        self, key: str, target: Any, dtype: torch.dtype, shape: tuple[int, ...], path: str
    ) -> Any:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if not self._check(target, dtype, shape, path):
            return target
        local = target.to_local()
        sizes, offsets = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        if tuple(local.shape) != tuple(sizes):
            self.problems.append(
                f"/{path}: the DTensor's local shard {list(local.shape)} does not match its "
                f"placement ({list(sizes)})"
            )
            return target
        self._into(key, local, dtype, tuple(offsets), tuple(sizes))
        return target

    def _ndarray(self, key: str, target: Any, path: str) -> np.ndarray:
        entry = self._saved(key)
        shape = tuple(entry.shape)
        try:
            if entry.dtype not in _NUMPY_DTYPES:  # ml_dtypes would make np.dtype() accept more
                raise TypeError(entry.dtype)
            np_dtype = np.dtype(entry.dtype)
        except TypeError:
            raise InvalidManifest(
                f"{self._where}: key {key!r} is tagged as a numpy "
                f"value but its dtype {entry.dtype} has no numpy equivalent; the manifest was edited"
            ) from None
        if key in self.dests:
            known = self.dests[key].buffer
            if isinstance(known, np.ndarray):
                return known
            raise InvalidManifest(
                f"{self._where}: key {key!r} is referenced both "
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
        self.dests[key] = _Dest(key, arr, raw, (0,) * len(shape), shape)
        return arr

    def _check(self, target: Any, dtype: torch.dtype, shape: tuple[int, ...], path: str) -> bool:
        if tuple(target.shape) != shape or (target.dtype != dtype and not self.cast):
            hint = (
                " (pass cast=True to convert)"
                if tuple(target.shape) == shape and target.dtype.is_floating_point
                else ""
            )
            self.problems.append(
                f"/{path}: the checkpoint holds {dtypes.name_of(dtype)}{list(shape)}, "
                f"the state has {target.dtype}{list(target.shape)}{hint}"
            )
            return False
        return True

    # -- reading ---------------------------------------------------------------------
    def check(self) -> None:
        if self.patterns is not None and self.strict:
            for p in self.patterns:
                if p not in self._matched and not any(self._match(k) for k in self.ckpt.chunks):
                    self.problems.append(f"keys pattern {p!r} matches nothing in the checkpoint")
        lines = list(self.problems)
        if self.missing and self.strict:
            lines.append(
                "keys in the state but not in the checkpoint: "
                + ", ".join(self.missing[:20])
                + (f" (+{len(self.missing) - 20} more)" if len(self.missing) > 20 else "")
                + " (strict=False loads the rest and reports them)"
            )
        if lines:
            raise StateMismatch(
                f"{self._where}: the state does not match the "
                "checkpoint; nothing was loaded:\n  " + "\n  ".join(lines)
            )

    def _read_dests(self, dests: Sequence[_Dest]) -> int:
        """Read a few boxes now, this rank alone (a numpy scalar's bytes, while planning)."""
        return read_boxes(self.ckpt, [_box(d) for d in dests])

    def box_plan(self) -> BoxPlan:
        """The shard reads of every planned key (what a shared read announces); made once,
        after planning."""
        if self._box_plan is None:
            self._box_plan = plan_boxes(self.ckpt, [_box(d) for d in self.dests.values()])
        return self._box_plan

    def read(self, reads: Callable[[BoxPlan], int]) -> int:
        """Fill every planned key through `reads` (which reads, verifies and copies the
        plan's boxes, returning the bytes it read); apply the state changes."""
        try:
            total = reads(self.box_plan())
        finally:
            self.devices.finish()
        for fn in self.mutations:
            fn()
        for fn in self.after_read:
            fn()
        return total


# ------------------------------------------------------------------------ one step


# Reads, verifies and copies a plan's boxes from a step; returns the bytes it read.
Reads = Callable[[OpenCheckpoint, BoxPlan], int]


@dataclasses.dataclass
class PreparedStep:
    """A step opened and planned against a state; nothing read yet."""

    storage: Storage
    ckpt: OpenCheckpoint
    planner: Planner
    restored: Any
    t0: float

    def read(self, reads: Reads) -> LoadResult:
        """Read it through `reads` (this rank alone, or with its peers); the LoadResult."""
        ck, planner = self.ckpt, self.planner
        nbytes = planner.read(lambda plan: reads(ck, plan))
        return LoadResult(
            step=ck.step,
            path=f"{self.storage.url}/{layout.step_dir(ck.step)}",
            bytes=nbytes,
            seconds=time.perf_counter() - self.t0,
            tensors=len(planner.dests),
            metadata=ck.manifest.metadata,
            state=self.restored,
            missing_keys=list(planner.missing),
            unexpected_keys=list(planner.unexpected),
        )


def prepare_step(
    storage: Storage,
    state: Any,
    step: int,
    *,
    strict: bool = True,
    keys: str | Sequence[str] | None = None,
    cast: bool = False,
    rank: int = 0,
    manifest_blake3: str | None = None,
    check: Callable[[OpenCheckpoint], None] | None = None,
) -> PreparedStep:
    """Open `step` of `storage` (markers are not consulted) and plan `state` against it.

    manifest_blake3: the digest the coordinator's catalog recorded at commit (None: storage
    alone is trusted); a manifest that differs is CorruptCheckpoint. check(ck): called on
    the opened step before planning (the load policy's judgement of its indexes: it raises
    to refuse the step). Which step to load, from which tier, who reads what, and what a
    failure means is the load policy's (ckpt._load).
    """
    t0 = time.perf_counter()
    ck = ckfmt.open_checkpoint(storage, layout.check_step(step), manifest_blake3=manifest_blake3)
    if check is not None:
        check(ck)
    planner = Planner(ck, strict=strict, rank=rank, keys=keys, cast=cast)
    restored = planner.restore(ck.manifest.state, state, "")
    planner.check()
    return PreparedStep(storage, ck, planner, restored, t0)
