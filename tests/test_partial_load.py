"""Partial and lenient loads (keys=, strict=False, cast=) and the fallback/quarantine policy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ckpt_testutil import assert_same, entry, flip_bit, shard_path, tensor_raw

import ckpt
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "extra": {"a": torch.randn(5), "b": 7}, "epoch": seed}


def params(m: torch.nn.Module) -> list[bytes]:
    return [tensor_raw(p) for p in m.parameters()]


def test_keys_load_only_what_matches(job):
    saved = model_state(1)
    ckpt.save(saved, job, step=1)
    target = model_state(2)
    before_optim = target["optim"].state_dict()["state"][0]["momentum_buffer"].clone()
    before_a = target["extra"]["a"].clone()
    res = ckpt.load(target, job, keys="model")
    assert params(target["model"]) == params(saved["model"])
    assert torch.equal(target["optim"].state_dict()["state"][0]["momentum_buffer"], before_optim)
    assert torch.equal(target["extra"]["a"], before_a) and target["epoch"] == 2
    assert res.tensors == 4

    ckpt.load(target, job, keys=["extra/a", "epoch"])
    assert torch.equal(target["extra"]["a"], saved["extra"]["a"])
    assert target["epoch"] == 1 and target["extra"]["b"] == 7

    ckpt.load(target, job, keys="optim/state/*/momentum_buffer")
    got = target["optim"].state_dict()["state"]
    want = saved["optim"].state_dict()["state"]
    assert all(torch.equal(got[i]["momentum_buffer"], want[i]["momentum_buffer"]) for i in want)


def test_keys_pattern_that_matches_nothing_is_an_error(job):
    ckpt.save(model_state(1), job, step=1)
    target = model_state(2)
    with pytest.raises(ckpt.StateMismatch, match="'modle/\\*' matches nothing"):
        ckpt.load(target, job, keys="modle/*")
    ckpt.load(target, job, keys="modle/*", strict=False)  # lenient: nothing to do


def test_strict_false_reports_missing_and_unexpected(job):
    ckpt.save({"w": torch.ones(3), "old": torch.zeros(2), "n": 1}, job, step=1)
    target = {"w": torch.zeros(3), "new": torch.full((2,), 5.0), "n": 0}
    with pytest.raises(ckpt.StateMismatch, match="new"):
        ckpt.load(target, job)
    res = ckpt.load(target, job, strict=False)
    assert res.missing_keys == ["new"] and res.unexpected_keys == ["old"]
    assert torch.equal(target["w"], torch.ones(3)) and target["n"] == 1
    assert "old" not in target and torch.equal(target["new"], torch.full((2,), 5.0))
    # An empty dict takes everything, strict or not.
    assert_same(ckpt.load({}, job, strict=False).state, ckpt.load({}, job).state)


def test_strict_false_into_a_module_with_a_new_head(job):
    ckpt.save({"model": torch.nn.Linear(4, 3)}, job, step=1)
    saved = torch.nn.Linear(4, 3)
    ckpt.load({"model": saved}, job)
    grown = torch.nn.Module()
    grown.weight = torch.nn.Parameter(torch.zeros(3, 4))
    grown.head = torch.nn.Linear(3, 1)
    res = ckpt.load({"model": grown}, job, strict=False)
    assert res.unexpected_keys == ["model/bias"]
    assert res.missing_keys == ["model/head.weight", "model/head.bias"]
    assert torch.equal(grown.weight, saved.weight)


def test_cast_is_explicit(job):
    w = torch.randn(4, 5, dtype=torch.float32)
    ckpt.save({"w": w}, job, step=1)
    target = {"w": torch.zeros(4, 5, dtype=torch.bfloat16)}
    with pytest.raises(ckpt.StateMismatch, match="cast=True"):
        ckpt.load(target, job)
    assert not target["w"].any()
    ckpt.load(target, job, cast=True)
    assert torch.equal(target["w"], w.to(torch.bfloat16))


def test_load_into_non_contiguous_and_shared_targets(job):
    w = torch.arange(12.0).reshape(3, 4)
    ckpt.save({"w": w, "v": w}, job, step=1)
    base = torch.zeros(4, 3)
    target = {"w": base.t(), "v": None}
    ckpt.load(target, job)
    assert torch.equal(base.t(), w) and torch.equal(target["v"], w)


def corrupt(job: str, step: int, key: str = "w") -> None:
    e = entry(job, step, key)
    flip_bit(shard_path(job, step), e["offset"] + 1)


def test_fallback_skips_every_bad_step_and_quarantines_them(job, ckptctl, caplog):
    for s in (1, 2, 3):
        ckpt.save({"w": torch.full((64,), float(s))}, job, step=s)
    corrupt(job, 3)
    corrupt(job, 2)
    with pytest.raises(ckpt.HashMismatch):
        ckpt.load({}, job, fallback=False)
    res = ckpt.load({}, job)
    assert res.step == 1 and res.fell_back_from == 3 and res.quarantined == [3, 2]
    shard = os.path.basename(shard_path(job, 3))  # rank 0's shard of step 3
    assert shard in res.fallback_reason and "'w'" in res.fallback_reason
    assert torch.equal(res.state["w"], torch.full((64,), 1.0))
    assert "FAILED VERIFICATION AND IS QUARANTINED" in caplog.text
    storage = open_storage(job)
    assert ckfmt.latest_step(storage) == 1
    statuses = {s.step: s.status for s in ckfmt.list_steps(storage)}
    assert statuses == {1: "COMMITTED", 2: "QUARANTINED", 3: "QUARANTINED"}
    marker = json.loads(Path(job, "step-000000000003", "QUARANTINED.json").read_text())
    assert marker["step"] == 3 and "'w'" in marker["reason"]
    # Later loads go straight to step 1, quietly.
    assert ckpt.load({}, job).fell_back_from is None
    # ckptctl shows it; an explicit step still reaches it (and fails: it is corrupt).
    rc, out, _ = ckptctl("list", job)
    assert rc == 0 and out.count("QUARANTINED") == 2
    with pytest.raises(ckpt.HashMismatch):
        ckpt.load({}, job, step=3)
    # gc keeps quarantined steps unless asked.
    rc, out, _ = ckptctl("gc", job)
    assert os.path.exists(os.path.join(job, "step-000000000003", "QUARANTINED.json"))
    rc, out, _ = ckptctl("gc", job, "--quarantined")
    assert rc == 0 and not os.path.exists(os.path.join(job, "step-000000000003"))
    assert [s.step for s in ckfmt.list_steps(storage)] == [1]


def test_unquarantine_puts_a_step_back(job):
    for s in (1, 2):
        ckpt.save({"w": torch.full((8,), float(s))}, job, step=s)
    storage = open_storage(job)
    ckfmt.quarantine(storage, 2, "suspected bad disk")
    assert ckpt.load({}, job).step == 1
    assert ckfmt.unquarantine(storage, 2)
    assert ckpt.load({}, job).step == 2


def test_all_steps_bad_raises_the_first_error_type(job):
    ckpt.save({"w": torch.ones(8)}, job, step=1)
    os.unlink(shard_path(job, 1))
    with pytest.raises(ckpt.ShardMissing, match="no committed step could be loaded"):
        ckpt.load({}, job)
    with pytest.raises(ckpt.CheckpointNotFound, match="quarantined"):
        ckpt.load({}, job)


def test_unreadable_newest_falls_back_without_quarantine(job, monkeypatch):
    """An I/O error (EIO) may be transient: skip the step this time, do not quarantine it."""
    import errno

    from ckptd.errors import StorageError
    from ckptd.storage.base import ReadHandle
    from ckptd.storage.local import LocalStorage

    for s in (1, 2):
        ckpt.save({"w": torch.full((64,), float(s))}, job, step=s)

    class Failing(ReadHandle):
        def __init__(self, h):
            self.h, self.size, self.path = h, h.size, h.path

        def read(self, offset, length):
            raise StorageError(errno.EIO, f"read {self.path} at {offset} failed: EIO")

        def close(self):
            self.h.close()

    class EIOStorage(LocalStorage):
        def open_read(self, path, *, cold=False):
            h = super().open_read(path, cold=cold)
            return Failing(h) if path.startswith("step-000000000002/") else h

    monkeypatch.setattr(ckpt._api, "open_storage", lambda p, **kw: EIOStorage(str(p)))
    res = ckpt.load({}, job)
    assert res.step == 1 and res.fell_back_from == 2 and res.quarantined == []
    assert "EIO" in res.fallback_reason
    assert ckfmt.quarantine_reason(open_storage(job), 2) is None
    monkeypatch.undo()
    assert ckpt.load({}, job).step == 2  # readable again: loaded again


def test_keys_into_lists(job):
    ckpt.save({"layers": [torch.ones(2), torch.full((2,), 2.0), 5]}, job, step=1)
    target = {"layers": [torch.zeros(2), torch.zeros(2), 0]}
    ckpt.load(target, job, keys="layers/1")
    assert target["layers"][0].sum() == 0 and torch.equal(
        target["layers"][1], torch.full((2,), 2.0)
    )
    assert target["layers"][2] == 0
    with pytest.raises(ckpt.StateMismatch, match="list has 3 items"):
        ckpt.load({"layers": [torch.zeros(2)]}, job, keys="layers/*")
