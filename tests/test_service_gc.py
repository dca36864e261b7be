"""`ckptd serve`'s garbage-collection pacing (ckptd/server/collector.py): the young
threshold rises with the ranks of the saves in flight on a real core, and never falls."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import RankSim, new_core, run, started

import ckpt
from ckptd.server import collector


@pytest.fixture
def saved_threshold():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_threshold_follows_a_save_in_flight_and_never_falls(
    tmp_path: Path, saved_threshold, monkeypatch
) -> None:
    monkeypatch.setattr(collector, "PACE_S", 0.01)
    world = 3
    job = str(tmp_path / "root" / "job")

    async def main() -> None:
        core = new_core(tmp_path / "root")
        async with started(core):
            monkeypatch.setattr(collector, "GC_YOUNG", 10)  # so that 3 ranks count
            gc.set_threshold(700)
            pacer = asyncio.get_running_loop().create_task(collector.pace(core))
            waiting: list[asyncio.Future] = []
            try:
                await asyncio.sleep(0.05)
                assert gc.get_threshold()[0] == 700  # no save in flight: left as it was
                ranks = [RankSim(core, job, r, world) for r in range(world)]
                for r in ranks:
                    r.prepare({"w": ckpt.PerRank(torch.full((4,), float(r.rank)))})
                # Two ranks joined: the save is in flight, its world counts in full.
                waiting = [asyncio.ensure_future(r.begin(1)) for r in ranks[:2]]
                await asyncio.sleep(0.1)
                assert collector.ranks_in_flight(core) == world
                assert gc.get_threshold()[0] == collector.GC_PER_RANK * world
                await asyncio.gather(ranks[2].begin(1), *waiting)
                for r in ranks:
                    await r.report(1, await r.write(1))
                for r in ranks:
                    assert (await core.await_commit(r.ref(1), 30)).status == "COMMITTED"
                await asyncio.sleep(0.05)
                assert collector.ranks_in_flight(core) == 0
                # Lowering it now would collect at once everything the save left behind.
                assert gc.get_threshold()[0] == collector.GC_PER_RANK * world
            finally:
                pacer.cancel()
                for w in waiting:
                    w.cancel()

    run(main())


def test_young_threshold_has_a_floor() -> None:
    assert collector.young_threshold(0) == collector.GC_YOUNG
    assert collector.young_threshold(16_384) == collector.GC_PER_RANK * 16_384
