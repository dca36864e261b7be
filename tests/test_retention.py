"""Retention: one rule (ckptd.coordinator.retention.plan), the same removals everywhere.

The same job state (committed steps, an old quarantined step, an old unfinished step
directory) goes through the coordinator's retention (a real gRPC server, a real
Checkpointer) and through `ckpt.apply_retention` (storage alone, as the mirror does); both
remove exactly the same steps. Then the rule itself, case by case.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import ServerThread, finished

import ckpt
from ckptd.coordinator import retention
from ckptd.coordinator.catalog import SaveRecord
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import open_storage

pytestmark = pytest.mark.timeout(120)

# Committed 2..6 (6 saved last, with keep_last=2), 3 quarantined, 1 an unfinished save.
KEEP = 2
REMOVED = [1, 2, 3, 4]
LEFT = [5, 6]


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step))}


def make_debris(job: str, step: int) -> None:
    shards = Path(job) / layout.step_dir(step) / layout.SHARDS_DIR
    shards.mkdir(parents=True)
    (shards / "rank-00000.bin").write_bytes(b"partial")


def step_dirs(job: str) -> list[int]:
    return sorted(s for s in (layout.parse_step_dir(n) for n in os.listdir(job)) if s is not None)


def test_coordinator_and_apply_retention_remove_the_same_steps(tmp_path: Path) -> None:
    # Through the coordinator: a real server, a real Checkpointer, the Quarantine RPC.
    root = tmp_path / "served"
    job = str(root / "run")
    server = ServerThread(root)
    try:
        with ckpt.Checkpointer(job, coordinator=server.address, attempt="a") as cp:
            for step in (2, 3, 4, 5):
                finished(cp.save(state(step), step))
            cp.client.quarantine(cp.path, 3, "block 0 of 'w' is corrupt")
        make_debris(job, 1)
        with ckpt.Checkpointer(job, coordinator=server.address, attempt="a", keep_last=KEEP) as cp:
            finished(cp.save(state(6), 6))
    finally:
        server.stop()  # waits for the retention the commit of step 6 started
    via_coordinator = step_dirs(job)

    # Through storage alone: the same state, then ckpt.apply_retention.
    plain = str(tmp_path / "plain")
    for step in (2, 3, 4, 5, 6):
        ckpt.save(state(step), plain, step=step)
    ckfmt.quarantine(open_storage(plain), 3, "block 0 of 'w' is corrupt")
    make_debris(plain, 1)
    removed = ckpt.apply_retention(open_storage(plain), KEEP)

    assert removed == REMOVED
    assert step_dirs(plain) == LEFT
    assert via_coordinator == LEFT, (
        f"the coordinator left steps {via_coordinator}, ckpt.apply_retention {step_dirs(plain)}"
    )


def test_retention_knows_what_a_step_it_committed_borrows_without_reading_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every commit's retention learns what the kept steps borrow; the step just committed
    # is known from its commit (the coordinator wrote its manifest), an older one is read
    # once. An embedded coordinator (one per process), so the reads are counted here.
    read: list[int] = []
    real = ckfmt.read_lineage

    def counted(storage, step, *a, **kw):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_code is retention.with_borrows.__code__:
            read.append(step)
        return real(storage, step, *a, **kw)

    monkeypatch.setattr(ckfmt, "read_lineage", counted)
    job = str(tmp_path / "job")
    ckpt.save(state(1), job, step=1)  # committed before this Checkpointer's coordinator
    with ckpt.Checkpointer(job, keep_last=2) as cp:
        for step in (2, 3, 4, 5):
            finished(cp.save(state(step), step))
    assert read == [1], f"retention read the manifests of steps {read}"
    assert step_dirs(job) == [4, 5]


# -- the rule ----------------------------------------------------------------------------
def states(**by_status: list[int]) -> list[retention.StepState]:
    return [retention.StepState(s, status) for status, steps in by_status.items() for s in steps]


def test_plan_keeps_the_newest_and_everything_after_it() -> None:
    p = retention.plan(states(COMMITTED=[1, 2, 3], UNFINISHED=[0, 4, 9]), 1)
    assert p.retire == (1, 2)
    assert p.debris == (0,)  # 4 and 9 are after the newest committed (3): maybe in progress
    assert p.steps == (0, 1, 2)
    assert retention.plan(states(COMMITTED=[7]), 1) == retention.RetentionPlan()


def test_plan_touches_nothing_while_nothing_is_committed() -> None:
    p = retention.plan(states(UNFINISHED=[1, 2], QUARANTINED=[0], UNREADABLE=[3]), 1)
    assert p.steps == ()


def test_plan_never_touches_a_save_in_flight_or_an_unreadable_manifest() -> None:
    p = retention.plan(states(COMMITTED=[5, 6, 7], IN_FLIGHT=[1], UNREADABLE=[2]), 1)
    assert p.steps == (5, 6)


def test_plan_retires_a_quarantined_step_once_keep_last_committed_are_newer() -> None:
    assert retention.plan(states(COMMITTED=[4, 5], QUARANTINED=[3]), 3).steps == ()
    assert retention.plan(states(COMMITTED=[4, 5], QUARANTINED=[3]), 2).retire == (3,)
    assert retention.plan(states(COMMITTED=[2, 4, 5], QUARANTINED=[3]), 2).retire == (2, 3)
    assert retention.plan(states(COMMITTED=[2, 4], QUARANTINED=[3]), 1).retire == (2, 3)


def test_plan_refuses_keep_last_below_one() -> None:
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        retention.plan(states(COMMITTED=[1, 2]), 0)


def test_the_coordinator_view_trusts_its_catalog_and_keeps_what_it_does_not_know() -> None:
    def rec(step: int, status: str) -> SaveRecord:
        return SaveRecord("job", step, 0, 1, status)

    records = [rec(1, "ABORTED"), rec(2, "COMMITTED"), rec(3, "OPEN"), rec(4, "COMMITTED")]
    dirs = {0: True, 1: False, 2: True, 3: False, 4: True, 5: False}
    got = {s.step: s.status for s in retention.from_catalog(records, dirs, in_flight={5})}
    assert got == {
        0: retention.UNREADABLE,  # a manifest the catalog does not know: not its to judge
        1: retention.UNFINISHED,  # an aborted save's directory
        2: retention.COMMITTED,
        3: retention.IN_FLIGHT,
        4: retention.COMMITTED,
        5: retention.IN_FLIGHT,
    }
    assert retention.plan(retention.from_catalog(records, dirs, {5}), 1).steps == (1, 2)
