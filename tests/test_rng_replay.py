"""The pattern for exact replay: random number generators and the data position in the state.

A loop draws from torch's global generator (dropout-like noise), numpy and Python's
`random` (augmentations), a private torch.Generator, and takes batches from a sampler
whose position (epoch, batches taken) is part of the state. Saved at step k with
ckpt.RNGState and the sampler, then resumed in a scrambled process state, the rest of the
run draws the same batches and ends bit-identical to a run that never stopped.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckpt

pytestmark = pytest.mark.timeout(120)


class Sampler:
    """Shuffled indices, a new permutation per epoch; its state is its position."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch, self.seed = n, batch, seed
        self.epoch, self.taken = 0, 0

    def next(self) -> list[int]:
        order = torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        if (self.taken + 1) * self.batch > self.n:
            self.epoch, self.taken = self.epoch + 1, 0
            return self.next()
        out = order[self.taken * self.batch : (self.taken + 1) * self.batch].tolist()
        self.taken += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "taken": self.taken}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.taken = sd["epoch"], sd["taken"]


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def globals_now() -> tuple[torch.Tensor, np.ndarray, Any]:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def new_run(seed: int) -> dict[str, Any]:
    seed_all(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        "w": torch.zeros(8),
        "sampler": Sampler(n=10, batch=3, seed=seed),
        "gen": gen,
        "rng": ckpt.RNGState(gen),  # torch, numpy, python, and the private generator
        "step": 0,
    }


def step_once(run: dict[str, Any], data: torch.Tensor) -> list[int]:
    idx = run["sampler"].next()
    noise = torch.randn(8) * 0.01  # torch's global generator
    jitter = float(np.random.uniform(-1, 1))  # numpy
    flip = random.random() < 0.5  # python
    extra = torch.rand(8, generator=run["gen"])  # a private generator
    batch = data[idx].sum(0) * (-1 if flip else 1)
    run["w"] = run["w"] * 0.9 + batch + noise + jitter + extra
    run["step"] += 1
    return idx


def saved(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run[k] for k in ("w", "sampler", "rng", "step")}


def test_a_resumed_run_draws_the_same_batches_and_ends_bit_identical(tmp_path: Path) -> None:
    data = torch.randn(10, 8, generator=torch.Generator().manual_seed(99))
    total, at = 17, 7

    reference = new_run(0)
    ref_batches = [step_once(reference, data) for _ in range(total)]
    ref_globals = globals_now()

    run = new_run(0)
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        for _ in range(at):
            step_once(run, data)
        cp.save(saved(run), run["step"]).wait()
        for _ in range(3):  # the steps that are lost when the job dies
            step_once(run, data)

    resumed = new_run(0)  # a new process: built from the same config...
    seed_all(777)  # ...whose generators are anywhere
    resumed["gen"].manual_seed(4242)
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        state = saved(resumed)
        assert cp.resume(state) == at
        resumed["w"], resumed["step"] = state["w"], state["step"]
    assert resumed["sampler"].state_dict() == {"epoch": 2, "taken": 1}
    batches = [step_once(resumed, data) for _ in range(total - at)]
    assert batches == ref_batches[at:]
    assert torch.equal(resumed["w"], reference["w"])
    assert torch.equal(resumed["gen"].get_state(), reference["gen"].get_state())
    now = globals_now()
    assert torch.equal(now[0], ref_globals[0]) and (now[1] == ref_globals[1]).all()
    assert now[2] == ref_globals[2]


def test_rng_state_per_rank_round_trip(tmp_path: Path) -> None:
    seed_all(5)
    before = globals_now()
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        cp.save({"rng": ckpt.PerRank(ckpt.RNGState())}, 1).wait()
        torch.rand(3), np.random.rand(3), random.random()  # move them all on
        assert cp.resume({"rng": ckpt.PerRank(ckpt.RNGState())}) == 1
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all()
    assert random.getstate() == before[2]


def test_a_different_number_of_generators_is_refused(tmp_path: Path) -> None:
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        cp.save({"rng": ckpt.RNGState(torch.Generator())}, 1).wait()
        with pytest.raises(ValueError, match="1 torch.Generator states"):
            cp.load({"rng": ckpt.RNGState()}, 1, strict=False)
