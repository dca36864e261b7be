"""A SIGKILL at every named crash point (ckptd.faults), with the invariant checked after.

For each point a job of two ranks has a committed checkpoint and starts a new save; the
process that reaches the point dies by SIGKILL (CKPT_CRASH_AT in its environment: a rank
forked from tests/crash_harness.py's forkserver, or a real `ckptd serve`). Then the
system recovers the way it would in production (the lease or the barrier timeout aborts a
save a dead rank left; a restarted `ckptd serve` finishes or aborts what its previous life
left) and crash_harness.check_invariant must hold: the newest committed step is the old or
the new one (here: exactly the one each point implies), every committed step verifies,
the newest loads bit-exactly, and catalog and storage agree.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from coordinator_fixtures import ckptctl, read_catalog, step_files, wait_for
from crash_harness import (
    COORDINATOR_POINTS,
    NODE_POINTS,
    RANK_POINTS,
    RETENTION_POINTS,
    Job,
    assert_loads,
    check_invariant,
    committed_on_storage,
    wait_all,
)

import ckptd.faults
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_every_named_crash_point_is_covered() -> None:
    """A point added to ckptd.faults without a case here fails this test."""
    doc = ckptd.faults.__doc__ or ""
    named = set(re.findall(r"\b(?:rank|coordinator)\.[a-z_]+", doc))
    assert named == set(RANK_POINTS) | set(COORDINATOR_POINTS)
    used: set[str] = set()
    for p in Path(ckptd.faults.__file__).parents[1].rglob("*.py"):
        used |= set(re.findall(r"crash_point\(\"([a-z_.]+)\"\)", p.read_text()))
    for p in (Path(ckptd.faults.__file__).parents[1].parent / "clients").rglob("*.py"):
        used |= set(re.findall(r"crash_point\(\"([a-z_.]+)\"\)", p.read_text()))
    assert used == named, f"crash points in the code {sorted(used)} != documented {sorted(named)}"


@pytest.fixture
def fx(tmp_path: Path):
    j = Job(tmp_path, fork=True)
    try:
        yield j
    finally:
        j.cleanup()


def _save(step: int, **kw: object) -> dict:
    return {"save": step, "seed": step, **kw}


@pytest.mark.parametrize("point", list(RANK_POINTS))
def test_rank_killed_at(point: str, fx: Job, tally, monkeypatch: pytest.MonkeyPatch) -> None:
    expect = RANK_POINTS[point]
    fx.save_in_process([1])
    serve = fx.serve(lease_s=1.0, barrier_timeout_s=2.0).start()
    with tally.fault(f"crash:{point}"):
        # timeout_s bounds rank 0's wait at the barrier (after_stage: rank 1 never joins).
        ranks = fx.launch(
            serve,
            "a1",
            [_save(2)],
            lease_s=1.0,
            timeout_s=2.0,
            only={1: [_save(2, crash_at=f"{point}@1")]},
        )
        codes = wait_all(ranks, fx)
        assert codes == [0, -signal.SIGKILL], fx.logs()
        r0 = ranks[0].outcomes()
        assert r0 == ["ok" if expect == 2 else "SaveAborted"], (r0, fx.logs())
        if expect == 1:
            # The coordinator removes what the aborted save wrote (rank 1's half shard too).
            wait_for(lambda: step_files(fx.job, 2) == [], 10, "the aborted save's files to go")
        check_invariant(fx.job, [expect], world=2, monkeypatch=monkeypatch, catalog=serve.catalog)
        assert read_catalog(serve.catalog)[2]["status"] == (
            "COMMITTED" if expect == 2 else "ABORTED"
        )
        rc, out, err = ckptctl("verify", str(fx.job), "--all")
        assert rc == 0, out + err
    assert serve.stop() == 0


# Each coordinator point with the ranks calling the coordinator themselves, and again with
# them saving through their node's aggregator (node batches): a restart mid-save must end
# in the same states either way. The node-batch points exist only in the latter.
# The retention points once more with an incremental save (per-rank): the new step
# borrows blocks of an entry from the one before (the others changed), so the retention
# that retires the oldest step must keep that one (shared blocks), however it is killed.
COORDINATOR_CASES = [
    *((p, "per-rank") for p in COORDINATOR_POINTS if p not in NODE_POINTS),
    *((p, "node") for p in COORDINATOR_POINTS),
    *((p, "incremental") for p in RETENTION_POINTS),
]


@pytest.mark.parametrize(("point", "protocol"), COORDINATOR_CASES)
def test_coordinator_killed_at(
    point: str, protocol: str, fx: Job, tally, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Retention needs an older step to retire: keep the newest 2 of 1, 2, 3; incremental:
    # keep the newest 1, and 2 stays too because 3 borrows from it.
    retention = point in RETENTION_POINTS
    incremental = protocol == "incremental"
    old = [1, 2] if retention else [1]
    new = old[-1] + 1
    keep = (1 if incremental else 2) if retention else None
    fx.save_in_process(old, keep_last=0 if incremental else keep or 0, frozen=incremental)
    serve = fx.serve(lease_s=30)
    node = protocol == "node"
    with tally.fault(f"crash:{point}" + (f" ({protocol})" if protocol != "per-rank" else "")):
        serve.start(env={"CKPT_CRASH_AT": point})
        ranks = fx.launch(
            serve, "a1", [_save(new)], keep_last=keep, node=node, incremental=incremental
        )
        assert serve.wait_dead(60) == -signal.SIGKILL, serve.log()
        serve.start()  # recovery: finish or abort what the killed life left
        codes = wait_all(ranks, fx)
        assert codes == [0, 0], fx.logs()
        expect = new if COORDINATOR_POINTS[point] == 2 else old[-1]  # 2: the new step wins
        for r in ranks:
            outcome = r.outcomes()
            assert outcome == ["ok" if expect == new else "SaveAborted"], (outcome, fx.logs())
        check_invariant(
            fx.job,
            [expect],
            world=2,
            monkeypatch=monkeypatch,
            catalog=serve.catalog,
            frozen=incremental,
        )
        if expect == old[-1]:
            assert step_files(fx.job, new) == [], "the aborted save left files"
        if retention:  # the restarted coordinator finished retiring step 1
            wait_for(lambda: committed_on_storage(fx.job) == [2, 3], 10, "retention")
            assert not (fx.job / "step-000000000001").exists()
        if incremental:  # step 3 borrows from 2, which retention kept (keep_last=1)
            assert ckfmt.read_manifest(open_storage(str(fx.job)), 3).borrows == [2]
            # ... blocks 0 and 1 of "frozen" (its blocks 2 and 3 changed): shared blocks.
            ck = ckfmt.open_checkpoint(open_storage(str(fx.job)), 3)
            runs = [e.borrowed_blocks for i in ck.indexes for e in i.entries if e.key == "frozen"]
            assert [[(r.block, r.count) for r in x] for x in runs] == [[(0, 2)]], runs
            assert_loads(fx.job, 2, 2, 2, monkeypatch, frozen=True)
        rc, out, err = ckptctl("verify", str(fx.job), "--all")
        assert rc == 0, out + err
    assert serve.stop() == 0
