"""Preemption: a signal becomes one last checkpoint at the next maybe_save, then an exit.

Real processes receive real signals (tests/ranks/preempt_rank.py): one process, and two
gloo ranks of which only one is signalled (they must agree on the step). In this process:
a signal while a save is in flight waits for that save instead of starting a second (the
save is held back by a storage wrapper that blocks writes until released), a signal with
nothing in flight takes one blocking save, the exit status and the previous handler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_testutil import DelegatingStorage, DelegatingWriteHandle
from coordinator_fixtures import TESTS, child_env, free_port, wait_for

import ckpt
from ckpt import _hooks
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage
from ckptd.storage.base import Piece, Storage, WriteHandle

pytestmark = pytest.mark.timeout(120)

RANK_SCRIPT = TESTS / "ranks" / "preempt_rank.py"


def committed(job: Path) -> list[int]:
    return [s.step for s in ckfmt.list_steps(open_storage(str(job))) if s.status == ckfmt.COMMITTED]


def state_at(step: int) -> dict[str, Any]:
    return {"w": torch.full((128, 128), float(step)), "step": step}


class GatedWrites(DelegatingStorage):
    """A real storage whose shard writes wait until `gate` is set (a save held in flight)."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def open_write(self, path: str, size: int, **kw: Any) -> WriteHandle:
        outer = self

        class Handle(DelegatingWriteHandle):
            def write(self, offset: int, length: int, pieces: Sequence[Piece]) -> None:
                outer.writing.set()
                assert outer.gate.wait(60), "the test never opened the gate"
                super().write(offset, length, pieces)

        return Handle(super().open_write(path, size, **kw))


# ------------------------------------------------------------------------ in this process


def test_signal_during_an_inflight_save_waits_for_it_instead_of_a_second(tmp_path: Path) -> None:
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, save_on_preemption=True, exit_on_preemption=False) as cp:
        gated = GatedWrites(cp.storage)
        cp.storage = gated
        assert cp.maybe_save(state_at(4), 4, every=5) is None
        inflight = cp.maybe_save(state_at(5), 5, every=5)
        assert inflight is not None and inflight.step == 5
        assert gated.writing.wait(30)  # the save of step 5 is in its write now
        signal.raise_signal(signal.SIGTERM)  # the handler only notes it
        assert _hooks.received() == signal.SIGTERM and cp.preempted is None
        threading.Timer(0.3, gated.gate.set).start()
        t0 = time.monotonic()
        final = cp.maybe_save(state_at(6), 6, every=5)
        assert time.monotonic() - t0 >= 0.2  # it waited for the save in flight
        assert final is inflight and final.done() and not final.failed
        assert cp.preempted == signal.SIGTERM
        assert cp.maybe_save(state_at(7), 7) is None  # stopped: nothing more on preemption
    assert committed(job) == [5]
    assert not (job / "step-000000000006").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handler restored at close
    assert _hooks.received() is None


def test_signal_with_nothing_in_flight_takes_one_blocking_save(tmp_path: Path) -> None:
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, save_on_preemption=True, exit_on_preemption=False) as cp:
        cp.maybe_save(state_at(5), 5, every=5)
        cp.wait()
        signal.raise_signal(signal.SIGUSR1)
        final = cp.maybe_save(state_at(7), 7, every=5)
        assert final is not None and final.step == 7 and final.done()
        assert cp.preempted == signal.SIGUSR1
    assert committed(job) == [5, 7]
    got: dict[str, Any] = {}
    ckpt.load(got, str(job))
    assert got["step"] == 7 and torch.equal(got["w"], state_at(7)["w"])


