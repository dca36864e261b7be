"""The Hugging Face Trainer's time per saved step: CkptdTrainer against the Trainer's own
save_steps checkpointing, and against no checkpointing, in one run.

Each repetition trains a GPT-2 built from a config (CPU, no download) for --steps steps
three ways, interleaved (the order rotates each repetition; one untimed warm-up run first): no saves; the Trainer's own
checkpoint-N every --save-steps (safetensors model + torch.save'd optimizer, scheduler,
RNG, JSON state); CkptdTrainer every --save-steps (the same state through a Checkpointer:
async, verify="full", no checkpoint-N). Reported per way, median and min-max over the
repetitions:

  stall per save   what the training loop waits at a saving step: the median gap between
                   a saving step's end and the next step's begin, minus the median gap
                   of non-saving steps
  cost per save    (train() wall time - the no-save run's) / saves: everything a save
                   costs the run, CkptdTrainer's wait for the last commit included

    .venv/bin/python bench/hf_trainer.py [--layers 4] [--hidden 256] [--steps 24]
        [--save-steps 4] [--reps 3] [--dir bench/results/tmp-data]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import _common as C
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from ckpt.integrations.hf_trainer import CkptdTrainer

WAYS = ("no saves", "Trainer save_steps", "CkptdTrainer")


class Gaps(TrainerCallback):
    """perf_counter gaps between a step's end and the next step's begin, by step."""

    def __init__(self) -> None:
        self.ended: dict[int, float] = {}
        self.gaps: dict[int, float] = {}

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN201
        prev = state.global_step
        if prev in self.ended:
            self.gaps[prev] = time.perf_counter() - self.ended[prev]

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
        self.ended[state.global_step] = time.perf_counter()


def build(a: argparse.Namespace) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.hidden, n_head=4, vocab_size=8192, n_positions=64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (a.steps * 2, 32), generator=g)
    return cfg, [{"input_ids": x, "labels": x.clone()} for x in ids]


def train(way: str, a: argparse.Namespace, cfg: Any, data: list, work: Path) -> dict[str, Any]:
    out = work / way.replace(" ", "_")
    shutil.rmtree(out, ignore_errors=True)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=a.steps,
        save_steps=a.save_steps,
        save_strategy="no" if way == "no saves" else "steps",
        per_device_train_batch_size=2,
        learning_rate=1e-4,
        logging_steps=10**6,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    gaps = Gaps()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    kw: dict[str, Any] = {"model": model, "args": args, "train_dataset": data, "callbacks": [gaps]}
    trainer = (
        CkptdTrainer(**kw, ckptd_path=str(out / "ckptd"))
        if way == "CkptdTrainer"
        else Trainer(**kw)
    )
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    wall = time.perf_counter() - t0
    saving = {s for s in gaps.gaps if way != "no saves" and s % a.save_steps == 0}
    plain = [g for s, g in gaps.gaps.items() if s not in saving]
    stall = (
        statistics.median([gaps.gaps[s] for s in saving]) - statistics.median(plain)
        if saving
        else 0.0
    )
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shutil.rmtree(out, ignore_errors=True)
    return {"wall": wall, "stall": stall, "saves": a.steps // a.save_steps, "model_bytes": nbytes}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-data")
    a = p.parse_args()
    hf_logging.set_verbosity_error()
    logging.getLogger("ckpt").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    load = C.loadavg_at_start()
    work = a.dir / f"hf_trainer-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    cfg, data = build(a)
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    try:
        train("no saves", a, cfg, data, work)  # warm-up, untimed: first-use initialisation
        for rep in range(a.reps):
            k = rep % len(WAYS)
            for way in WAYS[k:] + WAYS[:k]:
                r = train(way, a, cfg, data, work)
                runs[way].append(r)
                print(f"rep {rep + 1}/{a.reps}  {way:<20} train {r['wall']:7.2f} s  "
                      f"stall/save {r['stall'] * 1e3:8.1f} ms", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = [r["wall"] for r in runs["no saves"]]
    saves = a.steps // a.save_steps
    state_bytes = runs["no saves"][0]["model_bytes"] * 3  # weights + Adam's two moments
    print(
        f"\nGPT-2 {a.layers} layers, hidden {a.hidden}: {state_bytes / C.GB:.3f} GB of model + "
        f"optimizer state; {a.steps} steps, a save every {a.save_steps} ({saves} saves); "
        f"{a.reps} reps, interleaved; load average at start {load[0]:.1f}"
    )
    print(f"{'way':<20} {'train s (med, min-max)':>26} {'stall/save ms':>22} {'cost/save ms':>22}")
    result: dict[str, Any] = {}
    for way in WAYS:
        walls = [r["wall"] for r in runs[way]]
        stalls = [r["stall"] * 1e3 for r in runs[way]]
        costs = [(w - b) / saves * 1e3 for w, b in zip(walls, base, strict=True)]
        result[way] = {"train_s": walls, "stall_ms": stalls, "cost_ms": costs}

        def cell(xs: list[float], nd: int = 1) -> str:
            return f"{statistics.median(xs):.{nd}f} ({min(xs):.{nd}f}-{max(xs):.{nd}f})"

        stall_cell = cell(stalls) if way != "no saves" else "-"
        cost_cell = cell(costs) if way != "no saves" else "-"
        print(f"{way:<20} {cell(walls, 2):>26} {stall_cell:>22} {cost_cell:>22}")
    path = C.write_results(
        "hf_trainer",
        {"bench": "hf_trainer", "args": {k: str(v) for k, v in vars(a).items()},
         "machine": C.machine_info(a.dir), "load_at_start": load, "runs": result},
    )  # fmt: skip
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
