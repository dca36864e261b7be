"""The shortest form: ckpt.init (or CKPT_PATH), then ckpt.save / resume / wait with no
other argument; and the path form, ckpt.save(state, path, step=...), as before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckpt
from ckpt import _default

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("CKPT_PATH", raising=False)
    yield
    cp = _default.current()
    if cp is not None:
        cp.close()
    _default._default = None


def make_state(step: int | None) -> dict[str, Any]:
    st: dict[str, Any] = {"w": torch.arange(12.0).reshape(3, 4) * (step or 1)}
    if step is not None:
        st["step"] = step
    return st


def test_init_save_wait_resume(tmp_path: Path) -> None:
    cp = ckpt.init(tmp_path / "job", keep_last=2)
    assert isinstance(cp, ckpt.Checkpointer) and cp.keep_last == 2
    pending = ckpt.save(make_state(5))
    assert isinstance(pending, ckpt.PendingSave) and pending.step == 5
    result = ckpt.wait()
    assert isinstance(result, ckpt.SaveResult) and result.step == 5
    st = {"w": torch.zeros(3, 4), "step": 0}
    assert ckpt.resume(st) == 5
    assert st["step"] == 5 and torch.equal(st["w"], make_state(5)["w"])


def test_steps_come_from_the_state_or_are_counted(tmp_path: Path) -> None:
    ckpt.init(tmp_path / "job")
    assert ckpt.save(make_state(None)).step == 1
    assert ckpt.save(make_state(None)).step == 2
    assert ckpt.save({"w": torch.ones(2), "step": np.int64(10)}).step == 10  # numpy ints too
    assert ckpt.save({"w": torch.ones(2), "step": torch.tensor(11)}).step == 11  # 0-d tensors
    assert ckpt.save(make_state(None), step=20).step == 20
    ckpt.wait()
    # A new process (a new default) counts on from the newest committed step.
    ckpt.init(tmp_path / "job")
    assert ckpt.save(make_state(None)).step == 21
    ckpt.wait()
    with pytest.raises(ckpt.CkptError, match="not an integer"):
        ckpt.save({"w": torch.ones(2), "step": "ten"})


def test_ckpt_path_in_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_PATH", str(tmp_path / "envjob"))
    st = make_state(3)
    assert ckpt.resume(st) is None  # created on first use from CKPT_PATH
    ckpt.save(st)
    assert ckpt.wait() is not None
    cp = _default.current()
    assert cp is not None and cp.path == str((tmp_path / "envjob").resolve())
    assert (tmp_path / "envjob" / "step-000000000003" / "MANIFEST.json").exists()


def test_no_default_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ckpt.CkptError, match=r"ckpt\.init\(path\)"):
        ckpt.save(make_state(1))
    with pytest.raises(ckpt.CkptError, match="CKPT_PATH"):
        ckpt.init()
    assert ckpt.wait() is None  # nothing in flight, nothing to say
    ckpt.init(tmp_path / "job").close()
    with pytest.raises(ckpt.CkptError, match="was closed"):
        ckpt.resume(make_state(1))


def test_init_again_closes_the_previous_default(tmp_path: Path) -> None:
    first = ckpt.init(tmp_path / "a")
    ckpt.save(make_state(1))
    second = ckpt.init(tmp_path / "b")
    assert first._closed and not second._closed
    assert (tmp_path / "a" / "step-000000000001" / "MANIFEST.json").exists()  # flushed


def test_the_path_form_is_unchanged(tmp_path: Path) -> None:
    job = tmp_path / "job"
    res = ckpt.save(make_state(3), job, step=3)
    assert isinstance(res, ckpt.SaveResult) and res.step == 3  # blocking, committed
    with pytest.raises(TypeError, match="step="):
        ckpt.save(make_state(4), job)  # the path form needs its step, as it always did
    ckpt.save(make_state(4), job, step=4)
    with pytest.raises(TypeError, match=r"keep_last to ckpt\.init"):
        ckpt.save(make_state(1), keep_last=2)
    got: dict[str, Any] = {}
    assert ckpt.load(got, job).step == 4 and _default.current() is None
