"""Health stats of a floating-point chunk: NaN and Inf counts, sum of squares, max |x|.

Computed block by block in the pass that hashes the bytes (ckptd.format.writer), beside the
hash of the same block while it is in cache: no second read of the staging copy, and no
read of storage. The cheap way is chosen per dtype, in numpy on the hashing thread
(torch's own reductions on a CPU tensor fan out to its intra-op pool, which the hash
threads and the training compete for; bench/README.md, health_stats.py):

- float32, float64: one BLAS dot (the sum of squares) and a max and a min. A dot that
  comes out finite proves there is no NaN or Inf, so the counting runs only on a block
  that has one (or whose squares overflow float32).
- bfloat16: each pair of values is two float32 halves: a mask and a shift of the pair as
  uint32 give both as float32, exactly, and then as above.
- float16 (and a bfloat16 block of odd length): the magnitude bits (`x & 0x7fff`) and their
  maximum: ordered like the magnitudes, so the maximum is max |x| exactly and says at once
  whether any value is non-finite. The magnitudes become float32 by a shift (float16: then
  a power-of-two scale), exactly, and one dot gives the sum of squares.
- the 8-bit floats and float4_e2m1fn_x2: a histogram of the 256 byte values and a table of
  what each byte is (exact; about 0.6 GB/s, so an 8-bit state costs more than a wide one).

The sum of squares is accumulated in float32 within a block and in float64 across blocks
(relative error about 1e-6 per block); only finite values count towards it and max |x|.
A sum beyond float64 saturates at its largest value (the index is strict JSON: no inf).
Complex, integer and bool dtypes have no stats.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from ckptd.errors import InvalidManifest

_MAX = sys.float_info.max
_WIDE = {"float32": np.float32, "float64": np.float64}
# 16-bit floats: the magnitude bits of +Inf (above: NaN), the shift that turns magnitude
# bits into float32 bits, and the scale that turns that float32 into the value.
_HALF = {"bfloat16": (0x7F80, 16, 1.0), "float16": (0x7C00, 13, 2.0**112)}
_BYTE = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
COVERED = frozenset((*_WIDE, *_HALF, *_BYTE))
FIELDS = ("nan", "inf", "sumsq", "max_abs")
_FIELD_SET = frozenset(FIELDS)


def covered(dtype: str) -> bool:
    """Whether chunks of this dtype get stats (the real floating-point dtypes)."""
    return dtype in COVERED


class TensorStats(NamedTuple):
    """One chunk's (or, combined, one tensor's) health. nan/inf count elements (for
    float4_e2m1fn_x2, which has neither, of the two values per byte); sumsq and max_abs
    are over the finite values only. A tuple, so that a save can keep its thousands of
    blocks' stats as plain tuples (ckptd.format.writer._Hasher), which the collector
    stops tracking."""

    nan: int = 0
    inf: int = 0
    sumsq: float = 0.0
    max_abs: float = 0.0

    def plain(self) -> tuple[int, int, float, float]:
        """These fields as a plain tuple, which the collector stops tracking (it tracks
        every instance of a tuple's subclass)."""
        return (self.nan, self.inf, self.sumsq, self.max_abs)

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0

    @property
    def norm(self) -> float:
        """The L2 norm of the finite values."""
        return math.sqrt(self.sumsq)

    def to_json(self) -> dict[str, Any]:
        # Finite by construction (combine saturates); an index holds no NaN or Infinity,
        # which its writer (orjson) would turn into null.
        if not (math.isfinite(self.sumsq) and math.isfinite(self.max_abs)):
            raise ValueError(f"stats {self} are not finite: a bug in ckptd.format.tensorstats")
        return {"nan": self.nan, "inf": self.inf, "sumsq": self.sumsq, "max_abs": self.max_abs}


def combine(parts: Iterable[tuple[int, int, float, float]]) -> TensorStats:
    """The stats of the union of disjoint parts (blocks of a chunk, chunks of a tensor),
    each a TensorStats or a plain tuple of its fields."""
    nan = inf = 0
    sumsq = max_abs = 0.0
    for p_nan, p_inf, p_sumsq, p_max_abs in parts:
        nan += p_nan
        inf += p_inf
        sumsq += p_sumsq
        max_abs = max(max_abs, p_max_abs)
    return TensorStats(nan, inf, min(sumsq, _MAX), max_abs)


def block_stats(data: np.ndarray, dtype: str) -> TensorStats:
    """The stats of one block: `data` is whole elements of `dtype` as 1-D uint8."""
    if not data.nbytes:
        return TensorStats()
    wide = _WIDE.get(dtype)
    if wide is not None:
        return _wide(data.view(wide))
    if dtype == "bfloat16" and not data.nbytes % 4:
        return _bf16_pairs(data.view(np.uint32))
    half = _HALF.get(dtype)
    if half is not None:
        return _half(data.view(np.uint16), *half)
    return _bytes(data, _byte_table(dtype))


class _Scratch(threading.local):
    """Two uint32 buffers per hashing thread, reused block after block. A fresh numpy
    temporary per block is a fresh malloc that glibc hands back to the kernel when it is
    freed, so every block paid a page fault per 4 KiB of each temporary: that made the
    bfloat16 stats cost 1.7 CPU-s a GB, seven times the blake3 of the same bytes."""

    a: np.ndarray | None = None
    b: np.ndarray | None = None

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.a is None or self.b is None or self.a.size < n:
            self.a = np.empty(n, dtype=np.uint32)
            self.b = np.empty(n, dtype=np.uint32)
        return self.a[:n], self.b[:n]


_scratch = _Scratch()


def _bf16_pairs(u: np.ndarray) -> TensorStats:
    """bfloat16 two at a time: each is the top half of a float32, so masking off the low
    half (little-endian: the pair's first element) or shifting it up gives the values as
    float32 exactly, with no widening copy. The magnitude bits first (the sign does not
    change a square): their maximum is max |x| and says at once whether any value is NaN
    or Inf (then _half counts); squares beyond float32 make a dot non-finite (_half too).
    Into per-thread scratch buffers, never a fresh temporary (_Scratch)."""
    mag, lo = _scratch.get(u.size)
    np.bitwise_and(u, np.uint32(0x7FFF7FFF), out=mag)
    top = int(mag.view(np.uint16).max())
    if top >= _HALF["bfloat16"][0]:
        return _half(u.view(np.uint16), *_HALF["bfloat16"])
    np.left_shift(mag, np.uint32(16), out=lo)
    np.bitwise_and(mag, np.uint32(0xFFFF0000), out=mag)
    h, lo32 = mag.view(np.float32), lo.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        d = float(np.dot(h, h)) + float(np.dot(lo32, lo32))
    if not math.isfinite(d):
        return _half(u.view(np.uint16), *_HALF["bfloat16"])
    return TensorStats(0, 0, d, float(np.array([top << 16], dtype=np.uint32).view(np.float32)[0]))


def _wide(x: np.ndarray) -> TensorStats:
    # Squares beyond the dtype overflow to inf (then counted below, in float64): no warning,
    # which a caller's warnings-as-errors would turn into a failed save.
    with np.errstate(over="ignore", invalid="ignore"):
        d = float(np.dot(x, x))
    if math.isfinite(d):  # no NaN, no Inf (either makes the dot non-finite)
        return TensorStats(0, 0, d, max(float(x.max()), -float(x.min())))
    nan = int(np.count_nonzero(np.isnan(x)))
    inf = int(np.count_nonzero(np.isinf(x)))
    fin = x[np.isfinite(x)].astype(np.float64) if nan or inf else x.astype(np.float64)
    if not fin.size:
        return TensorStats(nan, inf)
    with np.errstate(over="ignore"):
        sumsq = float(np.dot(fin, fin))
    return TensorStats(nan, inf, min(sumsq, _MAX), float(np.abs(fin).max()))


def _half(u: np.ndarray, inf_bits: int, shift: int, scale: float) -> TensorStats:
    mag = u & np.uint16(0x7FFF)
    top = int(mag.max())
    nan = inf = 0
    if top >= inf_bits:
        nan = int(np.count_nonzero(mag > inf_bits))
        inf = int(np.count_nonzero(mag == inf_bits))
        mag[mag >= inf_bits] = 0
        top = int(mag.max())
    wide = mag.astype(np.uint32)
    wide <<= np.uint32(shift)
    x = wide.view(np.float32)
    if scale != 1.0:
        x *= np.float32(scale)
    with np.errstate(over="ignore"):
        d = float(np.dot(x, x))
    if not math.isfinite(d):  # squares beyond float32 (bfloat16 above 1.8e19)
        d = float(np.dot(x.astype(np.float64), x.astype(np.float64)))
    max_abs = float(np.array([top << shift], dtype=np.uint32).view(np.float32)[0]) * scale
    return TensorStats(nan, inf, d, max_abs)


@dataclasses.dataclass(frozen=True)
class _Table:
    """What each of the 256 byte values of an 8-bit dtype is."""

    nan: np.ndarray  # bool
    inf: np.ndarray  # bool
    sq: np.ndarray  # float64: the square (sum of both squares for float4 pairs), 0 if not finite
    mag: np.ndarray  # float64: |value| (the larger of a float4 pair), 0 if not finite


def _bytes(data: np.ndarray, t: _Table) -> TensorStats:
    counts = np.bincount(data, minlength=256)
    present = counts > 0
    return TensorStats(
        int(counts[t.nan].sum()) if t.nan.any() else 0,
        int(counts[t.inf].sum()) if t.inf.any() else 0,
        float(counts @ t.sq),
        float(t.mag[present].max(initial=0.0)),
    )


@functools.cache
def _byte_table(dtype: str) -> _Table:
    if dtype == "float4_e2m1fn_x2":
        # Two e2m1 values per byte, the first in the low nibble: 0, 0.5, 1, 1.5, 2, 3, 4, 6
        # and their negatives; no NaN, no Inf.
        e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2, dtype=np.float64)
        b = np.arange(256)
        lo, hi = e2m1[b & 0xF], e2m1[b >> 4]
        none = np.zeros(256, dtype=bool)
        return _Table(none, none, lo * lo + hi * hi, np.maximum(lo, hi))
    # The fp8 formats' tables from torch itself, once per dtype (only a process that saves
    # such a tensor gets here, and it has torch: the coordinator never computes stats).
    import torch

    v = torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype)).float().double().numpy()
    nan, inf = np.isnan(v), np.isinf(v)
    fin = np.where(nan | inf, 0.0, v)
    return _Table(nan, inf, fin * fin, np.abs(fin))


