"""Faults that used to cost the barrier timeout or the whole retry window, now seconds.

Real processes against a real `ckptd serve` (tests/ranks/plain_rank.py): two ranks that
save different steps get StepMismatch on both within seconds, naming each rank's step
(the coordinator sees that the two saves can never both gather every rank); a coordinator
killed while a rank waits for the commit fails the save within about the lease with
CoordinatorUnavailable naming the address and what to check; `ckptctl` against a closed
port exits 1 within seconds.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import (
    RankSim,
    ckptctl_proc,
    free_port,
    new_core,
    read_catalog,
    run,
    serving,
    start_rank,
    started,
)

import ckpt

pytestmark = [pytest.mark.multiprocess]


def _results(rank) -> list[dict]:  # noqa: ANN001 - coordinator_fixtures.Rank
    return rank.result().get("results", [])


@pytest.mark.timeout(180)
def test_ranks_saving_different_steps_fail_within_seconds(tmp_path: Path, tally) -> None:
    job = tmp_path / "jobs" / "run"
    with (
        tally.bad_input("ranks-disagree-on-step"),
        serving(tmp_path / "jobs", tmp_path / "serve", barrier_timeout_s=600) as serve,
    ):
        serve.start()
        ranks = [
            start_rank(
                tmp_path,
                {"job": str(job), "timeout_s": 600, "actions": [{"save": step}, {"save": 20}]},
                rank=r,
                world=2,
                address=serve.address,
                attempt="a1",
            )
            for r, step in ((0, 10), (1, 11))
        ]
        try:
            for r in ranks:
                r.wait(120)
        finally:
            for r in ranks:
                r.kill()
        for r in ranks:
            first, then = _results(r)
            assert first["outcome"] == "StepMismatch", r.log()
            msg = first["message"]
            assert "rank(s) 0 save step 10" in msg and "rank(s) 1 save step 11" in msg, msg
            assert "if_busy='skip'" in msg, msg
            assert first["t1"] - first["t0"] < 15, f"rank {r.rank} waited {first}"
            # The disagreement ended those saves only: the next, agreed, save commits.
            assert then["outcome"] == "ok", then
        cat = read_catalog(serve.catalog)
        assert cat[10]["status"] == cat[11]["status"] == "ABORTED"
        assert cat[20]["status"] == "COMMITTED"


def test_saves_that_arrive_interleaved_within_the_grace_both_commit(tmp_path: Path) -> None:
    """Two overlapping saves whose ranks arrive interleaved (DCP's async saves, every
    rank's BeginSave in one process) look disjoint for a moment: no false StepMismatch."""
    job = str(tmp_path / "jobs" / "run")

    async def body() -> list[str]:
        async with started(new_core(tmp_path / "jobs", barrier_timeout_s=60)) as core:
            ranks = [RankSim(core, job, r, 2) for r in range(2)]
            for r in ranks:
                r.prepare({"w": ckpt.PerRank(torch.arange(64.0) + r.rank)})
            first = [
                asyncio.create_task(ranks[0].save(10)),
                asyncio.create_task(RankSim.save(_twin(ranks[1]), 20)),
            ]
            await asyncio.sleep(0.3)  # step 10 holds rank 0 only, step 20 rank 1 only
            second = [
                asyncio.create_task(ranks[1].save(10)),
                asyncio.create_task(RankSim.save(_twin(ranks[0]), 20)),
            ]
            return [st.status for st in await asyncio.gather(*first, *second)]

    assert run(body()) == ["COMMITTED"] * 4


def _twin(r: RankSim) -> RankSim:
    """The same rank's side of another save (its own plan and shard state)."""
    t = RankSim(r.core, r.job, r.rank, r.world, r.generation)
    t.prepare({"w": ckpt.PerRank(torch.arange(64.0) + r.rank)})
    return t


@pytest.mark.timeout(180)
def test_coordinator_killed_while_a_rank_awaits_the_commit_fails_within_the_lease(
    tmp_path: Path, tally
) -> None:
    job = tmp_path / "jobs" / "run"
    with (
        tally.fault("coordinator-killed-mid-save"),
        serving(tmp_path / "jobs", tmp_path / "serve", lease_s=3, barrier_timeout_s=600) as serve,
    ):
        serve.start()
        spec = {"job": str(job), "lease_s": 3, "timeout_s": 600}
        waiter = start_rank(
            tmp_path,
            {**spec, "actions": [{"save": 1}]},
            rank=0,
            world=2,
            address=serve.address,
            attempt="a1",
        )
        # Rank 1 stops itself before its report: rank 0 reports and waits for the commit.
        held = start_rank(
            tmp_path,
            {**spec, "actions": [{"save": 1, "pause": "after_write"}]},
            rank=1,
            world=2,
            address=serve.address,
            attempt="a1",
        )
        try:
            held.wait_paused(timeout=60)
            time.sleep(1.0)  # rank 0 is in AwaitCommit by now
            serve.kill()
            killed = time.time()
            waiter.wait(60)
        finally:
            waiter.kill()
            held.kill()
        (rec,) = _results(waiter)
        assert rec["outcome"] == "CoordinatorUnavailable", waiter.log()
        assert rec["t1"] - killed < 15, f"the save failed {rec['t1'] - killed:.1f} s after the kill"
        msg = rec["message"]
        assert serve.address in msg and "CKPTD_ADDRESS" in msg and "TLS" in msg, msg


@pytest.mark.timeout(60)
def test_ckptctl_against_a_closed_port_fails_within_seconds(tmp_path: Path, tally) -> None:
    with tally.bad_input("coordinator-address-closed-port"):
        address = f"127.0.0.1:{free_port()}"  # bound and released: nothing listens there
        t0 = time.monotonic()
        rc, out, err = ckptctl_proc("list", str(tmp_path), "--coordinator", address)
        took = time.monotonic() - t0
        assert rc == 1, (rc, out, err)
        assert took < 5, f"ckptctl took {took:.1f} s to report a closed port"
        assert err.startswith("error:") and "Traceback" not in err, err
        assert address in err and "never answered" in err and "--coordinator" in err, err
