"""The resharding planner against brute force: random shapes, splits, boxes and blocks.

Pure geometry first (ckptd.format.reshard: which blocks to read, where each byte of a
block goes), then the whole path through real files (ckptd.format.boxes: a checkpoint
written as N shards with an arbitrary grid split, read back as an arbitrary box, every
block verified), then what a partial read does and does not read.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from ckpt_testutil import flip_bit
from hypothesis import given
from hypothesis import strategies as st

from ckptd import knobs
from ckptd.errors import HashMismatch
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing
from ckptd.format.boxes import BoxRead, contiguous_box, plan_box, read_boxes
from ckptd.format.manifest import Manifest
from ckptd.format.reshard import Overlap, intersect, range_boxes
from ckptd.format.writer import WriteItem, write_shard
from ckptd.storage import open_storage

# ----------------------------------------------------------------------------- geometry


@st.composite
def shape_and_box(draw: st.DrawFn, max_dims: int = 4, max_size: int = 7) -> tuple:
    nd = draw(st.integers(0, max_dims))
    shape = [draw(st.integers(1, max_size)) for _ in range(nd)]

    def box() -> tuple[list[int], list[int]]:
        off = [draw(st.integers(0, n - 1)) for n in shape]
        size = [draw(st.integers(1, n - o)) for n, o in zip(shape, off, strict=True)]
        return off, size

    return shape, box(), box()


@given(
    sb=shape_and_box(),
    itemsize=st.sampled_from([1, 2, 4, 8, 16]),
    block=st.sampled_from([1, 3, 8, 13, 64, 4096]),
)
def test_overlap_copy_and_blocks_match_brute_force(sb, itemsize, block):
    shape, (so, ss), (do, ds) = sb
    box = intersect(so, ss, do, ds)
    if box is None:
        return
    rng = np.random.default_rng(len(shape) * 1000 + itemsize)
    whole = rng.integers(0, 256, size=(*shape, itemsize), dtype=np.uint8)
    src = np.ascontiguousarray(whole[tuple(slice(o, o + n) for o, n in zip(so, ss, strict=True))])
    src = src.reshape(-1)
    dst = np.zeros(math.prod(ds) * itemsize, dtype=np.uint8)
    ov = Overlap(so, ss, do, ds, itemsize)

    # Brute force: the byte positions of the overlap inside the saved chunk.
    lo, hi = box
    needed = set()
    for idx in itertools.product(*(range(a, b) for a, b in zip(lo, hi, strict=True))):
        lin = 0
        for i, o, n in zip(idx, so, ss, strict=True):
            lin = lin * n + (i - o)
        needed.update(range(lin * itemsize, (lin + 1) * itemsize))
    want_blocks = sorted({b // block for b in needed})

    ranges = ov.ranges(block)
    got_blocks = sorted({b for a, z in ranges for b in range(a // block, -(-z // block))})
    assert got_blocks == want_blocks  # every needed block, and no other
    assert all(a % block == 0 for a, _ in ranges)

    copied = 0
    for a, z in ranges:
        for s in range(a, z, block):  # one call per whole block, as the reader does
            copied += ov.copy(dst, s, src[s : min(s + block, z)])
    assert copied == ov.nbytes == len(needed)
    want = np.zeros((*ds, itemsize), dtype=np.uint8)
    want[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, do, strict=True))] = whole[
        tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
    ]
    assert np.array_equal(dst, want.reshape(-1))


@given(
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=4),
    data=st.data(),
)
def test_range_boxes_partition_the_range(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    boxes = range_boxes(shape, start, end)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    seen: list[int] = []
    for lo, hi in boxes:
        for idx in itertools.product(*(range(a, b) for a, b in zip(lo, hi, strict=True))):
            lin = 0
            for i, s in zip(idx, shape, strict=True):
                lin = lin * s + i
            seen.append(lin)
    assert sorted(seen) == list(range(start, end))


def test_many_runs_are_merged_into_covering_spans():
    # A column of a tall matrix: one 4-byte run per row; over the cap, runs merge upward.
    ov = Overlap([0, 0], [100_000, 8], [0, 3], [100_000, 1], 4)
    starts, span = ov.runs(max_runs=1000)
    assert len(starts) <= 1000 and span >= 4
    assert ov.ranges(4096) == [(0, 100_000 * 8 * 4)]


# ----------------------------------------------------------------------- through files


def write_split(root: Path, shape: list[int], cuts: list[list[int]], block: int):
    """Save a float32 tensor of `shape` split on a grid at `cuts`, one box per rank's shard."""
    full = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) * 1.5 - 7
    edges = [[0, *c, n] for c, n in zip(cuts, shape, strict=True)]
    boxes = [
        ([a for a, _ in spans], [b - a for a, b in spans])
        for spans in itertools.product(
            *([(e[i], e[i + 1]) for i in range(len(e) - 1)] for e in edges)
        )
    ]
    ranks = len(boxes)
    storage = open_storage(str(root), create=True)
    with knobs.override(block_size=block):
        ckfmt.begin_step(storage, 1)
        shards = []
        for r in range(ranks):
            items = []
            for off, size in boxes[r : r + 1]:
                part = np.ascontiguousarray(
                    full[tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))]
                )
                items.append(
                    WriteItem("t", "float32", shape, off, size, part.reshape(-1).view(np.uint8))
                )
            shards.append(
                write_shard(
                    storage,
                    job=str(root),
                    step=1,
                    rank=r,
                    world_size=ranks,
                    generation=0,
                    items=items,
                )
            )
        m = Manifest(
            job=str(root),
            step=1,
            generation=0,
            world_size=ranks,
            block_size=block,
            alignment=4096,
            shards=shards,
            state={"tensor": "t"},
        )
        ckfmt.commit(storage, m)
    return storage, full


