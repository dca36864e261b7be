"""A step that failed verification gives way to the next save of the same step.

Resume quarantines a corrupt step and falls back to the one before it, and training that
goes on reaches the same step number again. Before, that save was refused
(CheckpointExists: the directory still held the quarantined manifest): the failure raised
at the next save, and after every restart the job stopped at the same step. Now the
quarantined checkpoint gives way (ckptd.coordinator.retention.make_way, asked wherever a
save begins: the coordinator, the DCP and Lightning plug-ins, a mirror's upload): its
manifest first, then its files, then its marker, with a warning. A committed step is never
replaced, and a quarantined one that a kept step borrows bytes from stays.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from ckpt_testutil import flip_bit, shard_path
from coordinator_fixtures import RankSim, ckptctl, new_core, run, started, step_files

import ckpt
from ckptd.errors import CheckpointExists
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import open_storage

pytestmark = pytest.mark.timeout(120)
MEM = fsspec.filesystem("memory")


def state_at(step: int) -> dict[str, Any]:
    return {"w": torch.full((300,), float(step)), "step": step}


def train(cp: ckpt.Checkpointer, state: dict[str, Any], start: int, end: int) -> None:
    """The loop of docs/quickstart.md: a save every 10 steps, asynchronous."""
    for step in range(start + 1, end + 1):
        state["w"].fill_(float(step))
        state["step"] = step
        cp.maybe_save(state, step, every=10)


def manifest_files(job: str, step: int) -> set[str]:
    m = ckfmt.read_manifest(open_storage(job), step)
    return {layout.MANIFEST_NAME, *(p for sh in m.shards for p in (sh.path, sh.index))}


def test_training_goes_on_through_the_step_resume_fell_back_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job) as cp:
        train(cp, state_at(0), 0, 30)
    old = manifest_files(job, 30)
    flip_bit(shard_path(job, 30), 100)

    state = state_at(0)
    with caplog.at_level(logging.WARNING), ckpt.Checkpointer(job) as cp:
        start = cp.resume(state)
        assert start == 20 and ckfmt.quarantine_reason(open_storage(job), 30) is not None
        train(cp, state, 20, 40)  # saves 30 again, then 40: before, this raised at 40

    warned = [r.getMessage() for r in caplog.records if "takes the place" in r.getMessage()]
    assert len(warned) == 1 and "step 30" in warned[0] and "quarantined" in warned[0]
    infos = {i.step: i.status for i in ckfmt.list_steps(open_storage(job))}
    assert infos == {10: "COMMITTED", 20: "COMMITTED", 30: "COMMITTED", 40: "COMMITTED"}
    new = manifest_files(job, 30)
    # The quarantined copy's files and marker are gone; only the new save's are there.
    assert set(step_files(job, 30)) == new and not (old - {layout.MANIFEST_NAME}) & new
    m = ckfmt.read_manifest(open_storage(job), 30)
    assert m.parent == 20
    rc, out, err = ckptctl("verify", job, "--all")
    assert rc == 0, out + err
    back = state_at(0)
    with ckpt.Checkpointer(job) as cp:
        assert cp.resume(back) == 40
    assert torch.equal(back["w"], torch.full((300,), 40.0)) and back["step"] == 40
    assert ckpt.load(state_at(0), job, step=30).state["w"][0].item() == 30.0


def test_a_committed_step_is_never_replaced(tmp_path: Path) -> None:
    job = str(tmp_path / "job")
    ckpt.save(state_at(5), job, step=5)
    before = (Path(job) / layout.step_dir(5) / layout.MANIFEST_NAME).read_bytes()
    with pytest.raises(CheckpointExists, match=r"step-000000000005 is already committed"):
        ckpt.save(state_at(6), job, step=5)
    assert (Path(job) / layout.step_dir(5) / layout.MANIFEST_NAME).read_bytes() == before
    assert ckpt.load(state_at(0), job).state["w"][0].item() == 5.0


def test_a_quarantined_step_that_a_kept_step_borrows_from_stays(tmp_path: Path) -> None:
    job = str(tmp_path / "job")
    base = torch.randn(64, 1024)
    with ckpt.Checkpointer(job, incremental=True) as cp:
        for step in (1, 2):
            cp.save({"base": base, "w": torch.full((8,), float(step))}, step).wait()
    assert 1 in ckfmt.read_manifest(open_storage(job), 2).borrows
    ckfmt.quarantine(open_storage(job), 1, "found corrupt by hand")
    with pytest.raises(CheckpointExists, match="a step that stays borrows bytes from it"):
        ckpt.save({"base": base, "w": torch.zeros(8)}, job, step=1)
    assert ckfmt.quarantine_reason(open_storage(job), 1) == "found corrupt by hand"
    assert set(step_files(job, 1)) == manifest_files(job, 1) | {ckfmt.QUARANTINE_NAME}


def test_two_ranks_save_over_a_quarantined_step_of_their_own_generation(
    tmp_path: Path,
) -> None:
    """Through the coordinator's core with two simulated ranks: the same generation saves
    step 2 again after the coordinator quarantined it (its file names are the old ones)."""
    root = tmp_path / "root"
    job = str(root / "run")

    async def main() -> None:
        core = new_core(root)
        async with started(core):
            ranks = [RankSim(core, job, r, 2) for r in range(2)]

            async def save(step: int, value: float) -> list[str]:
                for r in ranks:
                    r.prepare({"w": ckpt.PerRank(torch.full((64,), value + r.rank))})
                got = await asyncio.gather(*(r.save(step) for r in ranks))
                return [g.status for g in got]

            assert await save(1, 1.0) == ["COMMITTED"] * 2
            assert await save(2, 2.0) == ["COMMITTED"] * 2
            await core.quarantine(job, 2, "rank 1: block 0 of 'w' is corrupt")
            assert await save(2, 20.0) == ["COMMITTED"] * 2
            assert core.get_checkpoint(job, None).step == 2

    run(main())
    assert ckfmt.quarantine_reason(open_storage(job), 2) is None
    assert set(step_files(job, 2)) == manifest_files(job, 2)
    got = ckpt.load({}, job).state["w"]
    assert got[0].item() == 20.0  # rank 0's value of the new save


def test_the_mirror_copy_gives_way_too(tmp_path: Path, mem_mirror: str) -> None:
    """Both copies of step 30 are damaged: resume falls back to 20 in both tiers, and the
    new step 30 replaces the quarantined one in the mirror as well."""
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job, mirror=mem_mirror) as cp:
        train(cp, state_at(0), 0, 30)
        assert cp._mirror is not None and cp._mirror.wait(60)
    flip_bit(shard_path(job, 30), 100)
    mirrored = f"/{mem_mirror[len('memory://') :]}/{layout.step_dir(30)}/{layout.shard_name(0)}"
    data = bytearray(MEM.cat_file(mirrored))
    data[100] ^= 1
    MEM.pipe_file(mirrored, bytes(data))

    state = state_at(0)
    with ckpt.Checkpointer(job, mirror=mem_mirror) as cp:
        assert cp.resume(state) == 20
        mirror = open_storage(mem_mirror)
        assert ckfmt.quarantine_reason(mirror, 30) is not None
        train(cp, state, 20, 30)
        assert cp._mirror is not None and cp._mirror.wait(60)
        assert not cp._mirror.failures
    mirror = open_storage(mem_mirror)
    assert ckfmt.quarantine_reason(mirror, 30) is None
    assert (
        mirror.read_bytes(f"{layout.step_dir(30)}/{layout.MANIFEST_NAME}", limit=1 << 20)
        == (Path(job) / layout.step_dir(30) / layout.MANIFEST_NAME).read_bytes()
    )
    back = ckpt.load(state_at(0), mem_mirror, step=30)
    assert back.state["w"][0].item() == 30.0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_gives_way_to_a_quarantined_step(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckpt.integrations.dcp import StorageReader, StorageWriter

    job = str(tmp_path / "job")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(job, step=1))
    ckfmt.quarantine(open_storage(job), 1, "found corrupt by hand")
    dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=StorageWriter(job, step=1))
    assert ckfmt.quarantine_reason(open_storage(job), 1) is None
    sd = {"w": torch.zeros(3)}
    dcp.load(sd, storage_reader=StorageReader(job, step=1))
    assert torch.equal(sd["w"], torch.full((3,), 2.0))


def test_a_step_removed_outside_the_coordinator_can_be_saved_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The catalog still says committed, storage has no such step (removed by hand):
    storage decides, and the save goes on with a warning."""
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job) as cp:
        for step in (1, 2):
            cp.save(state_at(step), step).wait()
    shutil.rmtree(Path(job) / layout.step_dir(2))
    with caplog.at_level(logging.WARNING), ckpt.Checkpointer(job) as cp:
        cp.save(state_at(22), 2).wait()
    assert any("the catalog says committed" in r.getMessage() for r in caplog.records)
    assert ckpt.load(state_at(0), job, step=2).state["w"][0].item() == 22.0


def test_a_give_way_cut_short_leaves_no_mark_on_the_next_save(tmp_path: Path) -> None:
    """A crash inside make_way after the quarantined manifest went (its marker still
    there): the next save of the step commits unmarked, in the job and in its mirror."""
    job = str(tmp_path / "job")
    mirror = str(tmp_path / "mirror")
    with ckpt.Checkpointer(job, mirror=mirror) as cp:
        for step in (1, 2):
            cp.save(state_at(step), step).wait()
        assert cp._mirror is not None and cp._mirror.wait(60)
    for root in (job, mirror):
        ckfmt.quarantine(open_storage(root), 2, "found corrupt by hand")
        (Path(root) / layout.step_dir(2) / layout.MANIFEST_NAME).unlink()  # the cut
    with ckpt.Checkpointer(job, mirror=mirror) as cp:
        cp.save(state_at(22), 2).wait()
        assert cp._mirror is not None and cp._mirror.wait(60)
    for root in (job, mirror):
        assert ckfmt.quarantine_reason(open_storage(root), 2) is None
        assert ckpt.load(state_at(0), root).state["w"][0].item() == 22.0
