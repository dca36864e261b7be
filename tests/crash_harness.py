"""Real processes for the crash tests, and the invariant every crash must leave intact.

`Job` holds one job's `ckptd serve` lives and rank processes (tests/ranks/plain_rank.py).
Ranks run either as subprocesses (`start_rank`) or forked from a forkserver that has
imported torch once (`fork_rank`): the same program in a real process that can be
SIGKILLed, started in ~0.2 s instead of ~2 s, which is what lets the crash-point matrix
and the kill soak fit the default run on a 2-core box.

`check_invariant` is the promise the crash tests hold the system to after any kill: the
newest committed step is the old one or the new one, every committed step is whole
(`verify` finds nothing), the newest loads bit-exactly as every rank, and the
coordinator's catalog (read from its SQLite file, or its PostgreSQL database) calls
nothing committed that storage does not hold, and leaves nothing OPEN or COMMITTING once
the coordinator has recovered.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from ckpt_testutil import tensor_raw
from coordinator_fixtures import (
    TOKEN,
    Rank,
    RankSim,
    Serve,
    ckptctl_json,
    free_port,
    new_core,
    read_catalog,
    run,
    start_rank,
    started,
)
from pg_server import read_pg_catalog
from ranks.plain_rank import make_state

import ckpt
from ckptd.coordinator.catalog import Catalog
from ckptd.coordinator.core import Coordinator
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage

# point -> the step that must be the newest committed one afterwards (1 old, 2 new)
RANK_POINTS = {
    "rank.after_stage": 1,  # never joined: the barrier times out
    "rank.mid_write": 1,  # half a shard: the lease expires
    "rank.before_report": 1,  # whole shard, never reported: the lease expires
    "rank.after_report": 2,  # reported: the other rank's report completes the commit
}
COORDINATOR_POINTS = {
    "coordinator.after_barrier": 1,  # planned, nothing reported: the restart aborts it
    "coordinator.mid_manifest": 2,  # all reports are durable: the restart commits
    "coordinator.after_manifest_rename": 2,  # committed on storage: the restart records it
    "coordinator.after_catalog_commit": 2,  # committed; the ranks' retries are told so
    "coordinator.during_retention": 2,  # retiring an older step after committing the new one
    "coordinator.retention_unpublished": 2,  # a retired step's manifest gone, its files not
    "coordinator.retention_mid_recycle": 2,  # a retired step's files half moved to the pool
    # Node batches only (the ranks save through their node's aggregator):
    "coordinator.node_batch_unanswered": 1,  # planned, the BeginSaveNode not answered: aborts
    "coordinator.mid_node_reports": 1,  # the node's reports checked, no row durable: aborts
}
NODE_POINTS = ("coordinator.node_batch_unanswered", "coordinator.mid_node_reports")
RETENTION_POINTS = (
    "coordinator.during_retention",
    "coordinator.retention_unpublished",
    "coordinator.retention_mid_recycle",
)

_ctx: Any = None
_SCRUB = ("CKPT_", "CKPTD_", "TORCHELASTIC_")
_SCRUB_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def _forkserver() -> Any:
    global _ctx
    if _ctx is None:
        ctx = multiprocessing.get_context("forkserver")
        # Imported once, shared by every fork (ckpt imports grpc's module but starts no
        # thread nor channel, so forking after it is safe). A module that does not import
        # in the server is skipped and imported by each child instead.
        ctx.set_forkserver_preload(["torch", "numpy", "ckpt", "ckpt._checkpointer"])
        _ctx = ctx
    return _ctx


def _forked_rank_main(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    for k in list(os.environ):
        if k.startswith(_SCRUB) or k in _SCRUB_NAMES:
            del os.environ[k]
    os.environ.update(env)
    sys.argv = argv
    from ranks import plain_rank

    rc = plain_rank.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


class _ProcessAsPopen:
    """A multiprocessing.Process with the Popen calls Rank uses (poll, wait, pid, kill)."""

    def __init__(self, proc: Any):
        self._p = proc

    @property
    def pid(self) -> int:
        return int(self._p.pid)

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self._p.exitcode  # type: ignore[no-any-return]

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired("forked rank", timeout or 0)
        return int(self._p.exitcode)

    def kill(self) -> None:
        self._p.kill()


def fork_rank(
    workdir: Path,
    spec: dict[str, Any],
    *,
    rank: int,
    world: int,
    address: str,
    attempt: str,
    token: str = TOKEN,
    env: dict[str, str] | None = None,
    tag: str = "",
) -> Rank:
    """start_rank's rank, forked from a forkserver with torch already imported."""
    import json

    name = f"rank{rank}{tag}"
    spec_path, out, log = (workdir / f"{name}{s}" for s in (".spec.json", ".out.json", ".log"))
    spec_path.write_text(json.dumps(spec))
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "CKPTD_ADDRESS": address,
        "CKPTD_TOKEN": token,
        "CKPT_ATTEMPT": attempt,
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    argv = ["plain_rank.py", str(spec_path), str(out)]
    p = _forkserver().Process(target=_forked_rank_main, args=(argv, str(log), env), daemon=True)
    p.start()
    return Rank(_ProcessAsPopen(p), out, log, rank)  # type: ignore[arg-type]


