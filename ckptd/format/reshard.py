"""Where a saved chunk's bytes go in a wanted chunk: the geometry of resharding.

A tensor saved by N ranks is a set of boxes of one global array, each stored C-contiguous
in some shard. A rank that loads it wants one box (its DTensor shard, or the whole tensor)
and needs, from every saved box that overlaps it, the overlap. An `Overlap` answers two
questions without touching torch:

- which bytes of the saved entry to read (`ranges`): the byte runs the overlap occupies,
  rounded out to whole hash blocks (a block can only be verified whole) and merged. A
  dim-0 split reloaded at another world size is one contiguous run; a column slice of a
  row-major chunk is many runs, read as the blocks that cover them;
- where a verified block's bytes go (`copy`): the block is a linear byte range of the
  saved chunk; it is cut into at most 2*ndim boxes (a partial row at each end, whole
  slabs between), each intersected with the overlap and copied as one strided copy
  straight into the destination. No temporary of the saved chunk's size is made.

Geometry works in bytes: a chunk of shape S and item size k is a byte array of shape
(*S, k), so a block size that is not a multiple of k (a crafted manifest) still works.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ckptd.storage.local import copy_into

Box = tuple[tuple[int, ...], tuple[int, ...]]  # [lo, hi) per dim


def c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of `shape`."""
    out = [0] * len(shape)
    acc = itemsize
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return tuple(out)