def parse(doc: Any, *, dtype: str, numel: int, what: object) -> TensorStats | None:
    """An index entry's optional `stats` field (None when absent), checked: an object of
    exactly nan, inf (integers, together at most the entry's elements: two per byte for
    float4_e2m1fn_x2), sumsq and max_abs (finite numbers >= 0), on a covered dtype only."""
    if doc is None:
        return None
    if not covered(dtype):
        raise InvalidManifest(f"{what}: has stats but its dtype {dtype} has none")
    if not isinstance(doc, dict) or doc.keys() != _FIELD_SET:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise InvalidManifest(
            f"{what}: field 'stats' must be an object of exactly {', '.join(FIELDS)}, "
            f"got {got}; the index was altered or written by another tool"
        )
    nan, inf = _count(doc, "nan", what), _count(doc, "inf", what)
    elements = numel * (2 if dtype == "float4_e2m1fn_x2" else 1)
    if nan + inf > elements:
        raise InvalidManifest(
            f"{what}: stats count {nan} NaN and {inf} Inf in a chunk of {elements} elements"
        )
    return TensorStats(nan, inf, _magnitude(doc, "sumsq", what), _magnitude(doc, "max_abs", what))


def _count(doc: dict[str, Any], name: str, what: object) -> int:
    v = doc[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidManifest(f"{what}: stats.{name} must be an integer >= 0, got {v!r}")
    return v


def _magnitude(doc: dict[str, Any], name: str, what: object) -> float:
    v = doc[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= _MAX:
        raise InvalidManifest(
            f"{what}: stats.{name} must be a finite number >= 0, got {str(v)[:40]}"
        )
    return float(v)