@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    data=st.data(),
    block=st.sampled_from([4096, 8192]),
)
def test_any_box_of_any_split_reads_back_exactly(tmp_path_factory, shape, data, block):
    cuts = [
        sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=2)) if n > 1 else [])
        for n in shape
    ]
    off = [data.draw(st.integers(0, n - 1)) for n in shape]
    size = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, off, strict=True)]
    root = tmp_path_factory.mktemp("split")
    storage, full = write_split(root, shape, cuts, block)
    ck = ckfmt.open_checkpoint(storage)
    out = np.zeros(math.prod(size), dtype=np.float32)
    read_boxes(ck, [BoxRead("t", off, size, out.view(np.uint8))])
    want = full[tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))]
    assert np.array_equal(out.reshape(size), want)


class _Dest:
    """A ByteDest over host bytes, as a device tensor's would be: it records each write."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.got = np.zeros(nbytes, dtype=np.uint8)
        self.written = 0

    def write(self, at: int, data: np.ndarray) -> None:
        assert 0 <= at and at + data.nbytes <= self.nbytes
        self.got[at : at + data.nbytes] = data
        self.written += data.nbytes


@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    data=st.data(),
    block=st.sampled_from([4096, 8192]),
)
def test_a_contiguous_box_reads_through_a_byte_dest(tmp_path_factory, shape, data, block):
    """A box every saved chunk fills in one run (a dim-0 slice, any split on dim 0) goes to
    a ByteDest as verified runs, each byte once; a box filled in strided runs is refused."""
    cuts = (
        [sorted(data.draw(st.sets(st.integers(1, shape[0] - 1), max_size=2)))]
        if shape[0] > 1
        else [[]]
    )
    cuts += [[] for _ in shape[1:]]
    lo = data.draw(st.integers(0, shape[0] - 1))
    rows = data.draw(st.integers(1, shape[0] - lo))
    off, size = [lo, *(0 for _ in shape[1:])], [rows, *shape[1:]]
    root = tmp_path_factory.mktemp("split")
    storage, full = write_split(root, shape, cuts, block)
    ck = ckfmt.open_checkpoint(storage)
    assert contiguous_box(ck, "t", off, size)
    dest = _Dest(math.prod(size) * 4)
    read_boxes(ck, [BoxRead("t", off, size, dest)])
    assert dest.written == dest.nbytes
    assert np.array_equal(dest.got.view(np.float32).reshape(size), full[lo : lo + rows])


def test_a_strided_box_is_refused_by_a_byte_dest(tmp_path):
    storage, _ = write_split(tmp_path, [8, 16], [[], []], 4096)
    ck = ckfmt.open_checkpoint(storage)
    assert not contiguous_box(ck, "t", [0, 4], [8, 4])  # a column slice: 8 runs
    with pytest.raises(ValueError, match="key 't'.*strided runs, which only a host buffer"):
        read_boxes(ck, [BoxRead("t", [0, 4], [8, 4], _Dest(8 * 4 * 4))])


def big_rows(tmp_path: Path, block: int = 4096) -> tuple:
    # 64 rows of 1 KiB in one chunk: 16 blocks of 4 KiB, 4 rows per block.
    return write_split(tmp_path, [64, 256], [[], []], block)


def test_row_slice_reads_only_its_blocks(tmp_path):
    storage, full = big_rows(tmp_path)
    ck = ckfmt.open_checkpoint(storage)
    [(_, ov)] = plan_box(ck, "t", [10, 0], [20, 256])
    assert ov.contiguous and ov.ranges(4096) == [(8192, 32768)]  # rows 8..31 = blocks 2..7
    out = np.zeros((20, 256), dtype=np.float32)
    n = read_boxes(ck, [BoxRead("t", [10, 0], [20, 256], out.reshape(-1).view(np.uint8))])
    assert n == 6 * 4096
    assert np.array_equal(out, full[10:30])


def test_damage_outside_the_box_is_not_read_damage_inside_is_caught(tmp_path):
    storage, full = big_rows(tmp_path)
    ck = ckfmt.open_checkpoint(storage)
    [chunk] = ck.chunks["t"]
    path = tmp_path / ck.shard_path(chunk.shard)
    flip_bit(str(path), chunk.entry.offset + 15 * 4096 + 5)  # block 15: rows 60..63
    out = np.zeros((20, 256), dtype=np.float32)
    read_boxes(ck, [BoxRead("t", [10, 0], [20, 256], out.reshape(-1).view(np.uint8))])
    assert np.array_equal(out, full[10:30])
    # Row 61 is in the damaged block: the whole block is verified, the load refuses it.
    out = np.zeros((1, 8), dtype=np.float32)
    with pytest.raises(HashMismatch, match=r"key 't' block 15"):
        read_boxes(ck, [BoxRead("t", [61, 8], [1, 8], out.reshape(-1).view(np.uint8))])
    assert not out.any()
    assert hashing.n_blocks(chunk.entry.length, 4096) == 16
