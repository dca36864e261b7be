"""`ckptd serve`'s garbage-collection pacing (ckptd/server/collector.py): the young
threshold rises with the ranks of the saves in flight on a real core; when none is in
flight, what is due is collected and the threshold falls back to its floor."""

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


class _Cycle:
    """Cyclic garbage of a kind nothing else makes: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _cycles() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is _Cycle)


def test_threshold_follows_a_save_in_flight_then_idle_collects_and_lowers_it(
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
                # No save in flight: collected, and set to the floor.
                assert gc.get_threshold()[0] == collector.GC_YOUNG
                ranks = [RankSim(core, job, r, world) for r in range(world)]
                for r in ranks:
                    r.prepare({"w": ckpt.PerRank(torch.full((4,), float(r.rank)))})
                # Two ranks joined: the save is in flight, its world counts in full.
                waiting = [asyncio.ensure_future(r.begin(1)) for r in ranks[:2]]
                await asyncio.sleep(0.1)
                assert collector.ranks_in_flight(core) == world
                assert gc.get_threshold()[0] == collector.GC_PER_RANK * world
                await asyncio.gather(ranks[2].begin(1), *waiting)
                collections: list[int] = []
                gc.callbacks.append(log := lambda phase, info: collections.append(phase))
                try:
                    # Garbage made while the save is in flight waits (no collection of
                    # the young generation under a threshold of world x GC_PER_RANK).
                    for _ in range(world):
                        _Cycle()
                    for r in ranks:
                        await r.report(1, await r.write(1))
                    assert collections == [] and _cycles() == world
                    for r in ranks:
                        assert (await core.await_commit(r.ref(1), 30)).status == "COMMITTED"
                    # Idle: what is due is collected at once, and the threshold is the
                    # floor again (the collection emptied the young generation first, so
                    # the next allocation does not walk what outlived the save).
                    for _ in range(100):
                        if gc.get_threshold()[0] == collector.GC_YOUNG:
                            break
                        await asyncio.sleep(0.02)
                    assert collector.ranks_in_flight(core) == 0
                    assert gc.get_threshold()[0] == collector.GC_YOUNG
                    assert "stop" in collections and _cycles() == 0
                finally:
                    gc.callbacks.remove(log)
            finally:
                pacer.cancel()
                for w in waiting:
                    w.cancel()

    run(main())


def test_young_threshold_has_a_floor() -> None:
    assert collector.young_threshold(0) == collector.GC_YOUNG
    assert collector.young_threshold(16_384) == collector.GC_PER_RANK * 16_384


def test_collect_due_picks_the_generation_cpythons_trigger_would(saved_threshold) -> None:
    """CPython collects the middle generation once its count (young collections since its
    last) passes its threshold, the oldest once the middle one's does."""
    gc.set_threshold(50_000, 3, 2)
    got: list[int] = []
    gc.callbacks.append(log := lambda phase, info: got.append(info["generation"]))
    try:
        gc.collect()  # every count at zero
        got.clear()
        for _ in range(20):
            collector.collect_due()
    finally:
        gc.callbacks.remove(log)
    starts = got[::2]  # each collection calls back at "start" and at "stop"
    young4 = [0, 0, 0, 0]
    assert starts == [*young4, 1, *young4, 1, *young4, 1, *young4, 2], starts
