"""O_DIRECT writes take the whole pages of page-aligned memory straight, the rest bounced.

ckptd.storage.local.direct_segments: a window whose pieces include memory aligned like its
file offset (a page-aligned tensor, as torch gives with THP_MEM_ALLOC_ENABLE=1, or pinned
memory) is one pwritev of those pages and of the bounce buffer's copies of everything
else, instead of one copy of the whole window. The bytes on disk are the same either way;
these tests check them, that the straight pages really are not copied, that every
transfer is page-aligned (O_DIRECT refuses the rest), and that a short write part-way
through the segments goes on from where it stopped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_testutil import FaultyOs

import ckpt
from ckptd import knobs
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import local, open_storage

PAGE = local.ALIGN
MIB = 1 << 20


def aligned(n: int, seed: int) -> np.ndarray:
    """n random bytes in page-aligned memory (as ckptd's own buffers are)."""
    _, buf = local.map_populated(-(-n // PAGE) * PAGE)
    buf = buf[:n]
    buf[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return buf


def unaligned(n: int, seed: int, shift: int = 64) -> np.ndarray:
    """n random bytes starting `shift` bytes past a page (as torch's large tensors do)."""
    base = aligned(n + PAGE, seed)
    return base[shift : shift + n]


def image_of(offset: int, n: int, pieces: list[tuple[int, np.ndarray]]) -> bytes:
    out = bytearray(n)
    for off, arr in pieces:
        out[off - offset : off - offset + arr.nbytes] = arr.tobytes()
    return bytes(out)


def test_segments_take_aligned_pages_straight_and_bounce_the_rest() -> None:
    offset, n = 8 * PAGE, 4 * MIB
    big = aligned(2 * MIB + 100, 1)  # page-aligned memory at a page-aligned offset
    small = unaligned(3000, 2)  # under a page, unaligned: bounced
    late = unaligned(MIB, 3)  # large but 64 bytes past a page: bounced
    pieces = [
        (offset, big),
        (offset + 2 * MIB + PAGE, small),
        (offset + 3 * MIB, late),
    ]
    bounce = aligned(n, 9)
    segs = local.direct_segments(offset, n, pieces, lambda k: bounce[:k])

    assert b"".join(s.tobytes() for s in segs) == image_of(offset, n, pieces)
    assert sum(s.nbytes for s in segs) == n
    for s in segs:  # what O_DIRECT takes: page-aligned memory, whole pages
        assert s.ctypes.data % PAGE == 0 and s.nbytes % PAGE == 0, (s.ctypes.data, s.nbytes)
    # The 2 MiB of whole pages of `big` went straight from it; everything else is a view
    # of the bounce buffer.
    assert np.shares_memory(segs[0], big) and segs[0].nbytes == 2 * MIB
    assert all(np.shares_memory(s, bounce) for s in segs[1:])
    assert not any(np.shares_memory(s, late) or np.shares_memory(s, small) for s in segs)


def test_a_window_inside_one_aligned_piece_is_not_copied() -> None:
    src = aligned(8 * MIB, 4)
    called: list[int] = []
    segs = local.direct_segments(
        PAGE, 4 * MIB, [(PAGE, src[: 4 * MIB])], lambda k: called.append(k) or aligned(k, 0)
    )
    assert len(segs) == 1 and np.shares_memory(segs[0], src) and not called


def test_unaligned_pieces_are_one_copy_of_the_window() -> None:
    pieces = [(0, unaligned(MIB + 5, 5)), (MIB + PAGE, unaligned(700_000, 6))]
    n = -(-(MIB + PAGE + 700_000) // PAGE) * PAGE
    bounce = aligned(n, 0)
    segs = local.direct_segments(0, n, pieces, lambda k: bounce[:k])
    assert len(segs) == 1 and np.shares_memory(segs[0], bounce)
    assert segs[0].tobytes() == image_of(0, n, pieces)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bytes as float32 hold NaNs, which torch.equal calls unequal)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


def page_aligned_state(seed: int) -> dict[str, Any]:
    """Tensors in page-aligned memory (straight) beside torch's own (bounced)."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for i, numel in enumerate((3 << 20, 1 << 20, 700_003)):
        t = torch.from_numpy(aligned(numel * 4, seed + i).view(np.float32))
        state[f"aligned{i}"] = t
        state[f"torch{i}"] = torch.randn(numel // 3 + i, generator=g)
    state["scalar"] = torch.tensor(seed)
    return state


def test_a_save_of_page_aligned_tensors_writes_them_straight_and_loads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = tmp_path / "job"
    state = page_aligned_state(1)
    vectors: list[int] = []

    def pwritev(fd: int, views: Any, offset: int) -> int:
        vectors.append(len(views))
        return os.pwritev(fd, views, offset)

    with knobs.override(direct_io=True):
        monkeypatch.setattr(local, "os", FaultyOs(pwritev=pwritev))
        ckpt.save(state, job, step=1)
        monkeypatch.setattr(local, "os", os)
    assert vectors and max(vectors) > 1, "no window mixed straight and bounced memory"
    st = open_storage(str(job))
    assert ckfmt.verify_checkpoint(st, 1).ok
    back = ckpt.load({}, job).state
    for k, v in state.items():
        assert same_bytes(back[k], v), k


def test_a_short_write_part_way_through_the_segments_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwritev writes one page at a time (as a kernel may when the disk fills mid-call):
    the writer goes on from there, across the straight and bounced segments."""
    job = tmp_path / "job"
    state = page_aligned_state(2)
    short = 0

    def pwritev(fd: int, views: Any, offset: int) -> int:
        nonlocal short
        first = memoryview(views[0])[:PAGE]
        short += 1
        return os.pwritev(fd, [first], offset)

    with knobs.override(direct_io=True):
        monkeypatch.setattr(local, "os", FaultyOs(pwritev=pwritev))
        ckpt.save(state, job, step=1)
        monkeypatch.setattr(local, "os", os)
    assert short > 100, short
    assert ckfmt.verify_checkpoint(open_storage(str(job)), 1).ok
    back = ckpt.load({}, job).state
    assert all(same_bytes(back[k], v) for k, v in state.items())