def test_exit_is_128_plus_signum_and_the_previous_handler_comes_back(tmp_path: Path) -> None:
    calls: list[int] = []

    def previous(signum: int, frame: object) -> None:
        calls.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        with pytest.raises(SystemExit) as exc:
            with ckpt.Checkpointer(tmp_path / "job", save_on_preemption=True) as cp:
                signal.raise_signal(signal.SIGTERM)
                assert calls == []  # ours took it
                cp.maybe_save(state_at(3), 3, every=10)
        assert exc.value.code == 128 + signal.SIGTERM
        assert calls == [signal.SIGTERM]  # re-raised to the handler that was there before
        assert signal.getsignal(signal.SIGTERM) is previous
        assert committed(tmp_path / "job") == [3]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_handlers_only_from_the_main_thread(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            ckpt.Checkpointer(tmp_path / "job", save_on_preemption=True)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    t = threading.Thread(target=make)
    t.start()
    t.join(60)
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_maybe_save_every_and_not_twice(tmp_path: Path) -> None:
    job = tmp_path / "job"
    with ckpt.Checkpointer(job) as cp:
        saved = [s for s in range(1, 13) if cp.maybe_save(state_at(s), s, every=4) is not None]
        cp.wait()
    assert saved == [4, 8, 12] and committed(job) == [4, 8, 12]
    with ckpt.Checkpointer(job) as cp:
        st = state_at(0)
        assert cp.resume(st) == 12
        assert cp.maybe_save(st, 12, every=4) is None  # just resumed from it
        with pytest.raises(ValueError, match="every"):
            cp.maybe_save(st, 13, every=0)


# ------------------------------------------------------------------------ real processes


def start_rank(job: Path, out: Path, rank: int, world: int, port: int | None, every: int):
    env = child_env(RANK=str(rank), WORLD_SIZE=str(world))
    if port is not None:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    return subprocess.Popen(
        [sys.executable, str(RANK_SCRIPT), str(job), str(out), "--every", str(every)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def trained(out: Path, rank: int) -> int:
    try:
        return int((out / f"rank{rank}.step").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def test_sigterm_in_a_training_process_commits_one_last_checkpoint(tmp_path: Path) -> None:
    job, out = tmp_path / "job", tmp_path / "out"
    out.mkdir()
    proc = start_rank(job, out, 0, 1, None, every=5)
    try:
        wait_for(lambda: trained(out, 0) >= 8, 60, "8 steps")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr, stderr
    trained_to = trained(out, 0)
    steps = committed(job)
    assert f"finally ran after step {trained_to}" in stdout
    # Every periodic save, plus exactly one last one at the step where training stopped;
    # or, when the signal came while a periodic save was in flight, that save finished
    # (not repeated) as the last checkpoint (README, Preemption). That save can be more
    # than one step old: on a slow disk the save of step 5 was still persisting at step 10.
    last = steps[-1]
    if last != trained_to:
        assert last % 5 == 0 and last < trained_to, (steps, trained_to, stderr)
        assert f"taking the last checkpoint at step {trained_to}" in stderr
    assert [s for s in steps if s % 5] == ([last] if last % 5 else [])
    assert f"last checkpoint: step {last} committed" in stderr
    got: dict[str, Any] = {}
    ckpt.load(got, str(job))
    assert got["step"] == last and float(got["w"][0, 0]) == sum(range(1, last + 1))


@pytest.mark.multiprocess
def test_two_ranks_signalled_one_take_the_last_checkpoint_at_the_same_step(
    tmp_path: Path,
) -> None:
    job, out = tmp_path / "job", tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = [start_rank(job, out, r, 2, port, every=1000) for r in range(2)]
    try:
        wait_for(lambda: min(trained(out, 0), trained(out, 1)) >= 5, 90, "5 steps on both ranks")
        procs[1].send_signal(signal.SIGTERM)  # one node preempted: the other rank is not told
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = "\n".join(f"--- rank {r}\n{o}\n{e}" for r, (o, e) in enumerate(results))
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, logs
    last = [trained(out, r) for r in range(2)]
    assert last[0] == last[1], logs
    assert committed(job) == [last[0]], logs
    m = ckfmt.read_manifest(open_storage(str(job)), last[0])
    assert m.world_size == 2
    for o, e in results:
        assert f"finally ran after step {last[0]}" in o, logs
        assert f"last checkpoint: step {last[0]} committed" in e, logs
        assert "rank 1 saw it first" in e, logs
        assert "Traceback" not in e, logs
    assert os.path.exists(job / f"step-{last[0]:012d}" / "MANIFEST.json")
    # The job comes back with another world size (here 1 process): resume just works.
    st = {"w": torch.zeros(64, 64), "step": 0, "mine": ckpt.PerRank(torch.zeros(3))}
    with ckpt.Checkpointer(job) as cp:
        assert cp.resume(st) == last[0]
    assert float(st["w"][0, 0]) == 2 * sum(range(1, last[0] + 1))  # all-reduced over 2 ranks
    assert torch.equal(st["mine"].value, torch.zeros(3))  # rank 0's own value


LEFT_UNHANDLED = """
import signal, sys, ckpt
cp = ckpt.Checkpointer(sys.argv[1], save_on_preemption=True)
signal.raise_signal(signal.SIGTERM)  # noted; no maybe_save comes after it
if sys.argv[2] == "close":
    cp.close()
    print("UNREACHABLE: the signal was lost")
else:
    with cp:
        raise RuntimeError("the loop failed")
"""


@pytest.mark.parametrize("how", ["close", "exception"])
def test_a_signal_no_maybe_save_acted_on_is_not_lost(tmp_path: Path, how: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LEFT_UNHANDLED, str(tmp_path / "job"), how],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    if how == "close":
        # Delivered again once the default handler is back: the process dies of it.
        assert proc.returncode == -signal.SIGTERM, proc.stderr
        assert "no last checkpoint was taken; delivering it again" in proc.stderr
        assert "UNREACHABLE" not in proc.stdout
    else:
        # An exception on its way out is not cut short: its traceback is printed.
        assert proc.returncode == 1 and "RuntimeError: the loop failed" in proc.stderr
