"""A one-rank save writes its shard while it hashes it, before the coordinator's plan
(ckpt._save_job.SaveJob.write_ahead): one pass over the bytes instead of a hash pass and
then a write pass. The file is written under a private name and renamed into place only
once the plan is the layout it was written in, so a save the coordinator refuses never
touches the shard path, which may be a committed step's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import _protocol, _save_job
from ckpt._flatten import flatten
from ckptd import knobs
from ckptd.errors import CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import writer
from ckptd.storage import open_storage


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 << 18, generator=g), "b": torch.randn(17, generator=g)}


def _shard_files(job: str) -> list[str]:
    return sorted(str(p.relative_to(job)) for p in Path(job).glob("step-*/shards/*"))


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("verify", ["full", "size"])
def test_one_rank_save_hashes_as_it_writes_and_never_before(
    job: str, monkeypatch: pytest.MonkeyPatch, blocking: bool, verify: str
) -> None:
    def no_hash_pass(self: _save_job.SaveJob) -> list[list[str]]:
        raise AssertionError("a one-rank save hashed its state before writing it")

    monkeypatch.setattr(_save_job.SaveJob, "digests", no_hash_pass)
    state = _state(1)
    if blocking:
        ckpt.save(state, job, step=1, verify=verify)
    else:
        with ckpt.Checkpointer(job, verify=verify) as cp:
            cp.save(state, 1).wait()
    assert _shard_files(job) == [
        "step-000000000001/shards/rank-00000.bin",
        "step-000000000001/shards/rank-00000.json",
    ]
    rep = ckfmt.verify_checkpoint(open_storage(job), 1, level="full")
    assert rep.ok, rep.problems
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


def test_recycled_file_written_ahead_then_published(job: str) -> None:
    # keep_last=1: the second save takes step 1's retired file from the pool.
    ckpt.save(_state(1), job, step=1, verify="size", keep_last=1)
    ckpt.save(_state(2), job, step=2, verify="size", keep_last=1)
    pool = Path(job) / ".ckptd" / "recycle"
    assert len(list(pool.glob("*.bin"))) == 1
    state = _state(3)
    ckpt.save(state, job, step=3, verify="full", keep_last=1)
    assert not any(".ahead." in p for p in _shard_files(job))
    out = ckpt.load({}, job, step=3).state
    assert torch.equal(out["w"], state["w"])


def test_a_refused_save_leaves_the_committed_shard_untouched(job: str, tally) -> None:
    ckpt.save(_state(1), job, step=1)
    shard = Path(job) / "step-000000000001" / "shards" / "rank-00000.bin"
    before = shard.read_bytes()
    with tally.bad_input("save-committed-step-again"):
        with pytest.raises(CkptError):
            ckpt.save(_state(2), job, step=1)  # step 1 is committed: refused at the plan
    assert shard.read_bytes() == before
    assert _shard_files(job) == [
        "step-000000000001/shards/rank-00000.bin",
        "step-000000000001/shards/rank-00000.json",
    ]
    rep = ckfmt.verify_checkpoint(open_storage(job), 1, level="full")
    assert rep.ok, rep.problems


def test_a_plan_that_differs_removes_the_file_written_ahead(job: str) -> None:
    # Defensive: one rank is always assigned every entry; if a plan ever differs, the
    # file written ahead goes and the plan's own layout is written as usual.
    with ckpt.Checkpointer(job) as cp:
        cp.save(_state(1), 1).wait()
        ref = _save_job.SaveRef(cp.path, 2, cp.generation, 0, 1)
        node, leaves = flatten(_state(2), rank=0, keep_device=True)
        sj = _save_job.SaveJob(cp.storage, ref, node, {}, cp.options, leaves, cp._image)
        assert sj.may_write_ahead(1) and not sj.may_write_ahead(2)
        digests = sj.write_ahead()
        assert digests == writer.hash_items(sj.items)  # the same digests as a hash pass
        ahead = Path(job) / writer.ahead_name("step-000000000002/shards/rank-00000.bin")
        assert ahead.exists()
        sj.keep_ahead([0])
        assert not ahead.exists() and sj.writer is None and sj.assigned is None
        assert not os.path.exists(Path(job) / "step-000000000002/shards/rank-00000.bin")


def _gate_writes_on_the_plan(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[int]]:
    """Every write window waits (10 s at most) until the coordinator has answered the plan;
    returns that event and the offsets of the windows written."""
    planned = threading.Event()
    written: list[int] = []
    real_write, real_begin = writer._write_window, _protocol.RankSave.begin

    def gated_write(handle, offset, length, pieces, progress):  # noqa: ANN001, ANN202
        planned.wait(10)
        written.append(offset)
        real_write(handle, offset, length, pieces, progress)

    def begin(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        try:
            return real_begin(self, *a, **kw)
        finally:
            planned.set()

    monkeypatch.setattr(writer, "_write_window", gated_write)
    monkeypatch.setattr(_protocol.RankSave, "begin", begin)
    return planned, written


@pytest.mark.parametrize("verify", ["full", "size"])
def test_the_plan_is_made_while_the_writes_are_in_flight(
    job: str, monkeypatch: pytest.MonkeyPatch, verify: str
) -> None:
    # The plan needs the hashes, not the writes: write_ahead returns with the hashes and
    # keep_ahead waits for the writes. A save that waited for its writes before planning
    # would find every write held back until the plan: 10 s each, then the assert below.
    planned, written = _gate_writes_on_the_plan(monkeypatch)
    state = _state(4)
    t0 = time.monotonic()
    ckpt.save(state, job, step=1, verify=verify)
    assert time.monotonic() - t0 < 8, "the plan waited for the shard's writes"
    assert written
    rep = ckfmt.verify_checkpoint(open_storage(job), 1, level="full")
    assert rep.ok, rep.problems
    assert torch.equal(ckpt.load({}, job, step=1).state["w"], state["w"])


def test_a_plan_refused_during_the_writes_stops_them_and_keeps_the_committed_shard(
    job: str, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    ckpt.save(_state(1), job, step=1)
    shard = Path(job) / "step-000000000001" / "shards" / "rank-00000.bin"
    before = shard.read_bytes()
    _, written = _gate_writes_on_the_plan(monkeypatch)
    with knobs.override(io_window=64 << 10, block_size=64 << 10):
        windows = -(-_state(2)["w"].nbytes // (64 << 10))
        with tally.bad_input("save-committed-step-again"), pytest.raises(CkptError, match="step"):
            ckpt.save(_state(2), job, step=1)  # committed: refused at the plan
    # The windows in flight when the plan was refused ended; no other one started.
    assert 0 < len(written) <= knobs.get().io_threads < windows
    assert shard.read_bytes() == before
    assert _shard_files(job) == [
        "step-000000000001/shards/rank-00000.bin",
        "step-000000000001/shards/rank-00000.json",
    ]
