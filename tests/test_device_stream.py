"""Loads into device tensors stream each verified block to the device as it is hashed
(ckpt._to_device): through a small ring of pinned slots, or copied straight from the
reader's buffer. There is no CUDA device here, so these tests send CPU targets down that
path (the choice is the one thing patched: ckpt._restore's readable_in_place and
streams_to); the copies, the ring's reuse of its slots, the reshard runs and the refusal of
a corrupt block are the real code. tests/test_gpu_path.py runs it on CUDA tensors."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from ckpt_testutil import flip_bit

import ckpt
import ckpt._restore as restore
import ckpt._to_device as to_device
from ckpt._to_device import DeviceWrites
from ckptd import knobs
from ckptd.errors import HashMismatch
from ckptd.format import checkpoint as ckfmt
from ckptd.format.boxes import read_planned
from ckptd.storage import open_storage


@pytest.fixture
def streamed(monkeypatch):
    """Every contiguous target of the saved dtype takes the streaming path; the
    DeviceWrites each load made are recorded."""
    made: list[DeviceWrites] = []

    class Recorded(DeviceWrites):
        def __init__(self, device: torch.device):
            super().__init__(device)
            made.append(self)

    monkeypatch.setattr(restore, "readable_in_place", lambda t, dtype: False)
    monkeypatch.setattr(
        to_device, "streams_to", lambda t, dtype: t.dtype == dtype and t.is_contiguous()
    )
    monkeypatch.setattr(to_device, "DeviceWrites", Recorded)
    return made


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB: three hash blocks
        "bf16": torch.randn(1000, 33, generator=g).to(torch.bfloat16),
        "flags": torch.rand(5000, generator=g) > 0.5,
        "z": torch.randn(300, generator=g, dtype=torch.complex64),
        "empty": torch.zeros(0, 4),
    }


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.mark.parametrize(
    ("ring", "slot"),
    [
        (128 << 20, 8 << 20),  # the default: every block fits a slot
        (3 * 4096, 4096),  # three slots of a page: every block is cut, slots reused
        (0, 8 << 20),  # no ring: each block copied from the reader's buffer
    ],
)
def test_streamed_load_fills_every_target(job, streamed, ring, slot):
    state = _state()
    ckpt.save(state, job, step=1)
    dst = {k: torch.full_like(v, 3) for k, v in state.items()}
    with knobs.override(device_load_ring=ring, device_load_slot=slot):
        res = ckpt.load(dst, job, step=1)
    for k, v in state.items():
        assert torch.equal(dst[k], v), k
    assert res.bytes >= _nbytes(state)
    [writes] = streamed
    assert writes.copied == _nbytes(state)  # each byte once, through the streaming path


def _load_box(job: str, full: torch.Tensor, offsets: tuple, sizes: tuple) -> torch.Tensor:
    """The box of saved tensor `full` (key "t") loaded by the planner into a new target,
    as a rank of another world size wants its shard."""
    ckpt.save({"t": full}, job, step=1)
    ck = ckfmt.open_checkpoint(open_storage(job), 1)
    planner = restore.Planner(ck)
    part = torch.zeros(sizes, dtype=full.dtype)
    planner._into("t", part, full.dtype, offsets, sizes)
    planner.read(lambda plan: read_planned(ck, plan))
    return part


def test_streamed_load_of_a_dim0_slice_reads_each_saved_run(job, streamed):
    """A box filled in one run of each saved chunk (a dim-0 shard loaded at another world
    size) streams too; the blocks it covers past the box are verified, not copied."""
    full = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)  # 4 KiB rows
    part = _load_box(job, full, (10, 0), (20, 1024))
    assert torch.equal(part, full[10:30])
    assert streamed[0].copied == part.numel() * 4


def test_a_strided_box_is_staged_not_streamed(job, streamed):
    full = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    cols = _load_box(job, full, (0, 4), (16, 4))
    assert torch.equal(cols, full[:, 4:])
    assert not streamed  # a column slice goes through a host buffer


def test_a_corrupt_block_never_reaches_a_streamed_target(job, streamed):
    state = {"big": torch.randn(3 << 18)}  # blocks 0..2 of 1 MiB
    ckpt.save(state, job, step=1)
    ck = ckfmt.open_checkpoint(open_storage(job), 1)
    [chunk] = ck.chunks["big"]
    flip_bit(f"{job}/{ck.shard_path(chunk.shard)}", chunk.entry.offset + (1 << 20) + 99)
    dst = {"big": torch.full((3 << 18,), 5.0)}
    with pytest.raises(HashMismatch, match=r"key 'big' block 1 .*restore an earlier step"):
        ckpt.load(dst, job, step=1, fallback=False)
    got, want = dst["big"].view(3, 1 << 18), state["big"].view(3, 1 << 18)
    assert torch.equal(got[1], torch.full((1 << 18,), 5.0))  # the corrupt block: not copied
    for b in (0, 2):  # the others hold the target's bytes or the verified ones
        assert torch.equal(got[b], want[b]) or torch.equal(got[b], torch.full_like(got[b], 5.0))
    assert streamed[0]._flying == collections.deque()  # finish() ran: nothing in flight


def test_the_ring_waits_for_a_slot_when_every_one_is_taken():
    """Eight threads writing through a ring of two slots: each write waits for one, none is
    lost or written twice."""
    with knobs.override(device_load_ring=2 * 64, device_load_slot=64):
        writes = DeviceWrites(torch.device("cpu"))
    dst = torch.zeros(8 * 1000, dtype=torch.uint8)
    src = torch.randint(0, 256, (8 * 1000,), dtype=torch.uint8)

    def one(i: int) -> None:
        lo = i * 1000
        for at in range(lo, lo + 1000, 100):
            writes.write(dst[at : at + 100], src[at : at + 100].numpy())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writes.finish()
    assert torch.equal(dst, src)
    assert writes.copied == dst.numel()
    assert writes._made == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_load_through_ckptd_streams_too(tmp_path, streamed):
    """DCP's reader (ckpt.integrations.dcp) hands device targets the same way."""
    import torch.distributed.checkpoint as dcp

    from ckpt.integrations.dcp import StorageReader, StorageWriter

    state = _state()
    del state["empty"]
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "job", step=1), no_dist=True)
    dst = {k: torch.full_like(v, 3) for k, v in state.items()}
    dcp.load(dst, storage_reader=StorageReader(tmp_path / "job", step=1), no_dist=True)
    for k, v in state.items():
        assert torch.equal(dst[k], v), k
    assert sum(w.copied for w in streamed) == _nbytes(state)
