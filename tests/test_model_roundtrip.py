"""A real training state survives a process boundary bit for bit.

A tiny model with AdamW, an LR scheduler and the torch/numpy/python RNG states is trained
a few steps and saved. A fresh Python process (this file run as a script) rebuilds the
model, optimizer and scheduler from a different seed, loads the checkpoint into them, and
reports a fingerprint of everything it restored plus the losses of the next three steps;
they must equal, bit for bit, what the original process computes by just continuing.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any

import blake3
import numpy as np
import torch
from torch import nn

import ckpt

STEPS_BEFORE = 4
STEPS_AFTER = 3


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> float:
    """One step that draws from all three RNGs, so a wrong RNG state changes the loss."""
    model.train()
    x = torch.randn(6, 8)
    shift = float(np.random.standard_normal())
    scale = random.random()
    y = torch.randn(6, 4) * scale + shift
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


def fingerprint(obj: Any) -> Any:
    """A JSON-able, bit-exact description: tensors by dtype, shape and blake3 of bytes."""
    if isinstance(obj, torch.Tensor):
        t = torch.empty((obj.numel(),), dtype=obj.dtype).copy_(obj.detach().reshape(-1))
        return {
            "tensor": str(obj.dtype),
            "shape": list(obj.shape),
            "b3": blake3.blake3(t.view(torch.uint8).numpy().tobytes()).hexdigest(),
        }
    if isinstance(obj, np.ndarray):
        return {
            "ndarray": str(obj.dtype),
            "shape": list(obj.shape),
            "b3": blake3.blake3(obj.tobytes()).hexdigest(),
        }
    if isinstance(obj, float):
        return {"float": obj.hex()}
    if isinstance(obj, dict):
        return {"dict": [[repr(k), fingerprint(v)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [fingerprint(v) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return {"repr": repr(obj)}


def full_fingerprint(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> Any:
    return {
        "model": fingerprint(model.state_dict()),
        "optim": fingerprint(opt.state_dict()),
        "sched": fingerprint(sched.state_dict()),
        "rng": fingerprint(rng_state()),
    }


def resume_in_this_process(path: str) -> dict[str, Any]:
    """What the fresh process does: rebuild, load, fingerprint, train on."""
    torch.set_num_threads(1)
    model, opt, sched = build(seed=12345)  # different init: load must overwrite it all
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "rng": {}, "step": 0}
    result = ckpt.load(state, path)
    assert state["model"] is model and state["optim"] is opt and state["sched"] is sched
    set_rng_state(state["rng"])
    fp = full_fingerprint(model, opt, sched)
    losses = [train_step(model, opt, sched).hex() for _ in range(STEPS_AFTER)]
    return {"step": result.step, "saved_step": state["step"], "fingerprint": fp, "losses": losses}


def test_model_optimizer_scheduler_rng_resume_bit_exact(job):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng_before = rng_state()
    try:
        model, opt, sched = build(seed=0)
        torch.manual_seed(1)
        np.random.seed(2)
        random.seed(3)
        for _ in range(STEPS_BEFORE):
            train_step(model, opt, sched)
        assert opt.state_dict()["state"], "the optimizer has state to save"
        state = {
            "model": model,
            "optim": opt,
            "sched": sched,
            "rng": rng_state(),
            "step": STEPS_BEFORE,
        }
        ckpt.save(state, job, step=STEPS_BEFORE)
        saved_fp = full_fingerprint(model, opt, sched)
        expected_losses = [train_step(model, opt, sched).hex() for _ in range(STEPS_AFTER)]
    finally:
        torch.set_num_threads(threads)
        set_rng_state(rng_before)

    proc = subprocess.run(
        [sys.executable, __file__, job],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["step"] == STEPS_BEFORE
    assert got["saved_step"] == STEPS_BEFORE
    for part in ("model", "optim", "sched", "rng"):
        assert got["fingerprint"][part] == saved_fp[part], f"{part} differs after load"
    assert got["losses"] == expected_losses


def test_load_into_modules_in_place(job):
    """The same in one process: parameters are filled where they live, no re-allocation."""
    model, opt, sched = build(seed=0)
    for _ in range(2):
        train_step(model, opt, sched)
    ckpt.save({"model": model, "optim": opt, "sched": sched}, job, step=2)
    model2, opt2, sched2 = build(seed=7)
    ptrs = [p.data_ptr() for p in model2.parameters()]
    ckpt.load({"model": model2, "optim": opt2, "sched": sched2}, job)
    assert [p.data_ptr() for p in model2.parameters()] == ptrs
    assert fingerprint(model2.state_dict()) == fingerprint(model.state_dict())
    assert fingerprint(opt2.state_dict()) == fingerprint(opt.state_dict())
    assert sched2.state_dict() == sched.state_dict()


if __name__ == "__main__":
    print(json.dumps(resume_in_this_process(sys.argv[1])))
