"""Quarantine in the coordinator's catalog: the Quarantine RPC, retention, rebuild.

A Checkpointer whose load falls back tells its coordinator (through the real gRPC server of
the embedded coordinator), which marks the step QUARANTINED: newest-step queries skip it,
retention retires it once older than every kept step, and rebuild-catalog reads the
marker back from storage.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from ckpt_testutil import entry, flip_bit, shard_path
from coordinator_fixtures import RankSim, new_core, read_catalog, run, started

import ckpt
from ckptd.errors import CheckpointNotFound
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage

pytestmark = pytest.mark.timeout(60)


def finished(r):  # noqa: ANN001, ANN201
    wait = getattr(r, "wait", None)
    return wait() if callable(wait) else r


def test_checkpointer_load_records_the_quarantine_in_the_catalog(tmp_path: Path) -> None:
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job, timeout_s=30) as cp:
        for step in (1, 2):
            finished(cp.save({"w": torch.full((300,), float(step))}, step))
        e = entry(job, 2, "w")
        flip_bit(shard_path(job, 2), e["offset"] + 7)
        res = cp.load({})
        assert res.step == 1 and res.fell_back_from == 2
        infos = {i.step: i for i in cp.client.list_checkpoints(cp.path)}
        assert infos[2].status == "QUARANTINED" and "'w'" in infos[2].reason
        assert infos[1].status == "COMMITTED"
        assert cp.client.get_checkpoint(cp.path).step == 1  # newest committed skips it
        assert cp.latest_step() == 1
    rows = read_catalog(Path(job) / ".ckptd" / "catalog.sqlite")
    assert rows[2]["status"] == "QUARANTINED"


def test_core_quarantine_retention_and_rebuild(tmp_path: Path) -> None:
    root = tmp_path / "root"
    job = str(root / "team" / "run")

    async def main() -> None:
        core = new_core(root)
        async with started(core):
            s = RankSim(core, job, 0, 1)
            for step in (1, 2, 3):
                assert (await s.save(step, {"w": torch.full((3,), float(step))})).status == (
                    "COMMITTED"
                )
            rec = await core.quarantine(job, 2, "rank 0: block 0 of 'w' is corrupt")
            assert rec.status == "QUARANTINED" and "corrupt" in rec.reason
            again = await core.quarantine(job, 2, "another reason")  # idempotent
            assert again.reason == rec.reason
            # The marker is in storage even though no loader wrote it.
            assert ckfmt.quarantine_reason(open_storage(job), 2) == rec.reason
            assert core.get_checkpoint(job, None).step == 3
            with pytest.raises(CheckpointNotFound):
                await core.quarantine(job, 9, "no such step")
            # Retention: keep 1 -> steps 1 and 2 (quarantined, older than the kept 4) go.
            assert (
                await s.save(4, {"w": torch.full((3,), 4.0)}, keep_last=1)
            ).status == "COMMITTED"
            for _ in range(200):
                if [r.step for r in core.list_checkpoints(job)] == [4]:
                    break
                await asyncio.sleep(0.02)
            assert [r.step for r in core.list_checkpoints(job)] == [4]

    run(main())
    assert not (Path(job) / "step-000000000002").exists()

    # rebuild-catalog reads the marker back.
    ckfmt.quarantine(open_storage(job), 4, "found corrupt by hand")
    core = new_core(root, catalog=tmp_path / "fresh.sqlite")
    try:
        assert core.rebuild_from_storage() == 1
        [rec] = core.list_checkpoints(job)
        assert rec.status == "QUARANTINED" and rec.reason == "found corrupt by hand"
    finally:
        core.catalog.close()