def intersect(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> Box | None:
    """The overlap of two boxes given as (offsets, sizes), or None when it is empty."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off, strict=True))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_size, b_off, b_size, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The elements [start, end) of a C-ordered array of `shape`, as at most 2*ndim-1 boxes."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(end, inner)
    out: list[Box] = []
    if i0 == i1:
        for lo, hi in range_boxes(rest, r0, r1):
            out.append(((i0, *lo), (i0 + 1, *hi)))
        return out
    if r0:
        for lo, hi in range_boxes(rest, r0, inner):
            out.append(((i0, *lo), (i0 + 1, *hi)))
        i0 += 1
    if i1 > i0:
        out.append(((i0, *(0,) * len(rest)), (i1, *rest)))
    if r1:
        for lo, hi in range_boxes(rest, 0, r1):
            out.append(((i1, *lo), (i1 + 1, *hi)))
    return out


def collapse(
    shape: Sequence[int], src: Sequence[int], dst: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Merge dims that are contiguous in both arrays: [(size, src stride, dst stride)].

    Size-1 dims are dropped; the result is never empty.
    """
    out: list[tuple[int, int, int]] = []
    for n, s, d in zip(shape, src, dst, strict=True):
        if n == 1:
            continue
        if out and out[-1][1] == n * s and out[-1][2] == n * d:
            out[-1] = (out[-1][0] * n, s, d)
        else:
            out.append((n, s, d))
    return out or [(1, 1, 1)]


def copy_strided(
    dst: np.ndarray, dst_at: int, src: np.ndarray, src_at: int, dims: list[tuple[int, int, int]]
) -> None:
    """Copy a strided byte box between two uint8 arrays (memcpy when it is one run)."""
    if len(dims) == 1 and dims[0][1] == 1 and dims[0][2] == 1:
        n = dims[0][0]
        copy_into(dst[dst_at : dst_at + n], src[src_at : src_at + n])
        return
    shape = tuple(d[0] for d in dims)
    sv = np.lib.stride_tricks.as_strided(
        src[src_at:], shape, tuple(d[1] for d in dims), writeable=False
    )
    dv = np.lib.stride_tricks.as_strided(dst[dst_at:], shape, tuple(d[2] for d in dims))
    np.copyto(dv, sv)


class Overlap:
    """The overlap of one saved chunk with one wanted chunk, both boxes of one tensor.

    src_offsets/src_sizes: the saved chunk's box in the global tensor (stored C-contiguous);
    dst_offsets/dst_sizes: the wanted chunk's box (its buffer is C-contiguous too).
    """

    def __init__(
        self,
        src_offsets: Sequence[int],
        src_sizes: Sequence[int],
        dst_offsets: Sequence[int],
        dst_sizes: Sequence[int],
        itemsize: int,
    ):
        box = intersect(src_offsets, src_sizes, dst_offsets, dst_sizes)
        if box is None:
            raise ValueError("the boxes do not overlap")
        lo, hi = box
        self.src_sizes = tuple(src_sizes)
        self.itemsize = itemsize
        # In the saved chunk's byte space (*src_sizes, itemsize):
        self.lo = (*(a - o for a, o in zip(lo, src_offsets, strict=True)), 0)
        self.hi = (*(b - o for b, o in zip(hi, src_offsets, strict=True)), itemsize)
        self.shift = (*(o - d for o, d in zip(src_offsets, dst_offsets, strict=True)), 0)
        self.src_shape = (*self.src_sizes, itemsize)
        self.sstr = (*c_strides(self.src_sizes, itemsize), 1)
        self.dstr = (*c_strides(tuple(dst_sizes), itemsize), 1)
        self.extent = tuple(b - a for a, b in zip(self.lo, self.hi, strict=True))
        self.nbytes = math.prod(self.extent)
        self.src_start = sum(a * s for a, s in zip(self.lo, self.sstr, strict=True))
        self.dst_start = self._dst_at(self.lo)
        self.entry_length = math.prod(self.src_shape)
        dims = collapse(self.extent, self.sstr, self.dstr)
        self.contiguous = len(dims) == 1 and dims[0][1] == 1 and dims[0][2] == 1

    def _dst_at(self, src_coord: Sequence[int]) -> int:
        return sum((c + sh) * s for c, sh, s in zip(src_coord, self.shift, self.dstr, strict=True))

    @property
    def whole(self) -> bool:
        """The overlap is the entire saved chunk, laid out the same way in the destination."""
        return self.contiguous and self.nbytes == self.entry_length

    def runs(self, max_runs: int = 1 << 16) -> tuple[np.ndarray, int]:
        """(start byte of each run in the saved entry, ascending; run length in bytes).

        A run covers every byte the overlap needs between its start and end. With more than
        max_runs runs, neighbouring runs are merged into their covering spans (reading a
        little more, never less).
        """
        if self.contiguous:
            return np.array([self.src_start], dtype=np.int64), self.nbytes
        nd = len(self.src_shape)
        # The innermost dims the overlap spans fully form one run with the first partial dim.
        k = nd - 1
        while k > 0 and self.extent[k] == self.src_shape[k]:
            k -= 1
        span = self.extent[k] * self.sstr[k]
        while k > 0 and math.prod(self.extent[:k]) > max_runs:
            k -= 1
            span = (self.extent[k] - 1) * self.sstr[k] + span
        starts = np.array([self.src_start], dtype=np.int64)
        for d in range(k):
            steps = np.arange(self.extent[d], dtype=np.int64) * self.sstr[d]
            starts = np.add.outer(starts, steps).reshape(-1)
        return starts, span

    def ranges(self, block: int) -> list[tuple[int, int]]:
        """Byte ranges of the saved entry to read: whole blocks covering every run, merged."""
        starts, span = self.runs()
        b0 = starts // block
        b1 = (starts + span - 1) // block
        new = np.ones(len(b0), dtype=bool)
        new[1:] = b0[1:] > b1[:-1] + 1
        firsts = np.flatnonzero(new)
        lasts = np.append(firsts[1:] - 1, len(b0) - 1)
        return [
            (int(b0[f]) * block, min((int(b1[e]) + 1) * block, self.entry_length))
            for f, e in zip(firsts, lasts, strict=True)
        ]

    def run_in(self, start: int, n: int) -> tuple[int, int, int] | None:
        """A contiguous overlap's bytes among saved bytes [start, start+n): (where they go
        in the destination, [lo, hi) of them in those n bytes); None: none of them."""
        if not self.contiguous:
            raise ValueError("run_in: the overlap is not one contiguous run")
        a = max(start, self.src_start)
        b = min(start + n, self.src_start + self.nbytes)
        if b <= a:
            return None
        return self.dst_start + (a - self.src_start), a - start, b - start

    def copy(self, dst: np.ndarray, start: int, data: np.ndarray) -> int:
        """Copy the overlap's bytes that lie in saved bytes [start, start+len(data)) into dst.

        dst: the destination buffer's bytes (uint8, C-contiguous, the wanted box). Returns
        the number of bytes copied.
        """
        end = start + data.nbytes
        if self.contiguous:
            run = self.run_in(start, data.nbytes)
            if run is None:
                return 0
            at, a, b = run
            copy_into(dst[at : at + (b - a)], data[a:b])
            return b - a
        done = 0
        for blo, bhi in range_boxes(self.src_shape, start, end):
            lo = tuple(max(x, y) for x, y in zip(blo, self.lo, strict=True))
            hi = tuple(min(x, y) for x, y in zip(bhi, self.hi, strict=True))
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            ext = tuple(h - low for low, h in zip(lo, hi, strict=True))
            src_at = sum(x * s for x, s in zip(lo, self.sstr, strict=True)) - start
            copy_strided(dst, self._dst_at(lo), data, src_at, collapse(ext, self.sstr, self.dstr))
            done += math.prod(ext)
        return done


def covered(overlaps: Sequence[Overlap]) -> int:
    """Bytes of the wanted box the overlaps fill (they come from disjoint saved chunks)."""
    return sum(o.nbytes for o in overlaps)
