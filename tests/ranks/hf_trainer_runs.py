"""Tiny Hugging Face Trainer runs (GPT-2 from a config, CPU, no download) for the
CkptdTrainer tests, in one process or as one rank of a torchrun job.

    python -m torch.distributed.run --standalone --nproc-per-node 2 hf_trainer_runs.py BASE OUT

Three runs of 8 steps with save_steps=4, the same seed and data: uninterrupted; stopped
after the save at step 4 and resumed by the Trainer from its own checkpoint-4 (the control);
stopped at step 4 and resumed from the ckptd job. OUT/rank<r>.json gets, per run, the final
parameters' and optimizer state's digests, the log history, the global step and the files
each run's output directory holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ckpt.integrations.hf_trainer import CkptdTrainer

STEPS, SAVE = 8, 4


class StopAt(TrainerCallback):
    """Stops training after step `step` (after its save): an interruption."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def dataset(n: int = 64, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 128, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    return GPT2LMHeadModel(cfg)  # dropout 0.1 everywhere: the RNG states matter


def arguments(out: str, **kw: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        save_steps=SAVE,
        save_strategy="steps",
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=2,
        lr_scheduler_type="linear",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **kw,
    )


def digest(tensors: Any) -> str:
    h = hashlib.blake2b()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(k.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def outcome(trainer: Trainer, out: str) -> dict[str, Any]:
    opt = trainer.optimizer.state_dict()["state"]
    flat = {f"{i}/{k}": v for i, s in opt.items() for k, v in s.items() if torch.is_tensor(v)}
    logs = [{k: v for k, v in e.items() if k not in ("train_runtime", "train_samples_per_second",
            "train_steps_per_second")} for e in trainer.state.log_history]  # fmt: skip
    return {
        "params": digest(dict(trainer.model.named_parameters())),
        "optimizer": digest(flat),
        "lr": trainer.lr_scheduler.get_last_lr(),
        "global_step": trainer.state.global_step,
        "log_history": logs,
        "files": sorted(os.listdir(out)) if os.path.isdir(out) else [],
    }


def runs(base: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    data = dataset()
    out = os.path.join(base, "straight")
    t = Trainer(model=model(), args=arguments(out), train_dataset=data)
    t.train()
    res["straight"] = outcome(t, out)

    out = os.path.join(base, "hf")
    Trainer(
        model=model(), args=arguments(out), train_dataset=data, callbacks=[StopAt(SAVE)]
    ).train()
    t = Trainer(model=model(), args=arguments(out), train_dataset=data)
    t.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE}"))
    res["hf_resume"] = outcome(t, out)

    out = os.path.join(base, "ckptd")
    job = os.path.join(base, "ckptd-job")
    first = CkptdTrainer(model=model(), args=arguments(out), train_dataset=data,
                         callbacks=[StopAt(SAVE)], ckptd_path=job)  # fmt: skip
    first.train(resume_from_checkpoint=True)  # nothing committed yet: a fresh start
    res["ckptd_first_files"] = sorted(os.listdir(out)) if os.path.isdir(out) else []
    t = CkptdTrainer(model=model(), args=arguments(out), train_dataset=data, ckptd_path=job)
    t.train(resume_from_checkpoint=True)
    res["ckptd_resume"] = outcome(t, out)
    return res


def main(base: str, out_dir: str) -> int:
    rank = int(os.environ.get("RANK", "0"))
    res = runs(base)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
