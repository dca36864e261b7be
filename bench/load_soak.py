"""Load soak: N simulated ranks saving again and again against one real coordinator, some
of them killed mid-save, for a bounded time; then an audit of everything the ranks were told.

The coordinator is a real `ckptd serve` subprocess and the ranks are asyncio coroutines over
a few grpc.aio channels, as in coordinator_scale.py (whose server, rank plans and helpers
are reused). Each rank runs the Python client's protocol: BeginSave -> a KeepAlive every
lease/3 while the save is in flight (the client's pinger thread) -> write its shard and
index for real (tiny chunks, ckptd.format.writer, fsynced) -> ReportShard -> AwaitCommit.
The coordinator does its real work: the barrier and planning, stat of every shard, read +
blake3 + parse of every index against the plan, the manifest, the catalog, retention
(keep_last), lease expiry and the removal of an aborted save's files.

Every --kill-every'th round, --kills ranks die mid-save: right after BeginSave, half-way
through writing (a partial shard left behind) or after writing but before reporting. A dead
rank sends nothing more, so only lease expiry can end the save: it must be ABORTED, naming
dead ranks only, and never commit. Then the job goes on, alternately restarted (OpenJob with
a new attempt: the generation goes up, as under torchelastic) or in place (same generation).
A "zombie" (the rank that died after writing) then sends its late ReportShard: it must be
refused (stale generation) or answered ABORTED, never counted.

Audit, after every round and at the end:
  lost reports        a ReportShard answered without error and not ABORTED whose shard is
                      neither in that step's committed manifest (same path, size, index
                      blake3) nor in a save ABORTED for a known reason (the lease of a rank
                      that was killed in that round)
  wrongly committed   a save with a killed rank that is COMMITTED in the catalog, has a
                      MANIFEST.json in storage, or was answered COMMITTED; or a committed
                      manifest without every rank's shard, or failing verify (sizes, index
                      blake3; the newest also by full re-hash)
  unexpected aborts   a round without kills that did not commit, or an abort naming a rank
                      that was alive (a false lease expiry: the coordinator fell behind)
  RPC errors          any error answer other than the zombie's expected refusal
A live rank still writing when a kill round's lease expires finds its files removed by the
abort; that is right only in a kill round and only if KeepAlive then says ABORTED (the
Python client asks the same and raises SaveAborted with the coordinator's reason).
Figures: saves committed / aborted, RPCs by kind, p50/p99 latency per kind (client-side,
so they include this process's own event-loop delays; BeginSave includes the barrier wait
for the slowest rank, AwaitCommit the commit or, in kill rounds, the lease expiry), RPC/s
over the rounds' wall time, and the coordinator's VmRSS after every round. RSS must stay
flat: after --warmup-rounds, growth <= max(--rss-slack-mib, 10%).

--ranks-per-node K (default 1: each rank calls the coordinator) groups the ranks into nodes
of K, each behind the real node aggregator (ckptd.server.node.NodeBatcher, as in
coordinator_scale.py): a rank's BeginSave, KeepAlive, ReportShard and AwaitCommit go to its
node's batcher, which makes one BeginSaveNode / KeepAliveNode / ReportShardsNode call per
node and phase; the RPC table then lists those node calls. A killed rank is noticed by its
aggregator (silent for 2/3 of the lease: it aborts the save naming the rank and node);
every second kill round instead kills a whole node after BeginSave, aggregator included
(its keep-alives stop), which only the coordinator's lease expiry can end. The zombie's late
report still goes to the coordinator directly (fencing is per rank).

    .venv/bin/python bench/load_soak.py [--ranks 4096] [--seconds 120] [--lease 20]
        [--kill-every 3] [--kills 3] [--channels 8] [--keep-last 2] [--ranks-per-node 8]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common as C
import coordinator_scale as cs
import grpc

from ckptd.coordinator.types import ShardReport
from ckptd.errors import CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout
from ckptd.server import converters as cv
from ckptd.server.errors import error_from
from ckptd.server.node import NodeBatcher
from ckptd.server.node_session import SessionUpstream
from ckptd.storage import open_storage
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

MOMENTS = ("after_begin", "mid_write", "after_write")  # where a killed rank stops
NODE_DEAD = "node"  # every rank of a node and its aggregator die after BeginSave
CALL_TIMEOUT_S = 600.0
STATUS = {pb.COMMITTED: "COMMITTED", pb.ABORTED: "ABORTED"}


@dataclasses.dataclass(frozen=True)
class Report:
    """A ReportShard the coordinator accepted: what the rank was promised is kept."""

    step: int
    generation: int
    rank: int
    shard_path: str
    size: int
    index_blake3: str


@dataclasses.dataclass
class Round:
    step: int
    generation: int
    victims: dict[int, str]  # rank -> moment of death
    outcome: str = ""  # COMMITTED / ABORTED / MIXED (ranks were told different things)
    reason: str = ""
    wall_s: float = 0.0
    rss: int = 0
    server_cpu_s: float = 0.0
    audit_s: float = 0.0  # checking the round afterwards (not in wall_s)


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args = args
        self.n = args.ranks
        self.root = work / "root"
        self.server = cs.Server(self.root, args.lease, work / "server.log")
        opts = [
            ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel
            ("grpc.enable_retries", 0),  # every RPC counted is one the server saw
        ]
        self.channels = [
            grpc.aio.insecure_channel(self.server.address, options=opts)
            for _ in range(args.channels)
        ]
        self.stubs = [pb_grpc.CoordinatorStub(ch) for ch in self.channels]
        self.pool = ThreadPoolExecutor(args.io_threads, thread_name_prefix="rank-io")
        self.job = "soak"
        self.job_path = str((self.root / self.job).resolve())
        self.storage = open_storage(self.job_path, create=True)
        self.generation = 0
        self.attempt = 0
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter[str] = Counter()
        self.error_samples: list[str] = []
        self.reports: list[Report] = []
        self.rounds: list[Round] = []
        self.problems: dict[str, list[str]] = defaultdict(list)  # kind -> what went wrong
        self.zombies: Counter[str] = Counter()
        self.cut_writes: Counter[str] = Counter()  # writes that failed under an abort
        self.rank_latency: dict[str, list[float]] = defaultdict(list)  # ranks -> aggregator
        self.kill_round = False
        # This round's node calls: when the last report was answered, when each wait for
        # the commit was (the commit latency: an answer after the coordinator had every
        # report; the AwaitCommit time itself also waits for the slowest rank's write).
        self.last_report_t = 0.0
        self.await_answers: list[float] = []
        self.commit_latency: list[float] = []
        k = max(1, args.ranks_per_node)
        self.sessions: list[SessionUpstream] = []
        self.batchers: list[NodeBatcher] = []
        if k > 1:
            self.batchers = [
                NodeBatcher(
                    self.node_upstream(self.stubs[n % len(self.stubs)]),
                    f"node{n}",
                    range(n * k, min(self.n, (n + 1) * k)),
                )
                for n in range(-(-self.n // k))
            ]

    def node_upstream(self, stub: pb_grpc.CoordinatorStub) -> Any:
        """A node's calls on its node session (as ckptd's aggregator makes them), timed as a
        whole; the ones that go by unary instead are timed again as "<kind>(unary)". With
        --node-calls unary, every node call is a unary RPC."""
        if self.args.node_calls == "unary":
            return SoakUpstream(self, stub)
        session = SessionUpstream(
            stub.NodeSession, SoakUpstream(self, stub, "(unary)"), call_timeout_s=CALL_TIMEOUT_S
        )
        self.sessions.append(session)
        return TimedSession(self, session)

    def batcher(self, rank: int) -> NodeBatcher:
        return self.batchers[rank // self.args.ranks_per_node]

    async def call(self, kind: str, rank: int, req: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """A rank's call: to the coordinator, or to its node's aggregator (then its node
        calls are the RPCs counted; the rank's wait is kept apart)."""
        if not self.batchers:
            return await self.rpc(kind, getattr(self.stub(rank), kind), req, timeout)
        fn = {
            "BeginSave": "begin_save",
            "KeepAlive": "keep_alive",
            "ReportShard": "report_shard",
            "AwaitCommit": "await_commit",
        }[kind]
        t0 = time.perf_counter()
        resp = await asyncio.wait_for(getattr(self.batcher(rank), fn)(req), timeout)
        self.rank_latency[kind].append(time.perf_counter() - t0)
        return resp

    def stub(self, rank: int) -> pb_grpc.CoordinatorStub:
        return self.stubs[rank % len(self.stubs)]

    async def rpc(self, kind: str, fn: Any, req: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """One call, timed; an error answer is counted and re-raised."""
        t0 = time.perf_counter()
        try:
            resp = await fn(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            self.errors[f"{kind}:{e.code().name}"] += 1
            if len(self.error_samples) < 10:
                self.error_samples.append(f"{kind}: {e.code().name}: {e.details()}")
            raise
        self.latency[kind].append(time.perf_counter() - t0)
        return resp

    async def open(self) -> None:
        self.attempt += 1
        r = await self.rpc(
            "OpenJob",
            self.stubs[0].OpenJob,
            pb.OpenJobRequest(job=self.job, attempt=f"soak-{os.getpid()}-{self.attempt}"),
        )
        self.generation, self.job = r.generation, r.job

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()
        for ch in self.channels:
            await ch.close()
        self.pool.shutdown()
        self.server.stop()

    def ref(self, step: int, rank: int, generation: int | None = None) -> pb.SaveRef:
        gen = self.generation if generation is None else generation
        return pb.SaveRef(job=self.job, step=step, generation=gen, rank=rank, world_size=self.n)

    # -- one rank, one save --------------------------------------------------------------
    async def pinger(self, ref: pb.SaveRef) -> None:
        """The client's keep-alive thread: every lease/3 until the save has ended."""
        while True:
            await asyncio.sleep(self.args.lease / 3)
            try:
                st = await self.call("KeepAlive", ref.rank, pb.KeepAliveRequest(ref=ref))
            except (grpc.aio.AioRpcError, CkptError):
                continue  # counted; the client also keeps trying
            if st.status in (pb.COMMITTED, pb.ABORTED):
                return

    async def rank(self, rnd: Round, plan: cs.Rank, zombie: dict[str, Any]) -> tuple[str, str]:
        """One rank's save: (final status it was told, reason); ("DEAD", moment) if killed."""
        r, step = plan.rank, rnd.step
        ref = self.ref(step, r)
        loop = asyncio.get_running_loop()
        req = plan.begin_request(ref)
        req.keep_last = self.args.keep_last  # retention runs after each commit: real work
        begun = await self.call("BeginSave", r, req)
        if not begun.complete:
            raise cs.Failed(f"rank {r}: BeginSave answered an incomplete plan")
        moment = rnd.victims.get(r)
        if moment == NODE_DEAD:
            self.kill_aggregator(ref)
            return "DEAD", moment
        if moment == "after_begin":
            return "DEAD", moment
        if moment == "mid_write":
            # Half a shard, never fsynced nor indexed: what a SIGKILL during pwrite leaves.
            await loop.run_in_executor(self.pool, self.partial_write, step, begun.shard_path)
            return "DEAD", moment
        pinger = asyncio.ensure_future(self.pinger(ref))
        try:
            items = [plan.items[i] for i in begun.write]
            digests = [plan.digests[i] for i in begun.write]
            try:
                info = await loop.run_in_executor(
                    self.pool, self.write, step, r, rnd.generation, items, digests
                )
            except CkptError as e:
                # The lease of a dead rank expired while this one was still writing: the
                # coordinator removed the save's files under it. Only right in a kill round,
                # and only if the coordinator says the save is ABORTED.
                st = await self.call("KeepAlive", r, pb.KeepAliveRequest(ref=ref))
                self.cut_writes[STATUS.get(st.status, pb.Status.Name(st.status))] += 1
                if not rnd.victims or st.status != pb.ABORTED:
                    self.problems["rank errors"].append(f"step {step} rank {r}: write: {e}")
                return STATUS.get(st.status, pb.Status.Name(st.status)), st.reason
            report = cv.report_to_pb(ref, ShardReport.of(info, "size"))
            if moment == "after_write":
                zombie.update(rank=r, step=step, generation=rnd.generation, request=report)
                return "DEAD", moment
            st = await self.call("ReportShard", r, report)
            if st.status != pb.ABORTED:
                self.reports.append(
                    Report(step, rnd.generation, r, info.path, info.size, info.index_blake3)
                )
                wait = pb.AwaitCommitRequest(ref=ref, timeout_ms=int(CALL_TIMEOUT_S * 1000))
                if self.batchers:
                    st = await self.call("AwaitCommit", r, wait, CALL_TIMEOUT_S + 30)
                else:
                    kind = "AwaitCommit(kill round)" if rnd.victims else "AwaitCommit"
                    st = await self.rpc(kind, self.stub(r).AwaitCommit, wait, CALL_TIMEOUT_S + 30)
            return STATUS.get(st.status, pb.Status.Name(st.status)), st.reason
        finally:
            pinger.cancel()

    def kill_aggregator(self, ref: pb.SaveRef) -> None:
        """The node's aggregator process dies: it makes no call for this save any more."""
        save = self.batcher(ref.rank).saves.get((ref.job, ref.step, ref.generation))
        if save is not None and save.pinger is not None:
            save.pinger.cancel()

    def write(
        self, step: int, rank: int, generation: int, items: list[Any], digests: list[Any]
    ) -> Any:
        return cs.write_shard(
            self.storage,
            job=self.job_path,
            step=step,
            rank=rank,
            world_size=self.n,
            generation=generation,
            items=items,
            verify="size",
            digests=digests,
            io_threads=1,
        )

    def partial_write(self, step: int, shard_path: str) -> None:
        path = Path(self.job_path) / layout.step_dir(step) / shard_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x5a" * 2048)

    # -- one round -------------------------------------------------------------------------
    async def round(self, step: int, victims: dict[int, str]) -> Round:
        rnd = Round(step, self.generation, victims)
        self.kill_round = bool(victims)
        shared = cs.shared_items(step, self.args.chunk_bytes)
        plans = [cs.Rank(r, self.n, step, self.args.chunk_bytes, shared) for r in range(self.n)]
        zombie: dict[str, Any] = {}
        cpu0, t0 = self.server.cpu_s(), time.perf_counter()
        self.last_report_t, self.await_answers = 0.0, []
        outcomes = await asyncio.gather(
            *(self.rank(rnd, p, zombie) for p in plans), return_exceptions=True
        )
        rnd.wall_s = time.perf_counter() - t0
        rnd.server_cpu_s = self.server.cpu_s() - cpu0
        told: Counter[str] = Counter()
        for r, o in enumerate(outcomes):
            if isinstance(o, BaseException):
                if not isinstance(o, (grpc.aio.AioRpcError, CkptError)):
                    raise o
                why = o.details() if isinstance(o, grpc.aio.AioRpcError) else str(o)
                self.problems["rank errors"].append(f"step {step} rank {r}: {why}")
                continue
            status, reason = o
            if status != "DEAD":
                told[status] += 1
                rnd.reason = rnd.reason or reason
        rnd.outcome = next(iter(told)) if len(told) == 1 else f"MIXED {dict(told)}"
        if rnd.outcome == "COMMITTED" and self.last_report_t:
            self.commit_latency += [max(0.0, t - self.last_report_t) for t in self.await_answers]
        rnd.rss = self.server.memory().get("VmRSS", 0)
        self.rounds.append(rnd)
        if victims:
            await self.after_kill(rnd, zombie)
        t1 = time.perf_counter()
        await self.audit_round(rnd)
        rnd.audit_s = time.perf_counter() - t1
        return rnd

    async def after_kill(self, rnd: Round, zombie: dict[str, Any]) -> None:
        """Carry on as the job would: restarted (new generation) or in place; then the zombie."""
        restarted = sum(1 for r in self.rounds if r.victims) % 2 == 1
        if restarted:
            await self.open()
        if not zombie:
            return
        stub = self.stub(zombie["rank"])
        try:
            st = await stub.ReportShard(zombie["request"], timeout=60)
        except grpc.aio.AioRpcError as e:
            ok = restarted and e.code() == grpc.StatusCode.FAILED_PRECONDITION
            self.zombies["refused (stale generation)" if ok else f"error {e.code().name}"] += 1
            if not ok:
                self.problems["zombie"].append(f"step {rnd.step}: {e.code().name} {e.details()}")
            return
        self.zombies["answered " + STATUS.get(st.status, pb.Status.Name(st.status))] += 1
        if st.status != pb.ABORTED:
            self.problems["zombie"].append(f"step {rnd.step}: late report answered {st.status}")

    # -- the audit -------------------------------------------------------------------------
    async def catalog_record(self, step: int) -> pb.CheckpointInfo | None:
        """The catalog's row for `step`, once it is final (a guard: the core used to tell
        the ranks of an abort before its catalog write landed, so the row said OPEN for a
        moment)."""
        req = pb.GetCheckpointRequest(job=self.job, step=step)
        deadline = time.monotonic() + 30
        while True:
            try:
                rec = await self.stubs[0].GetCheckpoint(req, timeout=60)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                raise
            if rec.status in (pb.COMMITTED, pb.ABORTED) or time.monotonic() > deadline:
                return rec
            await asyncio.sleep(0.05)

    async def audit_round(self, rnd: Round) -> None:
        """Check this round against the catalog and storage while its files still exist."""
        rec = await self.catalog_record(rnd.step)
        await asyncio.to_thread(self._audit_round, rnd, rec)

    def _audit_round(self, rnd: Round, rec: pb.CheckpointInfo | None) -> None:
        step = rnd.step
        status = STATUS.get(rec.status, pb.Status.Name(rec.status)) if rec else "NOT FOUND"
        reason = rec.reason if rec else ""
        mine = [x for x in self.reports if x.step == step and x.generation == rnd.generation]
        has_manifest = self.storage.exists(f"{layout.step_dir(step)}/{layout.MANIFEST_NAME}")
        if rnd.victims:
            if status == "COMMITTED" or has_manifest or "COMMITTED" in rnd.outcome:
                self.problems["wrongly committed"].append(
                    f"step {step} (killed ranks {sorted(rnd.victims)}): catalog {status}, "
                    f"manifest {has_manifest}, ranks told {rnd.outcome}"
                )
            named = _lease_expired_ranks(reason)
            if status != "ABORTED" or named is None:
                self.problems["lost"].extend(
                    f"step {step} rank {x.rank}: save {status} ({reason[:200]})" for x in mine
                )
            elif not named <= set(rnd.victims):
                self.problems["unexpected aborts"].append(
                    f"step {step}: lease expiry named live ranks {sorted(named - set(rnd.victims))}"
                )
            return
        if status != "COMMITTED" or rnd.outcome != "COMMITTED":
            self.problems["unexpected aborts"].append(
                f"step {step}: catalog {status}, ranks told {rnd.outcome}: {reason[:200]}"
            )
            if status != "ABORTED":
                self.problems["lost"].extend(f"step {step} rank {x.rank}" for x in mine)
            return
        assert rec is not None
        try:
            m = ckfmt.read_manifest(self.storage, step)
            data = self.storage.read_bytes(
                f"{layout.step_dir(step)}/{layout.MANIFEST_NAME}", limit=1 << 30
            )
        except Exception as e:  # any failure here is the finding
            self.problems["wrongly committed"].append(f"step {step}: manifest unreadable: {e}")
            return
        if hashing.digest(data) != rec.manifest_blake3:
            self.problems["wrongly committed"].append(f"step {step}: manifest hash != catalog")
        shards = {s.rank: s for s in m.shards}
        if sorted(shards) != list(range(self.n)) or m.world_size != self.n:
            self.problems["wrongly committed"].append(
                f"step {step}: manifest has {len(shards)} shards of world {m.world_size}"
            )
        for x in mine:
            s = shards.get(x.rank)
            if s is None or (s.path, s.size, s.index_blake3) != (
                x.shard_path,
                x.size,
                x.index_blake3,
            ):
                self.problems["lost"].append(f"step {step} rank {x.rank}: not in the manifest")
        v = ckfmt.verify_checkpoint(self.storage, step, level="size")
        if not v.ok:
            self.problems["wrongly committed"].append(f"step {step}: verify: {v.problems[:3]}")

    async def final_audit(self) -> dict[str, Any]:
        """The whole run against the catalog and storage: aborted saves stay aborted and
        leave no shard files behind; the newest committed step verifies in full."""
        for rnd in self.rounds:
            rec = await self.catalog_record(rnd.step) if rnd.victims else None
            if rec is not None and rec.status == pb.COMMITTED:
                self.problems["wrongly committed"].append(f"step {rnd.step}: COMMITTED at end")
        return await asyncio.to_thread(self._final_storage_audit)

    def _final_storage_audit(self) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        debris: list[str] = []
        for rnd in self.rounds:
            if not rnd.victims:
                continue
            names = {
                Path(f(r, rnd.generation)).name
                for r in range(self.n)
                for f in (layout.shard_name, layout.index_name)
            }
            sdir = Path(self.job_path) / layout.step_dir(rnd.step) / layout.SHARDS_DIR
            while True:  # the coordinator removes an aborted save's files in the background
                left = sorted(names.intersection(os.listdir(sdir))) if sdir.exists() else []
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            debris += [f"step {rnd.step}: {n}" for n in left[:3]]
        if debris:
            self.problems["debris"].extend(debris)
        committed = [r.step for r in self.rounds if r.outcome == "COMMITTED" and not r.victims]
        full = None
        if committed:
            v = ckfmt.verify_checkpoint(self.storage, committed[-1], level="full")
            full = {"step": committed[-1], "ok": v.ok, "bytes": v.bytes_checked}
            if not v.ok:
                self.problems["wrongly committed"].append(f"full verify: {v.problems[:3]}")
        return {"full_verify_newest": full, "debris": debris}


def _lease_expired_ranks(reason: str) -> set[int] | None:
    """The ranks a lease-expiry abort names, or None when the reason is something else:
    the coordinator's (it lists at most 16 ranks and then "(+k more)") or a node
    aggregator's (ckptd.server.node: ranks that stopped renewing with it)."""
    m = re.match(
        r"(?:rank \d+ aborted: )?rank\(s\) ([\d, ]+)(?: \(\+\d+ more\))? "
        r"(?:silent for over .*lease expired|"
        r"of node .* stopped renewing their lease with the node's aggregator)",
        reason,
    )
    if not m:
        return None
    return {int(x) for x in m.group(1).split(",") if x.strip()}


class SoakUpstream:
    """A node aggregator's calls to the coordinator, timed and counted as the soak's RPCs;
    a failed call becomes the CkptError the real client raises (ckptd.server.errors)."""

    def __init__(self, soak: Soak, stub: pb_grpc.CoordinatorStub, label: str = ""):
        self.soak, self.stub, self.label = soak, stub, label

    async def _rpc(self, kind: str, fn: Any, req: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        try:
            return await self.soak.rpc(kind + self.label, fn, req, timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from(e.code(), e.details() or "", e.trailing_metadata()) from None

    async def begin_save(self, req: pb.BeginSaveRequest) -> pb.BeginSaveResponse:
        return await self._rpc("BeginSave", self.stub.BeginSave, req)

    async def begin_save_node(self, node: str, reqs: Any) -> Any:
        req = pb.NodeBeginSaveRequest(node=node, ranks=reqs)
        return (await self._rpc("BeginSaveNode", self.stub.BeginSaveNode, req)).ranks

    async def keep_alive_node(self, node: str, reqs: Any) -> Any:
        req = pb.NodeKeepAliveRequest(node=node, ranks=reqs)
        return (await self._rpc("KeepAliveNode", self.stub.KeepAliveNode, req)).ranks

    async def report_shards_node(self, node: str, reqs: Any) -> Any:
        req = pb.NodeReportRequest(node=node, ranks=reqs)
        got = (await self._rpc("ReportShardsNode", self.stub.ReportShardsNode, req)).ranks
        if not self.label:  # the session's own marks count its unary calls
            self.soak.last_report_t = max(self.soak.last_report_t, time.perf_counter())
        return got

    async def await_commit(self, req: pb.AwaitCommitRequest) -> pb.SaveStatus:
        kind = "AwaitCommit(kill round)" if self.soak.kill_round else "AwaitCommit"
        got = await self._rpc(kind, self.stub.AwaitCommit, req, CALL_TIMEOUT_S + 30)
        if not self.label:
            self.soak.await_answers.append(time.perf_counter())
        return got

    async def abort_save(self, req: pb.AbortSaveRequest) -> pb.SaveStatus:
        return await self._rpc("AbortSave", self.stub.AbortSave, req)


class TimedSession:
    """A node session's calls as the aggregator sees them (on the stream, or by unary when
    the stream could not), timed and counted under the unary call's name."""

    def __init__(self, soak: Soak, session: SessionUpstream):
        self.soak, self.session = soak, session

    async def _timed(self, kind: str, call: Any) -> Any:
        t0 = time.perf_counter()
        try:
            got = await call
        except CkptError as e:
            self.soak.errors[f"{kind}:{type(e).__name__}"] += 1
            if len(self.soak.error_samples) < 10:
                self.soak.error_samples.append(f"{kind}: {e}")
            raise
        self.soak.latency[kind].append(time.perf_counter() - t0)
        return got

    async def begin_save(self, req: pb.BeginSaveRequest) -> pb.BeginSaveResponse:
        return await self.session.begin_save(req)  # timed by the unary upstream

    async def begin_save_node(self, node: str, reqs: Any) -> Any:
        return await self._timed("BeginSaveNode", self.session.begin_save_node(node, reqs))

    async def keep_alive_node(self, node: str, reqs: Any) -> Any:
        return await self._timed("KeepAliveNode", self.session.keep_alive_node(node, reqs))

    async def report_shards_node(self, node: str, reqs: Any) -> Any:
        got = await self._timed("ReportShardsNode", self.session.report_shards_node(node, reqs))
        self.soak.last_report_t = max(self.soak.last_report_t, time.perf_counter())
        return got

    async def await_commit(self, req: pb.AwaitCommitRequest) -> pb.SaveStatus:
        kind = "AwaitCommit(kill round)" if self.soak.kill_round else "AwaitCommit"
        got = await self._timed(kind, self.session.await_commit(req))
        self.soak.await_answers.append(time.perf_counter())
        return got

    async def abort_save(self, req: pb.AbortSaveRequest) -> pb.SaveStatus:
        return await self.session.abort_save(req)  # timed by the unary upstream


# -- the run -------------------------------------------------------------------------------
def kill_plan(args: argparse.Namespace, index: int, rng_seed: int) -> dict[int, str]:
    """Victims of round `index` (0-based): every kill_every'th round, `kills` ranks."""
    if args.kill_every <= 0 or index % args.kill_every != args.kill_every - 1:
        return {}
    k = min(args.kills, args.ranks - 1)
    rng = random.Random(rng_seed * 1_000_003 + index)
    ranks = rng.sample(range(args.ranks), k)
    victims = {r: MOMENTS[i % len(MOMENTS)] for i, r in enumerate(sorted(ranks))}
    per_node = max(1, args.ranks_per_node)
    nodes = -(-args.ranks // per_node)
    if per_node > 1 and nodes > 1 and (index // args.kill_every) % 2 == 1:
        # A whole node instead, aggregator included: only the coordinator's lease can end
        # this save (no aggregator is left to notice), and there is no zombie.
        node = rng.randrange(nodes)
        return {
            r: NODE_DEAD for r in range(node * per_node, min(args.ranks, (node + 1) * per_node))
        }
    return victims


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    soak = Soak(args, work)
    t_start = time.perf_counter()
    idle_rss = soak.server.memory().get("VmRSS", 0)
    try:
        await soak.open()
        step, index = 0, 0
        while index < args.min_rounds or time.perf_counter() - t_start < args.seconds:
            if args.max_rounds and index >= args.max_rounds:
                break
            step += 1
            rnd = await soak.round(step, kill_plan(args, index, args.seed))
            index += 1
            print(
                f"round {index:3d} step {step:4d} gen {rnd.generation}: {rnd.outcome:<9} "
                f"{rnd.wall_s:6.2f} s  srv cpu {rnd.server_cpu_s:5.2f} s  "
                f"rss {rnd.rss / C.MiB:5.0f} MiB  audit {rnd.audit_s:5.2f} s"
                + (f"  killed {dict(Counter(rnd.victims.values()))}" if rnd.victims else ""),
                flush=True,
            )
        final = await soak.final_audit()
    except BaseException:
        print(f"--- ckptd serve log ---\n{soak.server.log_tail(20)}", flush=True)
        raise
    finally:
        await soak.close()
    return summarize(soak, args, idle_rss, final, time.perf_counter() - t_start)


def summarize(
    soak: Soak, args: argparse.Namespace, idle_rss: int, final: dict[str, Any], total_s: float
) -> dict[str, Any]:
    rounds = soak.rounds
    rss = [r.rss for r in rounds]
    # Flat: no round after the warm-up above the warm-up's peak by more than the bound (a
    # peak, not one round's value, because the allocator returns memory now and then).
    w = max(1, min(args.warmup_rounds, len(rss)))
    warm = max(rss[:w]) if rss else 0
    growth = max(rss[w:]) - warm if len(rss) > w else 0
    bound = max(args.rss_slack_mib * C.MiB, 0.10 * warm)
    rss_flat = growth <= bound
    if not rss_flat:
        soak.problems["rss growth"].append(
            f"{growth / C.MiB:.1f} MiB above the warm-up peak (bound {bound / C.MiB:.0f} MiB)"
        )
    if soak.errors:  # the zombie's expected refusal is not counted here
        soak.problems["rpc errors"].append(str(dict(soak.errors)))
    round_s = sum(r.wall_s for r in rounds)
    rpcs = sum(len(v) for v in soak.latency.values()) + sum(soak.errors.values())
    lat = {
        kind: {
            "n": len(v),
            "p50_ms": cs._pct(sorted(v), 50) * 1e3,
            "p99_ms": cs._pct(sorted(v), 99) * 1e3,
            "max_ms": max(v) * 1e3,
        }
        for kind, v in sorted(soak.latency.items())
    }
    hot_kinds = ("KeepAlive", "ReportShard", "KeepAliveNode", "ReportShardsNode")
    hot = [v for k, v in soak.latency.items() if k in hot_kinds]
    figures = {
        "ranks": args.ranks,
        "seconds": round(total_s, 1),
        "rounds": len(rounds),
        "rounds_s": round(round_s, 1),
        "saves": sum(1 for r in rounds if r.outcome == "COMMITTED"),
        "aborted": sum(1 for r in rounds if r.outcome == "ABORTED"),
        "kill_rounds": sum(1 for r in rounds if r.victims),
        "node_kill_rounds": sum(1 for r in rounds if NODE_DEAD in r.victims.values()),
        "killed_ranks": sum(len(r.victims) for r in rounds),
        "reports_ok": len(soak.reports),
        "rpcs": rpcs,
        "rpcs_per_s": rpcs / round_s if round_s else 0.0,
        # p99 over the RPCs a rank waits on without a barrier (KeepAlive, ReportShard).
        "p99_ms": cs._pct(sorted(x for v in hot for x in v), 99) * 1e3 if hot else 0.0,
        "lost": len(soak.problems.get("lost", [])),
        "wrongly_committed": len(soak.problems.get("wrongly committed", [])),
        "unexpected_aborts": len(soak.problems.get("unexpected aborts", [])),
        "rpc_errors": sum(soak.errors.values()),
        "rss_mib_idle": idle_rss / C.MiB,
        "rss_mib_first": rss[0] / C.MiB if rss else 0.0,
        "rss_mib_warmup_peak": warm / C.MiB,
        "rss_mib_peak_after_warmup": (warm + growth) / C.MiB,
        "rss_mib_last": rss[-1] / C.MiB if rss else 0.0,
        "rss_flat": rss_flat,
    }
    figures["ranks_per_node"] = max(1, args.ranks_per_node)
    # The slowest RPC kind's p99, over every kind the coordinator answered except the ones
    # that wait by design (BeginSave at the barrier, AwaitCommit for the commit or a lease).
    waits = ("BeginSave", "BeginSaveNode", "AwaitCommit", "AwaitCommit(kill round)")
    figures["p99_ms_worst_kind"] = max(
        (v["p99_ms"] for k, v in lat.items() if k.split("(")[0] not in waits), default=0.0
    )
    # What the waits cost once the coordinator had all it waited for: each AwaitCommit
    # answer of a committed round after the round's last report was answered.
    commit = sorted(soak.commit_latency)
    figures["commit_p50_ms"] = cs._pct(commit, 50) * 1e3 if commit else 0.0
    figures["commit_p99_ms"] = cs._pct(commit, 99) * 1e3 if commit else 0.0
    rank_lat = {
        kind: {
            "n": len(v),
            "p50_ms": cs._pct(sorted(v), 50) * 1e3,
            "p99_ms": cs._pct(sorted(v), 99) * 1e3,
        }
        for kind, v in sorted(soak.rank_latency.items())
    }
    return {
        "figures": figures,
        "latency": lat,
        "rank_latency": rank_lat,
        "rounds": [dataclasses.asdict(r) for r in rounds],
        "zombies": dict(soak.zombies),
        "writes_cut_by_abort": dict(soak.cut_writes),
        "errors": dict(soak.errors),
        "error_samples": soak.error_samples,
        "problems": {k: v[:20] for k, v in soak.problems.items()},
        "final_audit": final,
        "ok": not soak.problems,
    }


def print_report(res: dict[str, Any]) -> None:
    f = res["figures"]
    print(
        f"\n{f['ranks']} ranks, {f['seconds']} s: {f['rounds']} rounds, {f['saves']} committed, "
        f"{f['aborted']} aborted ({f['killed_ranks']} ranks killed in {f['kill_rounds']} rounds); "
        f"{f['rpcs']} RPCs, {f['rpcs_per_s']:.0f} RPC/s"
    )
    if f["ranks_per_node"] > 1:
        print(f"{f['ranks_per_node']} ranks a node: the RPCs below are the node aggregators' calls")
    print(f"{'RPC':<24} {'n':>8} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for kind, v in res["latency"].items():
        print(f"{kind:<24} {v['n']:>8} {v['p50_ms']:>9.1f} {v['p99_ms']:>9.1f} {v['max_ms']:>9.1f}")
    for kind, v in res["rank_latency"].items():
        name = f"rank -> node {kind}"
        print(f"{name:<24} {v['n']:>8} {v['p50_ms']:>9.1f} {v['p99_ms']:>9.1f}")
    print(
        f"commit latency (AwaitCommit answers after a committed round's last report): p50 "
        f"{f['commit_p50_ms']:.1f} ms, p99 {f['commit_p99_ms']:.1f} ms; worst p99 of the "
        f"calls that do not wait by design: {f['p99_ms_worst_kind']:.1f} ms"
    )
    print(
        f"coordinator RSS MiB: idle {f['rss_mib_idle']:.0f}, first round {f['rss_mib_first']:.0f},"
        f" warm-up peak {f['rss_mib_warmup_peak']:.0f}, later peak"
        f" {f['rss_mib_peak_after_warmup']:.0f}, last {f['rss_mib_last']:.0f}"
        f" ({'flat' if f['rss_flat'] else 'GROWING'})"
    )
    print(f"zombie reports: {res['zombies']}; writes cut by an abort: {res['writes_cut_by_abort']}")
    print(
        f"lost {f['lost']}, wrongly committed {f['wrongly_committed']}, unexpected aborts "
        f"{f['unexpected_aborts']}, RPC errors {f['rpc_errors']}"
    )
    for kind, items in res["problems"].items():
        print(f"PROBLEM {kind}: {items[:3]}")
    print("PASS" if res["ok"] else "FAIL")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=120.0, help="start no round after this")
    p.add_argument("--min-rounds", type=int, default=0, help="run at least this many rounds")
    p.add_argument("--max-rounds", type=int, default=0, help="and at most this many (0: no cap)")
    p.add_argument("--lease", type=float, default=20.0, help="coordinator lease, seconds")
    p.add_argument("--kill-every", type=int, default=3, help="every k'th round kills ranks")
    p.add_argument("--kills", type=int, default=3, help="ranks killed in such a round")
    p.add_argument("--keep-last", type=int, default=2, help="retention: committed steps kept")
    p.add_argument("--channels", type=int, default=8)
    p.add_argument(
        "--ranks-per-node", type=int, default=1, help="ranks behind each node aggregator"
    )
    p.add_argument(
        "--node-calls",
        choices=("session", "unary"),
        default="session",
        help="node aggregators' calls: on one node session each (as ckptd's) or unary",
    )
    p.add_argument("--chunk-bytes", type=int, default=64)
    p.add_argument("--io-threads", type=int, default=16)
    p.add_argument("--warmup-rounds", type=int, default=3, help="RSS baseline after these")
    p.add_argument("--rss-slack-mib", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-soak", help="work dir")
    p.add_argument("--no-results", action="store_true", help="do not write the JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.dir))
    print(f"work dir {work}; {args.ranks} ranks for {args.seconds:.0f} s, lease {args.lease} s")
    load_before = os.getloadavg()
    try:
        res = asyncio.run(run(args, work))
    finally:
        C.remove(work)
    res["loadavg_before_after"] = [load_before, os.getloadavg()]
    print_report(res)
    if not args.no_results:
        data = {
            "benchmark": "load_soak",
            "machine": C.machine_info(args.dir),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **res,
        }
        print(f"results: {C.write_results('load_soak', data)}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
