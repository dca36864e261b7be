# ruff: noqa: F811 - pytest fixtures imported from pg_server are used as parameters
"""Two real `ckptd serve` processes on one PostgreSQL catalog: one leads, one stands by.

The leader is SIGKILLed between saves, during a save (ranks writing), and at each named
crash point of the commit (CKPT_CRASH_AT in its environment); the standby takes over
without anyone restarting anything, finishes or aborts what the dead leader left in flight
exactly as a restarted coordinator does (tests/test_crash_points.py), and the ranks (real
processes, forked from tests/crash_harness.py's forkserver) given both addresses
(CKPTD_ADDRESS=a,b) carry on against it. Then crash_harness.check_invariant holds, read
against the PostgreSQL catalog: nothing committed is lost, nothing half-written is
committed, catalog and storage agree.
"""

from __future__ import annotations

import os
import signal
import types
from pathlib import Path

import pytest
from coordinator_fixtures import TOKEN, Serve, ckptctl, step_files, wait_for
from crash_harness import (
    COORDINATOR_POINTS,
    NODE_POINTS,
    RETENTION_POINTS,
    Job,
    check_invariant,
    wait_all,
)
from pg_server import leading_backend, pg_leader, pg_server, pg_url  # noqa: F401

from ckptd.coordinator.catalog import Catalog
from ckptd.errors import CoordinatorUnavailable
from ckptd.server.client import CoordinatorClient
from ckptd.storage import JobLocation

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


class Pair:
    """A leader and a standby `ckptd serve` on one PostgreSQL catalog."""

    def __init__(self, fx: Job, url: str, *, lease_s: float = 30.0):
        self.fx, self.url = fx, url
        args = ["--catalog", url]
        self.a = fx.serve(lease_s=lease_s, extra_args=args)
        self.b = fx.serve(lease_s=lease_s, extra_args=args)

    def start(self, env_a: dict[str, str | None] | None = None) -> Pair:
        self.a.start(env=env_a)
        wait_leading(self.a)
        self.b.start()
        assert "standing by" in self.b.log_path.read_text(), self.b.log()
        return self

    @property
    def both(self) -> types.SimpleNamespace:
        """What Job.launch needs of a serve: the address, here both (standby first)."""
        return types.SimpleNamespace(address=f"{self.b.address},{self.a.address}")


def wait_leading(s: Serve, timeout: float = 60) -> None:
    def leading() -> bool:
        assert s.proc is not None and s.proc.poll() is None, s.log()
        return "ckptd: serving" in s.log_path.read_text(errors="replace")

    wait_for(leading, timeout, f"{s.workdir.name} to lead")


@pytest.fixture
def fx(tmp_path: Path):
    j = Job(tmp_path, fork=True)
    try:
        yield j
    finally:
        j.cleanup()


def _save(step: int, **kw: object) -> dict:
    return {"save": step, "seed": step, **kw}


def _seed(fx: Job, url: str, steps: list[int]) -> None:
    """Committed steps to start from, through the PostgreSQL catalog the serves share."""
    fx.root.mkdir(parents=True, exist_ok=True)
    root = JobLocation.of(str(fx.root)).path
    fx.save_in_process(steps, catalog=lambda: Catalog(leading_backend(url, root)))


def test_a_standby_answers_unavailable_naming_the_leader(fx: Job, pg_url: str) -> None:
    pair = Pair(fx, pg_url).start()
    standby = CoordinatorClient(pair.b.address, token=TOKEN, connect_retry_s=0.5)
    with pytest.raises(CoordinatorUnavailable) as e:
        standby.list_checkpoints(str(fx.job))
    standby.close()
    msg = str(e.value)
    assert f"this ckptd serve ({pair.b.address}) is standing by" in msg, msg
    assert f"--listen {pair.a.address}" in msg and "CKPTD_ADDRESS=" in msg, msg
    leader = pg_leader(pg_url)
    assert leader is not None and leader["address"] == pair.a.address
    # Given both, a client finds the leader on its own, whichever comes first.
    both = CoordinatorClient(pair.both.address, token=TOKEN, connect_retry_s=5)
    assert both.list_checkpoints(str(fx.job)) == []
    assert both.current_address == pair.a.address
    both.close()
    assert pair.b.stop() == 0 and pair.a.stop() == 0  # SIGTERM: a standby stops cleanly too


def test_the_leader_killed_between_saves(fx: Job, pg_url: str, tally, monkeypatch) -> None:
    pair = Pair(fx, pg_url).start()
    with tally.fault("kill: the leading ckptd serve between saves"):
        ranks = fx.launch(pair.both, "a1", [_save(1), {"stop": True}, _save(2)])  # type: ignore[arg-type]
        for r in ranks:
            r.wait_paused()
        pair.a.kill()
        wait_leading(pair.b)
        for r in ranks:
            r.resume()
        assert wait_all(ranks, fx) == [0, 0], fx.logs()
        for r in ranks:
            assert r.outcomes() == ["ok", "ok", "ok"], (r.outcomes(), fx.logs())
        check_invariant(fx.job, [2], world=2, monkeypatch=monkeypatch, catalog=pg_url)
    assert pg_leader(pg_url)["address"] == pair.b.address  # type: ignore[index]
    assert pair.b.stop() == 0


