"""Async saves: the blocking part is the host copy; failures are never swallowed."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from ckpt_testutil import DelegatingStorage, DelegatingWriteHandle

import ckpt
from ckptd.errors import StorageError
from ckptd.storage.base import Piece, Storage, WriteHandle

pytestmark = pytest.mark.timeout(120)


def make_state(n: int = 8, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(n)},
        "bf16": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "step": 7,
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "bf16": state["bf16"].clone(),
        "step": state["step"],
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and torch.equal(a["bf16"], b["bf16"])
        and a["step"] == b["step"]
    )


class FailingWrites(DelegatingStorage):
    """Shard writes of the steps in `fail_steps` fail with EIO."""

    def __init__(self, inner: Storage, fail_steps: set[int]):
        super().__init__(inner)
        self.fail_steps = fail_steps

    def open_write(self, path: str, size: int, **kw: Any) -> WriteHandle:
        handle = super().open_write(path, size, **kw)
        failing = any(path.startswith(f"step-{s:012d}/") for s in self.fail_steps)

        class Handle(DelegatingWriteHandle):
            def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
                if failing:
                    raise StorageError(errno.EIO, f"injected EIO writing {path} at {offset}")
                super().write(offset, length, pieces)

        return Handle(handle)


def test_save_returns_after_staging_and_saves_the_state_at_the_call(tmp_path: Any) -> None:
    state = make_state()
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        before = snapshot(state)
        pending = cp.save(state, 1)
        # Training goes on at once and changes every tensor in place.
        for t in state["model"].values():
            t.mul_(-3.0).add_(1.0)
        state["bf16"].zero_()
        result = pending.wait()
        assert result is not None and result.step == 1
        assert pending.done() and not pending.failed
        assert pending.blocking_s > 0 and pending.persist_s > 0
        loaded: dict[str, Any] = {}
        cp.load(loaded, step=1)
    assert same(loaded, before)


def test_background_failure_surfaces_at_wait_then_next_save_is_clean(tmp_path: Any) -> None:
    state = make_state()
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        cp.save(state, 1).wait()
        cp.storage = FailingWrites(cp.storage, {2})
        pending = cp.save(state, 2)
        with pytest.raises(ckpt.CkptError, match="injected EIO"):
            pending.wait()
        assert pending.failed
        assert not os.path.exists(tmp_path / "job" / "step-000000000002" / "MANIFEST.json")
        cp.save(state, 3).wait()  # the error was seen at wait(): the next save is not blocked
        assert cp.latest_step() == 3


def test_unseen_failure_raises_at_the_next_save(tmp_path: Any) -> None:
    state = make_state()
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        cp.storage = FailingWrites(cp.storage, {1})
        cp.save(state, 1)  # nobody waits on it
        with pytest.raises(ckpt.CkptError, match="injected EIO"):
            cp.save(state, 2)
        cp.save(state, 3).wait()
        assert [
            s
            for s in (1, 2, 3)
            if os.path.exists(tmp_path / "job" / f"step-{s:012d}" / "MANIFEST.json")
        ] == [3]


def test_unseen_failure_raises_at_close(tmp_path: Any) -> None:
    state = make_state()
    cp = ckpt.Checkpointer(tmp_path / "job")
    cp.storage = FailingWrites(cp.storage, {1})
    cp.save(state, 1)
    with pytest.raises(ckpt.CkptError, match="injected EIO"):
        cp.close()


def test_on_error_warn_logs_instead(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    state = make_state()
    with ckpt.Checkpointer(tmp_path / "job", on_error="warn") as cp:
        cp.storage = FailingWrites(cp.storage, {1})
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            cp.save(state, 1)
            cp.save(state, 2).wait()  # no raise: the failure of step 1 is logged
        assert any("injected EIO" in r.getMessage() for r in caplog.records)


def test_close_waits_for_the_save_in_flight(tmp_path: Any) -> None:
    state = make_state(n=32)
    cp = ckpt.Checkpointer(tmp_path / "job")
    pending = cp.save(state, 5)
    cp.close()
    assert pending.done() and not pending.failed
    assert os.path.exists(tmp_path / "job" / "step-000000000005" / "MANIFEST.json")


def test_if_busy_skip_and_wait(tmp_path: Any) -> None:
    state = make_state(n=32)
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        first = cp.save(state, 1)
        second = cp.save(state, 2, if_busy="skip")
        if not first.done():
            assert second.skipped and second.wait() is None
        third = cp.save(state, 3)  # waits for step 1 first
        assert first.done()
        third.wait()


@pytest.mark.parametrize("budget", [0, 300_000, 10 << 20])
def test_budget_smaller_than_the_state_still_saves_exactly(tmp_path: Any, budget: int) -> None:
    state = make_state(n=12)
    with ckpt.Checkpointer(tmp_path / "job", staging_budget_bytes=budget) as cp:
        before = snapshot(state)
        pending = cp.save(state, 1)
        for t in state["model"].values():
            t.add_(5.0)
        pending.wait()
        loaded: dict[str, Any] = {}
        cp.load(loaded)
    assert same(loaded, before)
    from ckptd.cli.ckptctl import main

    assert main(["verify", str(tmp_path / "job"), "--no-progress"]) == 0


def test_staging_buffer_is_reused_across_saves(tmp_path: Any) -> None:
    state = make_state()
    with ckpt.Checkpointer(tmp_path / "job", keep_last=2) as cp:
        cp.save(state, 1).wait()
        buf = cp._image._buf
        cp.save(state, 2).wait()
        assert cp._image._buf is buf


def test_two_checkpointers_on_two_jobs_do_not_interfere(tmp_path: Any) -> None:
    a, b = make_state(seed=1), make_state(seed=2)
    with ckpt.Checkpointer(tmp_path / "a") as ca, ckpt.Checkpointer(tmp_path / "b") as cb:
        pa, pb = ca.save(a, 1), cb.save(b, 1)
        snap_a, snap_b = snapshot(a), snapshot(b)
        pa.wait()
        pb.wait()
        la: dict[str, Any] = {}
        lb: dict[str, Any] = {}
        ca.load(la)
        cb.load(lb)
    assert same(la, snap_a) and same(lb, snap_b)
