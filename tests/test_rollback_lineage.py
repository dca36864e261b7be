"""Rollbacks: a save reported committed is never removed by its own commit, and after a
rollback the job's newest checkpoint is the head of its live line (docs/concepts.md,
Rollbacks and the live line).

Each scenario runs through a real Checkpointer (its embedded coordinator, its catalog),
restarts (a new Checkpointer resumes), and checks what storage holds, what resume loads,
that every step a wait() reported committed is still loadable unless the live line's
keep_last retired it, and what `ckptctl list --json` says; then the same saves through
storage alone (`ckpt.apply_retention`) give the same steps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckpt
from ckptd.coordinator import retention
from ckptd.errors import CheckpointNotFound
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import open_storage

pytestmark = pytest.mark.timeout(180)

Runner = Callable[..., tuple[int, str, str]]  # the ckptctl fixture (conftest.py)


@pytest.fixture(autouse=True)
def _one_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_PATH"):
        monkeypatch.delenv(k, raising=False)


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step))}


def step_dirs(job: str) -> list[int]:
    return sorted(s for s in (layout.parse_step_dir(n) for n in os.listdir(job)) if s is not None)


def loads(job: str, step: int) -> bool:
    target = {"w": torch.zeros(64)}
    try:
        ckpt.load(target, job, step=step)
    except CheckpointNotFound:
        return False
    return bool(torch.equal(target["w"], state(step)["w"]))


def listed(ckptctl: Runner, job: str) -> dict[int, tuple[int | None, str]]:
    rc, out, _ = ckptctl("list", job, "--json")
    assert rc == 0, out
    return {s["step"]: (s["parent"], s["line"]) for s in json.loads(out)["steps"]}


def test_a_rollback_keeps_the_new_line_and_resume_loads_its_head(
    tmp_path: Path, ckptctl: Runner
) -> None:
    job = str(tmp_path / "job")
    committed = []
    with ckpt.Checkpointer(job, keep_last=2) as cp:
        for step in (10, 20):
            cp.save(state(step), step)
            committed.append(cp.wait())
        cp.load({"w": torch.zeros(64)}, step=10)  # the rollback: train on from step 10
        for step in (12, 14, 16):
            cp.save(state(step), step)
            committed.append(cp.wait())
    assert all(r is not None for r in committed)

    # 10 and 12 were the live line's oldest; 20 is the abandoned branch: kept and listed.
    assert step_dirs(job) == [14, 16, 20]
    with ckpt.Checkpointer(job, keep_last=2) as cp:
        target = {"w": torch.zeros(64)}
        assert cp.resume(target) == 16, "resume loaded the abandoned branch, not the live line"
        assert torch.equal(target["w"], state(16)["w"])
        assert cp.latest_step() == 16
        cp.save(state(18), 18)
        assert cp.wait() is not None
    assert step_dirs(job) == [16, 18, 20]
    assert all(loads(job, s) for s in (16, 18, 20))
    assert listed(ckptctl, job) == {
        16: (14, "live"),
        18: (16, "head"),
        20: (10, "abandoned"),
    }
    rc, out, _ = ckptctl("list", job)
    assert rc == 0 and "PARENT" in out and "abandoned" in out and "[20]" in out

    # Storage alone (the mirror's and ckpt.apply_retention's way) decides the same.
    plain = str(tmp_path / "plain")
    with ckpt.Checkpointer(plain) as cp:
        for step in (10, 20):
            cp.save(state(step), step, blocking=True)
        cp.load({"w": torch.zeros(64)}, step=10)
        for step in (12, 14, 16):
            cp.save(state(step), step, blocking=True)
    assert ckpt.apply_retention(open_storage(plain), 2) == [10, 12]
    assert step_dirs(plain) == [14, 16, 20]
    assert ckfmt.latest_step(open_storage(plain)) == 16


def test_a_lower_step_saved_last_is_never_removed_by_its_own_commit(
    tmp_path: Path, ckptctl: Runner
) -> None:
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job, keep_last=1) as cp:
        cp.save(state(20), 20)
        assert cp.wait() is not None
        cp.save(state(15), 15)
        assert cp.wait() is not None, "the save of step 15 did not report committed"
    assert step_dirs(job) == [15]
    assert loads(job, 15), "step 15 was reported committed and is gone"
    with ckpt.Checkpointer(job, keep_last=1) as cp:
        assert cp.resume({"w": torch.zeros(64)}) == 15
    assert listed(ckptctl, job) == {15: (20, "head")}

    plain = str(tmp_path / "plain")
    with ckpt.Checkpointer(plain) as cp:
        cp.save(state(20), 20, blocking=True)
        cp.save(state(15), 15, blocking=True)
    assert ckpt.apply_retention(open_storage(plain), 1) == [20]
    assert step_dirs(plain) == [15]


def test_a_fresh_checkpointer_continues_the_line_and_old_manifests_keep_step_order(
    tmp_path: Path,
) -> None:
    # One-shot saves (a new Checkpointer each) descend from the job's head.
    job = str(tmp_path / "job")
    for step in (1, 2, 3):
        ckpt.save(state(step), job, step=step)
    st = open_storage(job)
    assert [ckfmt.read_manifest(st, s).parent for s in (1, 2, 3)] == [None, 1, 2]
    # Manifests without lineage (format v1 before it): the line is step order, as before.
    legacy = [retention.StepState(s, retention.COMMITTED, 100.0 - s) for s in (1, 2, 3)]
    assert ckfmt.live_line(legacy) == [3, 2, 1]
    assert retention.plan(legacy, 1).retire == (1, 2)


def test_the_plan_follows_the_line_and_spares_the_save_it_runs_for() -> None:
    def s(step: int, parent: int | None, t: float) -> retention.StepState:
        return retention.StepState(step, retention.COMMITTED, t, parent)

    steps = [s(10, None, 1), s(20, 10, 2), s(12, 10, 3), s(14, 12, 4), s(16, 14, 5)]
    assert ckfmt.live_line(steps) == [16, 14, 12, 10]
    assert retention.plan(steps, 2).retire == (10, 12)
    assert retention.plan(steps, 1, keep=(14,)).retire == (10, 12)


def test_gc_follows_the_live_line_and_removes_an_abandoned_branch_on_request(
    tmp_path: Path, ckptctl: Runner
) -> None:
    """`ckptctl gc --keep-last` is retention's rule (the live line), not step order, and
    `--abandoned` removes the branch a rollback left."""
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job) as cp:  # no keep_last: everything stays
        for step in (10, 20):
            cp.save(state(step), step, blocking=True)
        cp.load({"w": torch.zeros(64)}, step=10)
        for step in (12, 14, 16):
            cp.save(state(step), step, blocking=True)
        # The coordinator's "newest" is the live line's head too, not the highest step.
        assert cp.client.get_checkpoint(cp.path).step == 16
    # By step order the newest two would be 16 and 20: gc would have retired 14, the line's.
    rc, out, err = ckptctl("gc", job, "--keep-last", "2", "--json")
    assert rc == 0, err
    assert json.loads(out)["removed"] == [10, 12]
    assert step_dirs(job) == [14, 16, 20]
    assert listed(ckptctl, job)[20][1] == "abandoned"
    rc, out, err = ckptctl("gc", job, "--abandoned", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["removed"] == [20] and "abandoned" in doc["steps"][0]["reason"]
    assert step_dirs(job) == [14, 16]
    assert loads(job, 16) and ckpt.load({}, job).step == 16