@pytest.mark.slow  # the ranks' first call to the frozen leader waits out its deadline (~35 s)
def test_a_frozen_leader_is_replaced_and_never_writes_again(
    fx: Job, pg_url: str, tally, monkeypatch
) -> None:
    """SIGSTOP: the leader's process lives and its session stays open, so no socket
    closes; PostgreSQL ends the session once it has been idle for half the lease, the
    standby leads, the ranks' calls to the frozen one pass their deadline and go to it,
    and the old leader, woken, finds its session gone and exits (1)."""
    pair = Pair(fx, pg_url, lease_s=4).start()
    with tally.fault("freeze: the leading ckptd serve stopped (SIGSTOP) between saves"):
        ranks = fx.launch(
            pair.both,  # type: ignore[arg-type]
            "a1",
            [_save(1), {"stop": True}, _save(2)],
            lease_s=4,
            timeout_s=5,
        )
        for r in ranks:
            r.wait_paused()
        assert pair.a.proc is not None
        os.kill(pair.a.proc.pid, signal.SIGSTOP)
        try:
            wait_leading(pair.b)
            for r in ranks:
                r.resume()
            assert wait_all(ranks, fx) == [0, 0], fx.logs()
        finally:
            os.kill(pair.a.proc.pid, signal.SIGCONT)
        assert pair.a.wait_dead(30) == 1, pair.a.log()
        assert "lost the leadership of the catalog" in pair.a.log(), pair.a.log()
        for r in ranks:
            assert r.outcomes() == ["ok", "ok", "ok"], (r.outcomes(), fx.logs())
        check_invariant(fx.job, [2], world=2, monkeypatch=monkeypatch, catalog=pg_url)
    assert pg_leader(pg_url)["address"] == pair.b.address  # type: ignore[index]
    assert pair.b.stop() == 0


def test_the_leader_killed_while_ranks_write(fx: Job, pg_url: str, tally, monkeypatch) -> None:
    """Planned, the shards written, nothing reported: the standby takes over and aborts
    the save (as a restart does); the ranks hear it, and their next save commits."""
    _seed(fx, pg_url, [1])
    pair = Pair(fx, pg_url).start()
    with tally.fault("kill: the leading ckptd serve while the ranks write"):
        ranks = fx.launch(pair.both, "a1", [_save(2, pause="after_write"), _save(3)])  # type: ignore[arg-type]
        for r in ranks:
            r.wait_paused()
        pair.a.kill()
        wait_leading(pair.b)
        for r in ranks:
            r.resume()
        assert wait_all(ranks, fx) == [0, 0], fx.logs()
        for r in ranks:
            assert r.outcomes() == ["SaveAborted", "ok"], (r.outcomes(), fx.logs())
        assert step_files(fx.job, 2) == [], "the aborted save left files"
        check_invariant(fx.job, [3], world=2, monkeypatch=monkeypatch, catalog=pg_url)
    assert pair.b.stop() == 0


# The commit's crash points with the ranks calling the coordinator themselves
# (after_barrier is a save in flight, the others are the commit itself), and two with the
# ranks saving through their node's aggregator (its upstream client has both addresses).
TAKEOVER_CASES = [
    *((p, "per-rank") for p in COORDINATOR_POINTS if p not in NODE_POINTS),
    ("coordinator.node_batch_unanswered", "node"),
    ("coordinator.mid_manifest", "node"),
]


@pytest.mark.parametrize(("point", "protocol"), TAKEOVER_CASES)
def test_the_leader_killed_at(
    point: str, protocol: str, fx: Job, pg_url: str, tally, monkeypatch
) -> None:
    retention = point in RETENTION_POINTS
    old = [1, 2] if retention else [1]
    new = old[-1] + 1
    keep = 2 if retention else None
    _seed(fx, pg_url, old)
    pair = Pair(fx, pg_url)
    node = protocol == "node"
    with tally.fault(f"crash:{point} (the standby takes over, {protocol})"):
        pair.start(env_a={"CKPT_CRASH_AT": point})
        ranks = fx.launch(pair.both, "a1", [_save(new)], keep_last=keep, node=node)  # type: ignore[arg-type]
        assert pair.a.wait_dead(60) == -signal.SIGKILL, pair.a.log()
        wait_leading(pair.b)
        assert wait_all(ranks, fx) == [0, 0], fx.logs()
        expect = new if COORDINATOR_POINTS[point] == 2 else old[-1]
        for r in ranks:
            assert r.outcomes() == ["ok" if expect == new else "SaveAborted"], fx.logs()
        check_invariant(fx.job, [expect], world=2, monkeypatch=monkeypatch, catalog=pg_url)
        if expect == old[-1]:
            assert step_files(fx.job, new) == [], "the aborted save left files"
        rc, out, err = ckptctl(
            "verify", str(fx.job), "--all", "--coordinator", pair.both.address, "--token", TOKEN
        )
        assert rc == 0, out + err
    assert pair.b.stop() == 0
