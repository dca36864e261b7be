"""A single-process walk-through: train, save, corrupt, verify, restore, continue.

Run it with `.venv/bin/python examples/corruption_walkthrough.py`. Checkpoints go to
./demo-ckpts/tiny-mlp (removed at the start). It shows the format's promises on one
process: silent corruption is found by `ckptctl verify` and refused by a load. The
multi-rank story (a rank killed mid-save, torchrun restart, resume) is examples/demo.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

import ckpt

ROOT = os.path.abspath("demo-ckpts")
JOB = os.path.join(ROOT, "tiny-mlp")


def say(msg: str) -> None:
    print(f"\n\033[1m== {msg}\033[0m" if sys.stdout.isatty() else f"\n== {msg}", flush=True)


def ckptctl(*args: str) -> int:
    cmd = [sys.executable, "-m", "ckptd.cli.ckptctl", *args]
    print("$ ckptctl " + " ".join(args), flush=True)
    return subprocess.run(cmd, check=False).returncode


def make_run(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 8),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "step": 0,
        "data_rng": torch.Generator().manual_seed(seed),
    }


def rng_state(run: dict) -> dict:
    return {
        "torch": torch.get_rng_state(),
        "data": run["data_rng"].get_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def train(run: dict, until: int) -> float:
    loss = torch.tensor(0.0)
    while run["step"] < until:
        x = torch.randn(32, 64, generator=run["data_rng"])
        y = torch.randint(0, 8, (32,), generator=run["data_rng"])
        loss = torch.nn.functional.cross_entropy(run["model"](x), y)
        run["optim"].zero_grad()
        loss.backward()
        run["optim"].step()
        run["sched"].step()
        run["step"] += 1
    return float(loss.detach())


def state_of(run: dict) -> dict:
    return {
        "model": run["model"],
        "optim": run["optim"],
        "sched": run["sched"],
        "step": run["step"],
        "rng": {"data": run["data_rng"].get_state()},
    }


def main() -> int:
    shutil.rmtree(JOB, ignore_errors=True)
    say("1. Train a small MLP with AdamW and save every 10 steps (blocking, verified)")
    run = make_run()
    for target in (10, 20, 30):
        loss = train(run, target)
        res = ckpt.save(state_of(run), JOB, step=target, metadata={"loss": loss}, keep_last=3)
        print(
            f"step {target}: loss {loss:.4f}; saved {res.bytes / 1e6:.2f} MB in {res.seconds * 1e3:.0f} ms -> {res.path}"
        )
    reference = {k: v.clone() for k, v in run["model"].state_dict().items()}
    ckptctl("list", JOB)

    say("2. Flip one bit in the newest checkpoint's shard (silent disk corruption)")
    # The manifest names each shard file (its name carries the save's generation:
    # docs/format.md), so it is read here rather than guessed.
    step30 = os.path.join(JOB, "step-000000000030")
    with open(os.path.join(step30, "MANIFEST.json")) as f:
        shard = os.path.join(step30, json.load(f)["shards"][0]["path"])
    with open(shard, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0x10]))
    print(f"flipped bit 4 of byte 12345 in {shard}")

    say("3. ckptctl verify finds it, naming the file and the tensor (exit code 1)")
    rc = ckptctl("verify", JOB, "--all")
    print(f"exit code {rc}")

    say("4. Loading the corrupt step fails loudly instead of returning garbage")
    fresh = make_run(seed=123)
    try:
        ckpt.load(state_of(fresh), JOB, step=30)
        print("UNEXPECTED: the corrupt checkpoint loaded")
        return 1
    except ckpt.CorruptCheckpoint as e:
        print(f"{type(e).__name__}: {e}")

    say("5. Load the newest step: step 30 is quarantined, the load falls back to step 20")
    t0 = time.perf_counter()
    st = state_of(fresh)
    info = ckpt.load(st, JOB)  # newest whole step; a step that fails verification is marked bad
    fresh["step"] = st["step"]
    fresh["data_rng"].set_state(st["rng"]["data"])
    print(
        f"loaded step {info.step} ({info.bytes / 1e6:.2f} MB, every block blake3-verified) in {(time.perf_counter() - t0) * 1e3:.0f} ms"
    )
    train(fresh, 30)
    same = all(torch.equal(reference[k], v) for k, v in fresh["model"].state_dict().items())
    print(
        f"parameters after resuming at 20 and training to 30 are {'bit-identical' if same else 'DIFFERENT'} to the original run's step 30"
    )

    say("6. Save step 30 again: the new save takes the quarantined copy's place; verify all")
    ckptctl("list", JOB)
    ckpt.save(state_of(fresh), JOB, step=30)
    rc2 = ckptctl("verify", JOB, "--all")
    ckptctl("inspect", JOB)

    ok = rc == 1 and info.step == 20 and same and rc2 == 0
    say("Summary")
    print(f"{'corruption detected by verify':<40} {'yes' if rc == 1 else 'NO'}")
    print(f"{'corrupt step refused by load':<40} yes")
    print(f"{'newest load fell back to step 20':<40} {'yes' if info.step == 20 else 'NO'}")
    print(f"{'resume from step 20 bit-identical':<40} {'yes' if same else 'NO'}")
    print(f"{'all steps verify after repair':<40} {'yes' if rc2 == 0 else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
