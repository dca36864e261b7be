"""The demo's story as a test: 2 ranks under torchrun, rank 1 killed (SIGKILL) in the middle
of a background save, torchrun restarts both, they resume from the last committed step,
train to the end, every checkpoint verifies, and the result equals an uninterrupted run
of the same seed bit for bit. It runs examples/demo.py's own story() with a smaller model,
so the demo's claims are the ones checked here.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
from coordinator_fixtures import REPO, read_catalog

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ckpt_demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_kill_a_rank_mid_save_restart_resume_and_match_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    demo = load_demo()
    cfg = demo.Config(
        tmp_path / "story", steps=24, save_every=4, crash_at=16, d_model=32, layers=2, lease_s=2
    )
    facts = demo.story(cfg, show=False)
    logs = "\n".join(p.read_text()[-4000:] for p in sorted((tmp_path / "story").glob("*.log")))
    assert facts["rc"] == 0, logs
    assert facts["killed"], logs  # rank 1 died of SIGKILL in attempt 0
    # The interrupted save never committed; the coordinator's next life aborted it, and
    # resume passed over it saying why, then resumed from the step before.
    assert facts["recovered_line"] and "step 16: ABORTED" in facts["recovered_line"], logs
    assert "skipping step 16: incomplete: no MANIFEST.json" in facts["skipped_line"], logs
    (last,) = facts["attempts"]  # rank 0 of the first attempt never got to write one
    assert last["attempt"] == 1 and last["generation"] == 1 and last["resumed_from"] == 12
    assert last["saves"] == [16, 20, 24]
    assert facts["verify_rc"] == 0 and facts["verify_out"].count(": OK") == 3
    assert facts["reference_rc"] == 0
    assert facts["same_loss"] and facts["identical"], facts["compare"]["differ"]
    assert facts["compare"]["model_tensors"] > 0 and facts["compare"]["chunks"] > 0
    catalog = read_catalog(tmp_path / "story" / "gpt" / ".ckptd" / "catalog.sqlite")
    assert catalog[24]["status"] == "COMMITTED" and catalog[24]["generation"] == 1
    assert catalog[16]["generation"] == 1  # saved again by the new attempt, committed


def test_a_corrupt_newest_step_is_passed_over_and_training_goes_on_bit_identically(
    tmp_path: Path,
) -> None:
    """The demo's training under torchrun (2 ranks) runs to its end; a copy of its
    checkpoints is kept, then a bit of rank 1's shard of the newest step flips. A second
    run's resume quarantines that step, falls back to the one before on both ranks, trains
    on and saves the same step number again (the quarantined copy gives way), and that
    step is bit-identical to the first run's."""
    demo = load_demo()
    cfg = demo.Config(tmp_path, steps=24, save_every=4, d_model=32, layers=2, lease_s=2)
    job, reference = tmp_path / "gpt", tmp_path / "reference"
    assert demo.torchrun(cfg, job, tmp_path / "first.log", crash=False, show=False)[0] == 0
    shutil.copytree(job, reference)
    shard = sorted((job / "step-000000000024" / "shards").glob("rank-00001*.bin"))[-1]
    with open(shard, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    rc, _ = demo.torchrun(cfg, job, tmp_path / "second.log", crash=False, show=False)
    log = (tmp_path / "second.log").read_text()
    assert rc == 0, log[-4000:]
    assert "FAILED VERIFICATION AND IS QUARANTINED" in log and "falling back to step 20" in log
    assert "takes the place of the quarantined checkpoint" in log, log[-4000:]
    last = demo.attempts(job)[-1]
    assert last["resumed_from"] == 20 and last["saves"] == [24], last
    assert demo.compare(job, reference, 24)["differ"] == []
    assert demo.ckptctl("verify", str(job), "--all")[0] == 0
