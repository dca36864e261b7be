"""A random-kill soak: saves of a two-rank job while ranks and the coordinator are killed.

Each round saves one new step. A seeded random choice picks the victim (rank 0, rank 1
or the coordinator) and how it dies: SIGKILL at a random named crash point
(CKPT_CRASH_AT), or SIGKILL from outside after a random delay. A killed coordinator is
restarted on the same root and port at once (its recovery finishes or aborts the save);
dead ranks are left to the lease and barrier timeouts. When the save has settled (the
catalog holds it COMMITTED or ABORTED), crash_harness.check_invariant must hold: the
newest committed step is the previous one or the new one, every committed step verifies
(no committed step is missing a shard), the newest loads bit-exactly, the catalog calls
nothing committed that storage lacks; and a rank that was told "committed" was told the
truth. After the last round, gc leaves no debris.

The seed is printed (and in every failure); CKPT_SOAK_SEED replays a run. The default run
does a few rounds; `-m slow` does CKPT_SOAK_N (default 40).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from coordinator_fixtures import Serve, ckptctl, read_catalog, step_files, wait_for
from crash_harness import (
    COORDINATOR_POINTS,
    RANK_POINTS,
    RETENTION_POINTS,
    Job,
    check_invariant,
    committed_on_storage,
)

pytestmark = [pytest.mark.multiprocess]

LEASE, TIMEOUT, KEEP = 1.0, 2.0, 3


def _settled(catalog: Path, step: int) -> bool:
    rows = read_catalog(catalog)
    return all(r["status"] not in ("OPEN", "COMMITTING") for r in rows.values()) and (
        step not in rows or rows[step]["status"] in ("COMMITTED", "ABORTED")
    )


class Soak:
    def __init__(self, fx: Job, seed: int):
        self.fx, self.rng, self.seed = fx, random.Random(seed), seed
        self.serve: Serve = fx.serve(lease_s=LEASE, barrier_timeout_s=TIMEOUT)
        self.serve_env: str | None = None
        self.log: list[str] = []

    def ensure_serve(self, crash_at: str | None) -> None:
        """A live coordinator with this crash point armed (None: none)."""
        s = self.serve
        alive = s.proc is not None and s.proc.poll() is None
        if alive and self.serve_env == crash_at:
            return
        if alive:
            s.kill()  # idle: nothing in flight (faster than a graceful stop)
        s.start(env={"CKPT_CRASH_AT": crash_at} if crash_at else None)
        self.serve_env = crash_at

    def round(self, i: int, step: int) -> tuple[str, bool]:
        """One save with one kill; returns (who was the victim, whether a kill landed)."""
        rng = self.rng
        who = rng.choice(["rank0", "rank1", "coordinator"])
        timed = rng.random() < 0.4
        delay = rng.uniform(0.0, 0.3)  # a save here takes about that long
        only = None
        if who == "coordinator":
            points = list(COORDINATOR_POINTS)
            if len(committed_on_storage(self.fx.job)) < KEEP:  # this commit retires nothing
                points = [p for p in points if p not in RETENTION_POINTS]
            point = None if timed else rng.choice(points)
            self.ensure_serve(point)
        else:
            self.ensure_serve(None)
            point = None if timed else rng.choice(list(RANK_POINTS))
            if point:
                r = int(who[-1])
                only = {r: [{"save": step, "seed": step, "crash_at": f"{point}@{r}"}]}
        how = f"SIGKILL after {delay:.2f}s" if timed else f"crash at {point}"
        self.log.append(f"round {i}: step {step}, {who}, {how}")
        ranks = self.fx.launch(
            self.serve,
            f"a{i}",
            [{"save": step, "seed": step}],
            lease_s=LEASE,
            timeout_s=TIMEOUT,
            keep_last=KEEP,
            only=only,
            tag=f"-{i}",
        )
        killed = False
        t_kill = time.monotonic() + delay if timed else None
        deadline = time.monotonic() + 60
        while any(r.proc.poll() is None for r in ranks):
            assert time.monotonic() < deadline, f"ranks hung\n{self.fx.logs()}"
            if t_kill is not None and time.monotonic() >= t_kill:
                t_kill = None
                if who == "coordinator":
                    self.serve.kill()
                    killed = True
                else:
                    r = ranks[int(who[-1])]
                    if r.proc.poll() is None:
                        os.kill(r.pid, signal.SIGKILL)
                        killed = True
            if self.serve.proc is not None and self.serve.proc.poll() is not None:
                killed |= self.serve.proc.returncode == -signal.SIGKILL
                self.serve.start()  # recovery: the next life finishes or aborts the save
                self.serve_env = None
            time.sleep(0.02)
        codes = [r.wait(5) for r in ranks]
        for n, (r, code) in enumerate(zip(ranks, codes, strict=True)):
            if who == f"rank{n}":
                killed |= code == -signal.SIGKILL
                assert code in (0, -signal.SIGKILL), (code, r.log())
            else:
                assert code == 0, (code, self.fx.logs())
        told_ok = [r.outcomes() == ["ok"] for r in ranks]
        proc = self.serve.proc
        assert proc is not None
        if point in RETENTION_POINTS:  # after the replies: wait for it
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if proc.poll() is not None:
            killed |= proc.returncode == -signal.SIGKILL
            self.serve.start()
            self.serve_env = None
        wait_for(lambda: _settled(self.serve.catalog, step), 30, f"step {step} to settle")
        if any(told_ok):
            assert step in committed_on_storage(self.fx.job), (
                f"a rank was told step {step} committed, storage does not have it"
            )
        return ("coordinator" if who == "coordinator" else "rank"), killed


def soak(n: int, fx: Job, tally, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = int(os.environ.get("CKPT_SOAK_SEED") or time.time_ns() % 2**32)
    print(f"kill soak: seed {seed} (CKPT_SOAK_SEED={seed} replays it), {n} rounds")
    s = Soak(fx, seed)
    fx.save_in_process([1])
    newest = 1
    try:
        for i in range(n):
            step = i + 2
            who, killed = s.round(i, step)
            block = tally.fault(f"soak-kill:{who}") if killed else contextlib.nullcontext()
            with block:
                newest = check_invariant(
                    fx.job,
                    [newest, step],
                    world=2,
                    monkeypatch=monkeypatch,
                    catalog=s.serve.catalog,
                )
            s.log[-1] += f" -> newest {newest}" + ("" if killed else " (no kill landed)")
        s.serve.stop()
        rc, out, err = ckptctl("gc", str(fx.job), "--include-newer")
        assert rc == 0, out + err
        for step in range(2, n + 2):
            files = step_files(fx.job, step)
            assert not files or "MANIFEST.json" in files, f"debris after gc: step {step}: {files}"
    except Exception as e:
        raise AssertionError(f"kill soak seed {seed}: {e}\n" + "\n".join(s.log)) from e
    finally:
        print("\n".join(s.log))


@pytest.fixture
def fx(tmp_path: Path):
    j = Job(tmp_path, fork=True)
    try:
        yield j
    finally:
        j.cleanup()


@pytest.mark.timeout(120)
def test_kill_soak_short(fx: Job, tally, monkeypatch: pytest.MonkeyPatch) -> None:
    soak(3, fx, tally, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill_soak_long(fx: Job, tally, monkeypatch: pytest.MonkeyPatch) -> None:
    soak(int(os.environ.get("CKPT_SOAK_N", "40")), fx, tally, monkeypatch)
