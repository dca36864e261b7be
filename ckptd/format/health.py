"""A step's health from its shard indexes alone: what each tensor's chunks' stats add up to.

Every floating-point chunk's index entry may hold its stats (ckptd.format.tensorstats,
recorded as the bytes were hashed at save time), so judging a step costs no tensor read:
the indexes are what opening a step reads anyway. A tensor sharded over ranks is the sum
of its chunks (NaN and Inf counts, sums of squares; the largest max |x|), each box once.

A tensor whose chunks lack stats (saved before ckptd recorded them, or with the
health_stats knob off) is *unknown*, not healthy and not sick: `check` lists it apart, and
the load policy (ckpt._load, require_finite) loads such a step with a warning instead of
refusing every checkpoint a job wrote before an upgrade.

`compare` is `ckptctl diff`'s view: per tensor in both steps, the norm before and after,
and what stands out (a norm that grew or shrank by more than a factor, non-finite values
that the earlier step did not have).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ckptd.format.checkpoint import OpenCheckpoint
from ckptd.format.tensorstats import TensorStats, combine, covered

DEFAULT_JUMP = 2.0
JUMP, NONFINITE = "norm-jump", "new-nonfinite"


@dataclasses.dataclass(frozen=True)
class KeyHealth:
    """One floating-point tensor of a step: its chunks' stats combined (None: unknown,
    some chunk has none)."""

    key: str
    dtype: str
    chunks: int
    stats: TensorStats | None

    @property
    def finite(self) -> bool | None:
        return None if self.stats is None else self.stats.finite

    def describe(self) -> str:
        s = self.stats
        if s is None:
            return f"{self.key!r}: no stats"
        return f"{self.key!r}: {s.nan} NaN, {s.inf} Inf"

    def to_json(self) -> dict[str, Any]:
        s = self.stats
        return {
            "key": self.key,
            "dtype": self.dtype,
            "chunks": self.chunks,
            "known": s is not None,
            "nan": s.nan if s else None,
            "inf": s.inf if s else None,
            "norm": s.norm if s else None,
            "max_abs": s.max_abs if s else None,
        }


def key_health(ck: OpenCheckpoint, select: Callable[[str], bool] | None = None) -> list[KeyHealth]:
    """Every floating-point tensor of the step (those `select` accepts), sorted by key."""
    out = []
    for key in sorted(ck.chunks):
        chunks = ck.chunks[key]
        dtype = chunks[0].entry.dtype
        if not covered(dtype) or (select is not None and not select(key)):
            continue
        boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], TensorStats | None] = {}
        for c in chunks:
            e = c.entry
            boxes.setdefault((tuple(e.chunk_offsets), tuple(e.chunk_sizes)), e.stats)
        parts = list(boxes.values())
        known = [p for p in parts if p is not None]
        stats = combine(known) if len(known) == len(parts) else None
        out.append(KeyHealth(key, dtype, len(parts), stats))
    return out


@dataclasses.dataclass(frozen=True)
class StepHealth:
    step: int
    nonfinite: list[KeyHealth]  # tensors with NaN or Inf values
    unknown: list[KeyHealth]  # tensors without stats

    @property
    def finite(self) -> bool:
        """No tensor is known to hold a non-finite value (unknown ones do not count)."""
        return not self.nonfinite

    def describe(self, limit: int = 5) -> str:
        """'key 'a': 3 NaN, 0 Inf; key 'b': ...' of the first `limit` non-finite tensors."""
        shown = "; ".join(f"key {k.describe()}" for k in self.nonfinite[:limit])
        more = len(self.nonfinite) - limit
        return shown + (f"; and {more} more tensor(s)" if more > 0 else "")


def check(ck: OpenCheckpoint, select: Callable[[str], bool] | None = None) -> StepHealth:
    """The step's non-finite and unknown tensors (among those `select` accepts)."""
    keys = key_health(ck, select)
    return StepHealth(
        ck.step,
        [k for k in keys if k.finite is False],
        [k for k in keys if k.finite is None],
    )


@dataclasses.dataclass(frozen=True)
class NormChange:
    """One tensor in both steps: its norm and non-finite count before and after."""

    key: str
    a: TensorStats | None
    b: TensorStats | None
    flags: tuple[str, ...]  # JUMP, NONFINITE

    @property
    def ratio(self) -> float | None:
        """norm_b / norm_a (inf when a is 0 and b is not), None when either is unknown."""
        if self.a is None or self.b is None:
            return None
        if self.a.sumsq == 0:
            return 1.0 if self.b.sumsq == 0 else math.inf
        return self.b.norm / self.a.norm

    def to_json(self) -> dict[str, Any]:
        r = self.ratio
        return {
            "norm_a": self.a.norm if self.a else None,
            "norm_b": self.b.norm if self.b else None,
            "ratio": r if r is None or math.isfinite(r) else None,  # strict JSON: no inf
            "nonfinite_a": self.a.nan + self.a.inf if self.a else None,
            "nonfinite_b": self.b.nan + self.b.inf if self.b else None,
            "flags": list(self.flags),
        }


def compare(
    a: list[KeyHealth], b: list[KeyHealth], *, factor: float = DEFAULT_JUMP
) -> dict[str, NormChange]:
    """Per tensor in both lists: the change, flagged JUMP when the norm grew or shrank by
    more than `factor` (> 1), NONFINITE when b has more NaN + Inf than a."""
    if not factor > 1:
        raise ValueError(f"the norm jump factor must be above 1, got {factor}")
    before = {k.key: k.stats for k in a}
    out = {}
    for k in b:
        if k.key not in before:
            continue
        sa, sb = before[k.key], k.stats
        flags: list[str] = []
        change = NormChange(k.key, sa, sb, ())
        r = change.ratio
        if r is not None and (r > factor or r < 1 / factor):
            flags.append(JUMP)
        if sb is not None and sb.nan + sb.inf > (sa.nan + sa.inf if sa is not None else 0):
            flags.append(NONFINITE)
        out[k.key] = dataclasses.replace(change, flags=tuple(flags))
    return out
