"""The accelerate pattern (ckpt.integrations.hf) with a real Accelerator on CPU.

Skipped when accelerate is not installed (pip install ckptd[integrations]).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import ckptctl

accelerate = pytest.importorskip("accelerate")
from ckpt.integrations.hf import load_state, save_state  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class Counter:
    """An object registered for checkpointing (accelerator.register_for_checkpointing)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def prepared(seed: int):  # noqa: ANN201
    torch.manual_seed(seed)
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, counter


def train(acc, model, opt, sched, steps: int) -> None:  # noqa: ANN001
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).square().mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()


def test_save_and_resume_an_accelerator_through_ckptd(tmp_path: Path) -> None:
    job = tmp_path / "run"
    acc, model, opt, sched, counter = prepared(0)
    assert load_state(acc, job) is None  # a new run: nothing to resume
    train(acc, model, opt, sched, 3)
    counter.n = 3
    extra = {"epoch": 1}
    res = save_state(acc, job, step=3, extra=extra, metadata={"by": "accelerate"})
    assert res.step == 3
    after_save = torch.rand(3)  # what an uninterrupted run draws next
    rc, out, err = ckptctl("verify", str(job))
    assert rc == 0 and "OK" in out, out + err
    files = sorted(p.suffix for p in (job / "step-000000000003").rglob("*") if p.is_file())
    assert set(files) == {".json", ".bin"}  # no optimizer.bin / random_states.pkl

    acc2, model2, opt2, sched2, counter2 = prepared(1)
    got_extra: dict = {}
    assert load_state(acc2, job, extra=got_extra) == 3
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert all(
        torch.equal(s1["state"][k]["exp_avg"], s2["state"][k]["exp_avg"]) for k in s1["state"]
    )
    assert sched2.scheduler.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()
    assert counter2.n == 3 and got_extra == {"epoch": 1}
    assert torch.equal(torch.rand(3), after_save)  # RNG restored
    m = json.loads((job / "step-000000000003" / "MANIFEST.json").read_text())
    assert m["metadata"] == {"by": "accelerate"}


def test_load_state_before_prepare_is_refused_not_a_silent_fresh_start(
    tmp_path: Path, tally
) -> None:
    acc, *_ = prepared(0)
    save_state(acc, tmp_path / "job", step=4)
    tally.bad_input("hf.load_state on an Accelerator with nothing prepared")
    with pytest.raises(ValueError, match=r"after accelerator\.prepare"):
        load_state(accelerate.Accelerator(cpu=True), tmp_path / "job")
