"""The first Checkpointer.save stages into a buffer mapped off the training thread:
resume(state) maps (and faults in) the staging image on a thread of its own, so the first
save's blocking part is a copy, like a later one's (ckpt._staging.HostImage.prepare)."""

from __future__ import annotations

import threading

import pytest
import torch

import ckpt
from ckpt import _staging
from ckpt._staging import HostImage
from ckptd.storage import local


def test_resume_maps_the_staging_image_off_the_callers_thread(job):
    state = {"w": torch.randn(1 << 20), "b": torch.randn(7)}
    with ckpt.Checkpointer(job, verify="size") as cp:
        assert cp.resume(state, allow_fresh_start=True) is None  # a new job
        image = cp._image
        image.wait_prepared()
        assert image.capacity >= state["w"].nbytes + 4096
        assert image.allocated_on == "ckpt-staging-prepare"
        cp.save(state, 1).wait()
        assert image.allocated_on == "ckpt-staging-prepare"  # the first save reused it
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


def test_without_resume_the_first_save_maps_it_itself(job):
    state = {"w": torch.randn(1 << 16)}
    with ckpt.Checkpointer(job, verify="size") as cp:
        cp.save(state, 1).wait()
        assert cp._image.allocated_on == threading.current_thread().name


def test_prepare_then_ensure_waits_and_reuses():
    image = HostImage()
    image.prepare(3 << 20)
    buf = image.ensure(3 << 20)  # waits for the background mapping
    assert image.allocated_on == "ckpt-staging-prepare" and buf.nbytes == 3 << 20
    image.prepare(1 << 20)  # already large enough: nothing new is mapped
    assert image.ensure(1 << 20).ctypes.data == buf.ctypes.data
    image.release()


@pytest.mark.parametrize("madvise", ["kernel", "memset fallback"])
def test_map_populated_gives_zeroed_writable_pages(monkeypatch, madvise):
    # The mapping faults its pages in with the GIL released (madvise, else a memset of
    # each piece); either way the caller gets zeroed, writable, page-aligned memory.
    if madvise != "kernel":
        monkeypatch.setattr(local, "_madvise", None)
    size = 3 * local._FAULT_PIECE // 2 + 4096  # more than one memset piece
    mm, buf = local.map_populated(size)
    try:
        assert buf.nbytes == size and buf.ctypes.data % 4096 == 0
        assert not buf.any()
        buf[-1] = 7
        assert mm[size - 1] == 7
    finally:
        del buf
        mm.close()


def _smaps_field(address: int, field: str) -> str | None:
    """The smaps `field` of the mapping that holds `address` in this process."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    return None


def test_o_direct_buffers_ask_for_huge_pages():
    # A device request carries at most max_segments runs of physically contiguous memory:
    # into scattered 4 KiB pages a 32 MiB O_DIRECT read went as ~1 MiB requests and a
    # verify ran at 0.6 of a cold read of the same file; so the pooled read buffers and
    # the staging image (map_populated) are advised MADV_HUGEPAGE, like the bounce buffers.
    if local.thp_mode() != "madvise":
        pytest.skip(f"transparent huge pages are {local.thp_mode() or 'absent'!r}, not 'madvise'")
    mm, buf = local.map_populated(4 << 20)
    try:
        assert _smaps_field(buf.ctypes.data, "THPeligible") == "1"
    finally:
        del buf
        mm.close()


def test_a_save_before_the_mapping_is_done_says_how_long_it_waited(job, monkeypatch, caplog):
    # Mapping fresh memory can take seconds (a VM backs each page on first touch: about
    # 1.3-2.4 s a GB on the bench's). A first save that comes sooner waits for it, and its
    # SaveResult and log line say so; a later save, with the buffer ready, waits for nothing.
    gate = threading.Event()
    real = _staging.map_populated

    def slow_map(size):
        gate.wait(10)
        return real(size)

    monkeypatch.setattr(_staging, "map_populated", slow_map)
    state = {"w": torch.randn(1 << 18)}
    with ckpt.Checkpointer(job, verify="size") as cp:
        cp.resume(state, allow_fresh_start=True)  # starts the mapping, held by the gate
        # The gate opens a second from now: the save waits most of it, unless reaching the
        # buffer takes it half a second.
        threading.Timer(1.0, gate.set).start()
        with caplog.at_level("INFO", logger="ckpt"):
            first = cp.save(state, 1).wait()
        second = cp.save(state, 2).wait()
    assert 0.5 <= first.image_wait_s <= first.staging_s
    assert f"{first.image_wait_s:.3f} s of it waiting for the staging buffer" in caplog.text
    assert second.image_wait_s == 0.0


def test_small_copies_run_grouped_and_every_byte_lands(monkeypatch):
    """Neighbouring small copies run as one task of at least _COPY_GROUP bytes (a task a
    tensor cost 60 ms of a 3,000-tensor stall); with the group and the piece made tiny,
    tensors of every size, split across groups and pieces, still land at their offsets,
    with the padding between them zero."""
    from ckpt._flatten import flatten
    from ckptd import iopool

    monkeypatch.setattr(_staging, "_COPY_GROUP", 3000)
    monkeypatch.setattr(_staging, "_COPY_PIECE", 2048)
    groups: list[int] = []
    real = iopool.executor

    class Counting:
        def __init__(self, pool):
            self.pool = pool

        def map(self, fn, jobs):
            jobs = list(jobs)
            groups.append(len(jobs))
            return self.pool.map(fn, jobs)

    monkeypatch.setattr(_staging.iopool, "executor", lambda *a, **k: Counting(real(*a, **k)))
    g = torch.Generator().manual_seed(7)
    sizes = [0, 1, 5, 100, 1000, 3000, 5000, 7, 2048, 4097, 1, 20000]
    state = {
        f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
        for i, n in enumerate(sizes)
    }
    _, leaves = flatten(state, rank=0)
    buf, items, offsets = _staging.stage(leaves, HostImage(), threads=2)
    assert groups and 1 < groups[0] < sum(-(-n // 2048) for n in sizes)  # grouped, not one a piece
    ends = sorted((off, off + leaf.nbytes) for leaf, off in zip(leaves, offsets, strict=True))
    for leaf, item, off in zip(leaves, items, offsets, strict=True):
        assert bytes(buf[off : off + leaf.nbytes]) == bytes(leaf.data), leaf.key
        assert bytes(item.data) == bytes(leaf.data)
    for (_, end), (start, _) in zip(ends, ends[1:], strict=False):
        assert not buf[end:start].any()
