"""Checkpointer.resume: the newest whole checkpoint, a reason for every step passed over,
None only for a job that never committed anything, and an error (never a silent fresh
start) when checkpoints exist but none loads."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage

pytestmark = pytest.mark.timeout(120)


def state_at(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "step": step,
    }


def fresh() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": -1}


def save_steps(job: Path, *steps: int) -> None:
    with ckpt.Checkpointer(job) as cp:
        for s in steps:
            cp.save(state_at(s), s).wait()


def flip_a_byte(job: Path, step: int) -> None:
    shards = job / f"step-{step:012d}" / "shards"
    shard = next(p for p in shards.iterdir() if p.suffix == ".bin")
    with open(shard, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))


def messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def resume_logged(
    job: Path, caplog: pytest.LogCaptureFixture
) -> tuple[int | None, dict[str, Any], str]:
    """A fresh state resumed from `job`, ckpt's log captured: (the step, the state, the log)."""
    caplog.clear()
    st = fresh()
    with caplog.at_level(logging.INFO, logger="ckpt"):
        with ckpt.Checkpointer(job) as cp:
            step = cp.resume(st)
    return step, st, messages(caplog)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a["model"][k], b["model"][k]) for k in ("w", "b")
    )


def test_a_new_job_resumes_to_none_and_leaves_the_state_alone(tmp_path: Path) -> None:
    st = fresh()
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        assert cp.resume(st) is None
    assert st["step"] == -1 and not st["model"]["w"].any()


def test_picks_the_newest_whole_step_among_broken_ones_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = tmp_path / "job"
    save_steps(job, 100, 200, 300)
    os.remove(job / "step-000000000200" / "MANIFEST.json")  # a save that never committed
    flip_a_byte(job, 300)  # silent corruption in a committed step
    (job / "notes").mkdir()  # a stray directory
    (job / "step-000000000300-old").mkdir()  # not a step directory either
    tmp_manifest = job / "step-000000000400"  # a coordinator that died writing a manifest
    (tmp_manifest / "shards").mkdir(parents=True)
    (tmp_manifest / "MANIFEST.json.tmp.1234.5678").write_text('{"format": 1, "job": ')

    step, st, log = resume_logged(job, caplog)
    assert step == 100 and same(st, state_at(100))
    assert "skipping step 400: incomplete: no MANIFEST.json" in log
    assert "skipping step 200: incomplete: no MANIFEST.json" in log
    assert "STEP 300" in log and "FAILED VERIFICATION" in log and "key 'model/w'" in log
    assert "resumed from step 100 (step 300 failed verification" in log
    assert "notes" not in log and "300-old" not in log
    # The damaged step is marked, so the next resume passes over it at once, saying why.
    assert (job / "step-000000000300" / ckfmt.QUARANTINE_NAME).exists()
    step, _, log = resume_logged(job, caplog)
    assert step == 100 and "skipping step 300: quarantined: " in log
    assert (job / "notes").is_dir()  # nothing outside the steps was touched


def test_a_step_older_than_the_one_loaded_is_not_reported_as_passed_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Retention un-publishes a step (manifest first) before it removes the files: a resume
    in that moment must not warn that an old step "never committed"; it never came to it.
    Only the newer step it did pass over is logged."""
    job = tmp_path / "job"
    save_steps(job, 100, 200, 300)
    os.remove(job / "step-000000000100" / "MANIFEST.json")  # retention half-way through
    os.remove(job / "step-000000000300" / "MANIFEST.json")  # an interrupted save
    step, st, log = resume_logged(job, caplog)
    assert step == 200 and same(st, state_at(200))
    assert "skipping step 300: incomplete: no MANIFEST.json" in log
    assert "or a step that retention is removing" in log
    assert "step 100" not in log, log


def test_only_unfinished_saves_is_a_new_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = tmp_path / "job"
    save_steps(job, 10)
    os.remove(job / "step-000000000010" / "MANIFEST.json")
    step, _, log = resume_logged(job, caplog)
    assert step is None
    assert "skipping step 10: incomplete" in log and "nothing was ever committed" in log


def test_only_broken_checkpoints_raise_unless_a_fresh_start_is_allowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = tmp_path / "job"
    save_steps(job, 100, 200)
    flip_a_byte(job, 100)
    (job / "step-000000000200" / "MANIFEST.json").write_text('{"not": "a manifest"}')
    st = fresh()
    with ckpt.Checkpointer(job) as cp:
        with pytest.raises(ckpt.CheckpointNotFound) as exc:
            cp.resume(st)
        msg = str(exc.value)
        assert "none can be loaded whole" in msg and "allow_fresh_start=True" in msg
        assert "step 200: invalid" in msg and "step 100" in msg
        assert isinstance(exc.value.__cause__, ckpt.CkptError)
        with caplog.at_level(logging.ERROR, logger="ckpt"):
            assert cp.resume(fresh(), allow_fresh_start=True) is None
        assert "starting fresh as allowed" in messages(caplog)


def test_a_state_that_does_not_match_raises_instead_of_falling_back(tmp_path: Path) -> None:
    job = tmp_path / "job"
    save_steps(job, 1, 2)
    wrong = {"model": {"w": torch.zeros(3, 3), "b": torch.zeros(32)}, "step": 0}
    with ckpt.Checkpointer(job) as cp:
        with pytest.raises(ckpt.StateMismatch):
            cp.resume(wrong)
    assert ckfmt.latest_step(open_storage(str(job))) == 2  # nothing quarantined


def test_a_step_with_a_missing_shard_is_passed_over(tmp_path: Path) -> None:
    job = tmp_path / "job"
    save_steps(job, 1, 2)
    shards = job / "step-000000000002" / "shards"
    for p in shards.iterdir():
        if p.suffix == ".bin":
            p.unlink()
    st = fresh()
    with ckpt.Checkpointer(job) as cp:
        assert cp.resume(st) == 1
    assert same(st, state_at(1))
    marker = json.loads((job / "step-000000000002" / ckfmt.QUARANTINE_NAME).read_text())
    assert "missing" in marker["reason"]
