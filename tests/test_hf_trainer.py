"""The Hugging Face Trainer through ckptd (ckpt.integrations.hf_trainer.CkptdTrainer).

Real Trainers on CPU with a tiny GPT-2 built from a config (tests/ranks/hf_trainer_runs.py),
in one process and as 2 ranks under torchrun (DDP, gloo): 8 steps uninterrupted; stopped
after the save at step 4 and resumed by the Trainer from its own checkpoint-4 (the control);
stopped at step 4 and resumed from the ckptd job. The ckptd resume must end bit-identical
to the uninterrupted run and to the Trainer's own resume (parameters, optimizer state, LR,
global step, log history), without writing the Trainer's checkpoint-N directories, and the
job's steps are ordinary verified ckptd checkpoints holding the TrainerState as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from coordinator_fixtures import TESTS, child_env, ckptctl

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

RUNS = TESTS / "ranks" / "hf_trainer_runs.py"


def run(tmp_path: Path, ranks: int) -> list[dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "run.log"
    cmd = [sys.executable, str(RUNS), str(tmp_path), str(out)]
    if ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(ranks), "--max-restarts", "0"]  # fmt: skip
    env = child_env(TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=500,
                           cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, log.read_text(errors="replace")[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def check(tmp_path: Path, results: list[dict[str, Any]], ranks: int) -> None:
    for res in results:
        straight, control, ours = res["straight"], res["hf_resume"], res["ckptd_resume"]
        # the control: the Trainer's own resume reproduces the uninterrupted run
        assert control["params"] == straight["params"], "the Trainer's own resume diverged"
        for field in ("params", "optimizer", "lr", "global_step"):
            assert ours[field] == straight[field] == control[field], field
        assert ours["log_history"] == control["log_history"]
        assert [e.get("loss") for e in ours["log_history"]] == [
            e.get("loss") for e in straight["log_history"]
        ]
        # the state was saved once, through ckptd: no checkpoint-N written by the Trainer
        assert res["ckptd_first_files"] == [] and ours["files"] == []
        assert control["files"] == ["checkpoint-4", "checkpoint-8"]
    job = tmp_path / "ckptd-job"
    rc, out, err = ckptctl("verify", str(job), "--all", "--json")
    assert rc == 0, out + err
    assert sorted(s["step"] for s in json.loads(out)["steps"]) == [4, 8]
    m = json.loads((job / "step-000000000004" / "MANIFEST.json").read_text())
    assert m["world_size"] == ranks
    # 64 samples, 4 per step and rank: step 4 is a quarter of an epoch per rank
    assert m["metadata"]["transformers"] == {"global_step": 4, "epoch": 0.25 * ranks}
    top = dict(m["state"]["dict"])
    assert set(top) == {"model", "optimizer", "lr_scheduler", "trainer_state", "rng"}
    saved = json.loads(top["trainer_state"])  # a JSON string in the manifest, no pickle
    assert saved["global_step"] == 4 and len(saved["log_history"]) == 4
    assert saved["is_world_process_zero"] is True


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_trainer_resumes_bit_identical_from_ckptd_one_process(tmp_path: Path) -> None:
    check(tmp_path, run(tmp_path, 1), 1)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_trainer_resumes_bit_identical_from_ckptd_two_ranks_torchrun(tmp_path: Path) -> None:
    check(tmp_path, run(tmp_path, 2), 2)


def test_load_best_model_at_end_needs_the_trainers_own_checkpoints(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ckpt.integrations.hf_trainer import CkptdTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path), load_best_model_at_end=True, eval_strategy="steps",
        save_strategy="steps", use_cpu=True, report_to=[],
    )  # fmt: skip
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="ckptd_keep_hf_checkpoint=True"):
        CkptdTrainer(model=model, args=args, eval_dataset=[], ckptd_path=str(tmp_path / "job"))