class Job:
    """One job's processes; whatever is left running is killed at teardown."""

    def __init__(self, tmp: Path, *, fork: bool = False):
        self.tmp = tmp
        self.root = tmp / "root"
        self.job = self.root / "team" / "run"
        self.fork = fork
        self.ranks: list[Rank] = []
        self.serves: list[Serve] = []

    def serve(self, **kw: Any) -> Serve:
        s = Serve(self.root, self.tmp / f"serve{len(self.serves)}", **kw)
        self.serves.append(s)
        return s

    def launch(
        self,
        serve: Serve,
        attempt: str,
        actions: list[dict[str, Any]],
        *,
        world: int = 2,
        lease_s: float = 60,
        tag: str = "",
        only: dict[int, list[dict[str, Any]]] | None = None,
        keep_last: int | None = None,
        timeout_s: float = 60,
        node: bool = False,
        incremental: bool = False,
    ) -> list[Rank]:
        """Start `world` ranks doing `actions` (rank r does only[r] instead, if given).
        node: the ranks are one node of a gloo process group (LOCAL_WORLD_SIZE = world),
        so they save through their node's aggregator (node batches), as under torchrun."""
        start = fork_rank if self.fork else start_rank
        port = free_port() if node else 0

        def node_env(r: int) -> dict[str, str]:
            if not node:
                return {}
            return {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(world),
                "GROUP_RANK": "0",
            }

        ranks = [
            start(
                self.tmp,
                {
                    "job": str(self.job),
                    "lease_s": lease_s,
                    "timeout_s": timeout_s,
                    "keep_last": keep_last,
                    "incremental": incremental,
                    "process_group": node,
                    "actions": (only or {}).get(r, actions),
                },
                rank=r,
                world=world,
                address=serve.address,
                attempt=attempt,
                env=node_env(r),
                tag=tag,
            )
            for r in range(world)
        ]
        self.ranks.extend(ranks)
        return ranks

    def save_in_process(
        self,
        steps: Iterable[int],
        *,
        world: int = 2,
        keep_last: int = 0,
        frozen: bool = False,
        catalog: Callable[[], Catalog] | None = None,
    ) -> None:
        """Commit `steps` (seed = step, as plain_rank saves them) with the real core and
        writer in this process, on the catalog `ckptd serve` will use (the root's SQLite,
        or what `catalog` opens): the checkpoints a crash test starts from, without paying
        for rank processes. frozen: with the tensor an incremental save borrows
        (make_state)."""

        async def go() -> None:
            core = (
                new_core(self.root) if catalog is None else Coordinator(str(self.root), catalog())
            )
            async with started(core) as core:
                for step in steps:
                    sims = [RankSim(core, str(self.job), r, world) for r in range(world)]
                    for sim in sims:
                        sim.prepare(make_state(step, sim.rank, step, frozen))
                    got = await asyncio.gather(
                        *(
                            sim.save(step, metadata={"seed": step}, keep_last=keep_last)
                            for sim in sims
                        )
                    )
                    assert [g.status for g in got] == ["COMMITTED"] * world, got

        run(go())

    def cleanup(self) -> None:
        for r in self.ranks:
            r.kill()
        for s in self.serves:
            s.kill()

    def coordinator_steps(self, serve: Serve) -> dict[int, dict[str, Any]]:
        doc = ckptctl_json("list", str(self.job), "--coordinator", serve.address, "--token", TOKEN)
        return {s["step"]: s for s in doc["steps"]}

    def storage_steps(self) -> dict[int, str]:
        return {s["step"]: s["status"] for s in ckptctl_json("list", str(self.job))["steps"]}

    def logs(self) -> str:
        return "\n".join(
            [
                *(f"--- rank {r.rank} ({r.log_path.name})\n{r.log()}" for r in self.ranks),
                *(s.log() for s in self.serves),
            ]
        )


def wait_all(ranks: list[Rank], fx: Job, timeout: float = 90) -> list[int]:
    try:
        return [r.wait(timeout) for r in ranks]
    except AssertionError as e:
        raise AssertionError(f"{e}\n{fx.logs()}") from None


def assert_loads(
    job: Path,
    step: int,
    seed: int,
    world: int,
    monkeypatch: pytest.MonkeyPatch,
    frozen: bool = False,
) -> None:
    """Load `step` as every rank would (in this process) and compare bit-exactly."""
    for r in range(world):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        want = make_state(seed, r, step, frozen)
        got = make_state(seed + 999, r, -1, frozen)
        if frozen:
            got["frozen"].zero_()
        res = ckpt.load(got, str(job), step=step, fallback=False)
        assert res.step == step and res.metadata == {"seed": seed}
        for k in ("w", "b", "ids", *(("frozen",) if frozen else ())):
            assert got[k].dtype == want[k].dtype and tensor_raw(got[k]) == tensor_raw(want[k]), k
        assert tensor_raw(got["mine"].value) == tensor_raw(want["mine"].value)
        assert got["who"].value == want["who"].value and got["step"] == step
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")


def retiring_steps(catalog: Path) -> set[int]:
    """Steps a retention run has begun to remove (the catalog's `retiring` table)."""
    db = sqlite3.connect(f"file:{catalog}?mode=ro", uri=True)
    try:
        return {r[0] for r in db.execute("SELECT step FROM retiring").fetchall()}
    finally:
        db.close()


def committed_on_storage(job: Path) -> list[int]:
    if not job.exists():
        return []
    return [s.step for s in ckfmt.list_steps(open_storage(str(job))) if s.status == "COMMITTED"]


def check_invariant(
    job: Path,
    allowed_newest: Iterable[int],
    *,
    world: int,
    monkeypatch: pytest.MonkeyPatch,
    catalog: Path | str | None = None,
    frozen: bool = False,
) -> int:
    """The invariant after a kill and recovery; returns the newest committed step.

    Step s was saved with seed s (as every test here saves with plain_rank's make_state).
    """
    allowed = sorted(set(allowed_newest))
    steps = committed_on_storage(job)
    assert steps, f"{job}: no committed step at all (allowed newest: {allowed})"
    newest = steps[-1]
    assert newest in allowed, f"{job}: newest committed step is {newest}, expected one of {allowed}"
    st = open_storage(str(job))
    for s in steps:  # committed means whole: no committed step is missing a shard or a byte
        rep = ckfmt.verify_checkpoint(st, s, level="full")
        if not rep.ok and s != newest and s not in committed_on_storage(job):
            # Un-published since the listing: retention (a background task of the live
            # coordinator) removes an old step manifest first; that is not damage.
            continue
        assert rep.ok, f"{job} step {s} is committed but does not verify: {rep.problems}"
    assert_loads(job, newest, newest, world, monkeypatch, frozen)
    pg = isinstance(catalog, str)  # a PostgreSQL catalog's URL
    if catalog is not None and (pg or Path(catalog).exists()):
        rows, retiring = (
            read_pg_catalog(str(catalog))
            if pg
            else (read_catalog(Path(catalog)), retiring_steps(Path(catalog)))
        )
        cat_committed = sorted(s for s, r in rows.items() if r["status"] == "COMMITTED")
        # A step retention is removing (listed in `retiring`) may have lost its manifest
        # already; any other catalog COMMITTED row without one is a phantom commit.
        phantom = sorted(set(cat_committed) - set(steps) - retiring)
        assert not phantom, (
            f"{job}: the catalog calls steps {phantom} COMMITTED but storage has no manifest"
        )
        assert max(cat_committed, default=None) == newest, (
            f"{job}: the catalog's newest committed step is {max(cat_committed, default=None)}, "
            f"storage's is {newest}"
        )
        undead = sorted(s for s, r in rows.items() if r["status"] == "ABORTED" and s in steps)
        assert not undead, f"{job}: steps {undead} are ABORTED in the catalog, committed on storage"
        stuck = {s: r["status"] for s, r in rows.items() if r["status"] in ("OPEN", "COMMITTING")}
        assert not stuck, f"{job}: saves still open after recovery: {stuck}"
    return newest
