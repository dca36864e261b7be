"""How the coordinator scales with the number of ranks: N simulated ranks, one real server.

The server is a real `ckptd serve` in a subprocess (so the simulated ranks' CPU does not
count as the coordinator's, and its RSS is its own), on 127.0.0.1, one fresh server and
catalog per N. The ranks are asyncio coroutines in this process, sharing a few grpc.aio
channels (each its own TCP connection), and run the whole save protocol with the same
messages the Python client sends: OpenJob once per N, then per step and rank BeginSave ->
(write the shard and its index with ckptd.format.writer.write_shard, verify="size") ->
ReportShard -> AwaitCommit.

Each rank's plan has 4 tiny uint8 chunks, so dedup, tiling and state merging all work:
  shared/w0, shared/w1   replicated on every rank, equal hashes (written once, by one rank)
  sharded/w              one global tensor cut Shard(0) across all ranks (N distinct boxes)
  rng/@rank<r>           a per-rank tensor under a PerRank state node
  layers/<k>             --keys more tensors cut like sharded/w (a model's many parameters)
The ranks' state trees are equal except the per-rank node, as ckpt's flatten makes them.

By default the phases are separated by client-side barriers, so the coordinator's time
can be told apart from the ranks' file I/O:
  begin    first BeginSave sent -> last BeginSave answered (plans in, planning, answers out)
  rank I/O every rank writes + fsyncs its shard and index (coordinator idle)
  report   first ReportShard sent -> last ReportShard answered (the coordinator stats and
           parses every index, catalog group commits)
  commit   last ReportShard answered -> last AwaitCommit answered (manifest written)
  coordinator work = begin + report + commit; wall = first BeginSave -> last AwaitCommit.
Commit latency of a rank = its AwaitCommit answer - the last ReportShard answer.
--pipelined instead lets each rank report as soon as its own write is done (as real ranks
do); then only wall, commit latency and CPU times are meaningful.

The server's CPU time (/proc/<pid>/stat) is sampled at every phase boundary, and its
VmRSS/VmHWM (/proc/<pid>/status) after every step. Medians over --steps steps (after
--warmup unmeasured ones). Targets (PASS/FAIL): a 1024-rank save's coordinator work
within 2 s; p99 commit latency growing no faster than linearly in N. A save that fails
(e.g. an RPC the server cancelled) is reported as FAILED for its N and the run goes on.

--ranks-per-node K (default 8) groups the ranks into nodes of K, each with its node
aggregator: the real ckptd.server.node.NodeBatcher (the logic `NodeAggregator` serves to a
node's ranks over 127.0.0.1), called directly by the node's simulated ranks with the
messages they would send it, and sending BeginSaveNode / ReportShardsNode / AwaitCommit
upstream over the shared channels: one call per node and phase, each a message on the
node's one long-lived NodeSession stream (ckptd.server.node_session, as the real
aggregator sends them), or with --node-calls unary one unary RPC each (how they went
before the session). --ranks-per-node 1 is the per-rank protocol (every rank calls the
coordinator itself). RPCs counts the calls the coordinator answered during the save,
unary or carried by a session.

--grpc-pending-limit K runs the same `ckptd serve` with gRPC core's server arguments
grpc.server.max_pending_requests(_hard_limit) raised to K (patched into grpc.aio.server in
the server process): with the defaults (1000 soft / 3000 hard) gRPC cancels calls at random
once about 1000 wait to be picked up, which a save of >= ~1000 ranks reaches.
From the second save of each N the ranks send cached plans (the layout's digest and the
chunks' digests, as ckpt's client does); --no-plan-cache sends whole plans every save.
--profile-server DIR writes a cProfile of the coordinator's event-loop thread per N.

    .venv/bin/python bench/coordinator_scale.py [--ranks 64,256,1024,4096] [--steps 5]
        [--ranks-per-node 8] [--grpc-pending-limit 100000] [--pipelined] [--no-plan-cache]
        [--profile-server DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common as C
import grpc
import numpy as np

from ckptd.coordinator.layouts import layout_digest
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import ShardReport
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing
from ckptd.format.writer import WriteItem, write_shard
from ckptd.server import converters as cv
from ckptd.server.node import NodeBatcher
from ckptd.server.node_session import SessionUpstream
from ckptd.storage import open_storage
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

CLK_TCK = os.sysconf("SC_CLK_TCK")
# `ckptd serve` with gRPC core's pending-call limit raised (grpc.server.max_pending_requests,
# default 1000 soft / 3000 hard, above which new calls are cancelled at random): what the
# coordinator would do if create_server() set it. Only with --grpc-pending-limit.
PATCHED_SERVE = """\
import sys
import grpc

LIMIT = {limit}
_server = grpc.aio.server


def server(*args, **kwargs):
    opts = list(kwargs.pop("options", None) or [])
    opts += [
        ("grpc.server.max_pending_requests", LIMIT),
        ("grpc.server.max_pending_requests_hard_limit", LIMIT),
    ]
    return _server(*args, options=opts, **kwargs)


grpc.aio.server = server
from ckptd.cli.serve import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
"""
CALL_TIMEOUT_S = 900.0


# -- the coordinator process ---------------------------------------------------------------
class Server:
    """`ckptd serve` in a subprocess, with its CPU time and memory readable from /proc."""

    def __init__(
        self,
        root: Path,
        lease_s: float,
        log_path: Path,
        profile: Path | None = None,
        pending_limit: int = 0,
    ):
        root.mkdir(parents=True, exist_ok=True)
        port_file = root.parent / f"{root.name}.port"
        port_file.unlink(missing_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "w")  # closed in stop()
        prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
        entry = ["-m", "ckptd.cli.serve"]
        if pending_limit:
            script = root.parent / "patched_serve.py"
            script.write_text(PATCHED_SERVE.format(limit=int(pending_limit)))
            entry = [str(script)]
        cmd = [
            sys.executable,
            *prof,
            *entry,
            "serve",
            "--root",
            str(root),
            "--create-root",
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--insecure-no-token",
            "--lease",
            str(lease_s),
            "--barrier-timeout",
            str(max(600.0, lease_s)),
        ]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ckptd serve did not start:\n{self.log_tail()}")
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        self.address = f"127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime

    def memory(self) -> dict[str, int]:
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
        return out

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))

    def log_tail(self, n: int = 40) -> str:
        self._log.flush()
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- the simulated ranks ---------------------------------------------------------------------
class Rank:
    """One simulated rank's plan for one step: items, block digests, BeginSave request."""

    def __init__(
        self,
        rank: int,
        world: int,
        step: int,
        chunk_bytes: int,
        shared: list[WriteItem],
        keys: int = 0,
    ):
        self.rank = rank
        b = chunk_bytes
        mine = np.full(b, (rank * 7 + step) % 251, dtype=np.uint8)
        mine[:8] = np.frombuffer(rank.to_bytes(4, "little") * 2, dtype=np.uint8)
        rng = np.full(b, (rank * 13 + step) % 253, dtype=np.uint8)
        rng[:8] = mine[:8]
        self.items = [
            *shared,
            WriteItem("sharded/w", "uint8", [world * b], [rank * b], [b], mine),
            WriteItem(f"rng/@rank{rank}", "uint8", [b], [0], [b], rng),
            *(
                WriteItem(f"layers/{k}", "uint8", [world * b], [rank * b], [b], mine)
                for k in range(keys)
            ),
        ]
        self.digests = [[hashing.digest(it.data)] for it in self.items]
        self.state = {
            "dict": [
                [
                    "shared",
                    {
                        "dict": [
                            ["w0", {"tensor": "shared/w0"}],
                            ["w1", {"tensor": "shared/w1"}],
                        ]
                    },
                ],
                ["sharded", {"dict": [["w", {"tensor": "sharded/w"}]]}],
                ["rng", {"per_rank": [[rank, {"tensor": f"rng/@rank{rank}"}]]}],
                ["step", step],
            ]
        }
        if keys:
            layers = [[str(k), {"tensor": f"layers/{k}"}] for k in range(keys)]
            self.state["dict"].append(["layers", {"dict": layers}])

    def begin_request(self, ref: pb.SaveRef, cached: bool = False) -> pb.BeginSaveRequest:
        """As CoordinatorClient.begin_save sends it; `cached`: the layout's digest and the
        chunks' digests only (the coordinator holds this rank's layout from a save before)."""
        plan = ChunkPlan.of_items(self.items, self.digests)
        state, rank_state = cv.state_fields(self.state)
        return pb.BeginSaveRequest(
            ref=ref,
            chunks=[] if cached else [cv.chunk_to_pb(c) for c in plan],
            digests=b"".join(bytes.fromhex(c.blake3) for c in plan) if cached else b"",
            layout_digest=layout_digest(plan),
            part=0,
            parts=1,
            state=state,
            rank_state=rank_state,
            metadata=json.dumps({"bench": "coordinator_scale"}).encode(),
            timeout_ms=int(CALL_TIMEOUT_S * 1000),
        )


def shared_items(step: int, chunk_bytes: int) -> list[WriteItem]:
    b = chunk_bytes
    w0 = np.full(b, (step + 1) % 256, dtype=np.uint8)
    w1 = np.arange(2 * b, dtype=np.uint8) ^ np.uint8(step % 256)
    return [
        WriteItem("shared/w0", "uint8", [b], [0], [b], w0),
        WriteItem("shared/w1", "uint8", [2 * b], [0], [2 * b], w1),
    ]


class Failed(Exception):
    pass


def check_status(st: pb.SaveStatus, what: str) -> None:
    if st.status == pb.ABORTED:
        raise Failed(f"{what}: the save was aborted: {st.reason}")


RPCS = [0]  # calls made to the coordinator


async def call(fn: Any, req: Any, what: str, timeout: float = CALL_TIMEOUT_S) -> Any:
    RPCS[0] += 1
    try:
        return await fn(req, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        raise Failed(f"{what}: {e.code().name}: {e.details()}") from None


async def all_of(coros: Any) -> None:
    """Run concurrently; on the first failure cancel the rest and raise that failure."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


class AioUpstream:
    """A node aggregator's upstream over the bench's grpc.aio channels (ckptd.server.node)."""

    def __init__(self, stub: pb_grpc.CoordinatorStub):
        self.stub = stub

    async def begin_save(self, req: pb.BeginSaveRequest) -> pb.BeginSaveResponse:
        return await call(self.stub.BeginSave, req, f"rank {req.ref.rank} BeginSave")

    async def begin_save_node(self, node: str, reqs: Sequence[Any]) -> Sequence[Any]:
        req = pb.NodeBeginSaveRequest(node=node, ranks=reqs)
        return (await call(self.stub.BeginSaveNode, req, f"node {node} BeginSaveNode")).ranks

    async def keep_alive_node(self, node: str, reqs: Sequence[Any]) -> Sequence[Any]:
        req = pb.NodeKeepAliveRequest(node=node, ranks=reqs)
        return (await call(self.stub.KeepAliveNode, req, f"node {node} KeepAliveNode")).ranks

    async def report_shards_node(self, node: str, reqs: Sequence[Any]) -> Sequence[Any]:
        req = pb.NodeReportRequest(node=node, ranks=reqs)
        return (await call(self.stub.ReportShardsNode, req, f"node {node} ReportShardsNode")).ranks

    async def await_commit(self, req: pb.AwaitCommitRequest) -> pb.SaveStatus:
        return await call(self.stub.AwaitCommit, req, f"rank {req.ref.rank} AwaitCommit", 930)

    async def abort_save(self, req: pb.AbortSaveRequest) -> pb.SaveStatus:
        return await call(self.stub.AbortSave, req, f"rank {req.ref.rank} AbortSave")


# -- one N ---------------------------------------------------------------------------------
class Job:
    def __init__(self, args: argparse.Namespace, world: int, work: Path):
        self.args = args
        self.world = world
        self.root = work / f"root-{world}"
        self.job = f"scale-{world}"
        self.job_path = str((self.root / self.job).resolve())
        profile = None
        if args.profile_server:
            args.profile_server.mkdir(parents=True, exist_ok=True)
            profile = args.profile_server.resolve() / f"coordinator-{world}.pstats"
        self.server = Server(
            self.root,
            args.lease,
            work / f"server-{world}.log",
            profile,
            args.grpc_pending_limit,
        )
        opts = [
            ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel
            ("grpc.max_receive_message_length", 8 << 20),
            ("grpc.max_send_message_length", 8 << 20),
            ("grpc.enable_retries", 0),
        ]
        self.channels = [
            grpc.aio.insecure_channel(self.server.address, options=opts)
            for _ in range(args.channels)
        ]
        self.stubs = [pb_grpc.CoordinatorStub(ch) for ch in self.channels]
        self.pool = ThreadPoolExecutor(args.io_threads, thread_name_prefix="rank-io")
        self.storage = open_storage(self.job_path, create=True)
        self.generation = 0
        self.saves = 0
        self.idle_memory = self.server.memory()
        k = max(1, args.ranks_per_node)
        self.sessions: list[SessionUpstream] = []
        self.nodes = (
            [
                NodeBatcher(
                    self.node_upstream(self.stubs[n % len(self.stubs)]),
                    f"bench/node{n}",
                    range(n * k, min(world, (n + 1) * k)),
                )
                for n in range(-(-world // k))
            ]
            if k > 1
            else []
        )

    def node_upstream(self, stub: pb_grpc.CoordinatorStub) -> Any:
        """A node's upstream: its calls on one node session, as the real aggregator sends
        them (ckptd.server.node_session), or (--node-calls unary) one unary call each."""
        unary = AioUpstream(stub)
        if self.args.node_calls == "unary":
            return unary
        session = SessionUpstream(stub.NodeSession, unary, call_timeout_s=CALL_TIMEOUT_S)
        self.sessions.append(session)
        return session

    def calls_made(self) -> int:
        """Calls made to the coordinator: unary calls, and calls carried by node sessions."""
        return RPCS[0] + sum(s.calls_sent for s in self.sessions)

    def stub(self, rank: int) -> pb_grpc.CoordinatorStub:
        return self.stubs[rank % len(self.stubs)]

    async def open(self) -> None:
        r = await call(
            self.stubs[0].OpenJob,
            pb.OpenJobRequest(job=self.job, attempt=f"bench-{os.getpid()}"),
            "OpenJob",
        )
        self.generation = r.generation
        self.job = r.job  # the coordinator's name for it (relative to its root)

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()
        for ch in self.channels:
            await ch.close()
        self.pool.shutdown()
        self.server.stop()

    def ref(self, step: int, rank: int) -> pb.SaveRef:
        return pb.SaveRef(
            job=self.job,
            step=step,
            generation=self.generation,
            rank=rank,
            world_size=self.world,
        )

    def write(self, step: int, rank: Rank, write: Sequence[int]) -> Any:
        return write_shard(
            self.storage,
            job=self.job_path,
            step=step,
            rank=rank.rank,
            world_size=self.world,
            generation=self.generation,
            items=[rank.items[i] for i in write],
            verify="size",
            digests=[rank.digests[i] for i in write],
            io_threads=1,
        )

    async def save(self, step: int) -> dict[str, Any]:
        """One whole save of `step` by every rank; the times of its phases."""
        n = self.world
        shared = shared_items(step, self.args.chunk_bytes)
        ranks = [Rank(r, n, step, self.args.chunk_bytes, shared, self.args.keys) for r in range(n)]
        cached = self.args.plan_cache and self.saves > 0  # the coordinator holds the layouts
        begin_reqs = [rk.begin_request(self.ref(step, rk.rank), cached) for rk in ranks]
        self.saves += 1
        loop = asyncio.get_running_loop()
        now = time.perf_counter
        srv = self.server
        t_begin_reply = [0.0] * n
        t_report_sent = [0.0] * n
        t_report_reply = [0.0] * n
        t_commit = [0.0] * n
        infos: list[Any] = [None] * n
        writes: list[list[int]] = [[] for _ in range(n)]
        cpu = {"start": srv.cpu_s()}
        rpcs0 = self.calls_made()
        client_cpu0 = time.process_time()

        k = max(1, self.args.ranks_per_node)
        node = (lambda r: self.nodes[r // k]) if self.nodes else None

        async def begin(r: int) -> None:
            if node is not None:
                resp = await node(r).begin_save(begin_reqs[r])
            else:
                resp = await call(self.stub(r).BeginSave, begin_reqs[r], f"rank {r} BeginSave")
            t_begin_reply[r] = now()
            if not resp.complete:
                raise Failed(f"rank {r}: BeginSave answered an incomplete plan")
            writes[r] = list(resp.write)

        async def write(r: int) -> None:
            infos[r] = await loop.run_in_executor(self.pool, self.write, step, ranks[r], writes[r])

        async def report_and_wait(r: int) -> None:
            info = infos[r]
            ref = begin_reqs[r].ref
            req = cv.report_to_pb(ref, ShardReport.of(info, "size"))
            t_report_sent[r] = now()
            if node is not None:
                st = await node(r).report_shard(req)
            else:
                st = await call(self.stub(r).ReportShard, req, f"rank {r} ReportShard")
            t_report_reply[r] = now()
            check_status(st, f"rank {r} ReportShard")
            wait = pb.AwaitCommitRequest(ref=ref, timeout_ms=int(CALL_TIMEOUT_S * 1000))
            if node is not None:
                st = await node(r).await_commit(wait)
            else:
                st = await call(
                    self.stub(r).AwaitCommit, wait, f"rank {r} AwaitCommit", CALL_TIMEOUT_S + 30
                )
            t_commit[r] = now()
            check_status(st, f"rank {r} AwaitCommit")
            if st.status != pb.COMMITTED:
                raise Failed(f"rank {r}: AwaitCommit answered status {st.status}: {st.reason}")

        async def whole_rank(r: int) -> None:
            await begin(r)
            await write(r)
            await report_and_wait(r)

        t0 = now()
        if self.args.pipelined:
            await all_of(whole_rank(r) for r in range(n))
            cpu["end"] = srv.cpu_s()
            t_io0 = t_io1 = t0
        else:
            await all_of(begin(r) for r in range(n))
            cpu["begin"] = srv.cpu_s()
            client_cpu1 = time.process_time()
            t_io0 = now()
            await all_of(write(r) for r in range(n))
            t_io1 = now()
            cpu["io"] = srv.cpu_s()
            client_cpu2 = time.process_time()
            await all_of(report_and_wait(r) for r in range(n))
            cpu["end"] = srv.cpu_s()
        t_end = now()
        client_cpu3 = time.process_time()
        last_report = max(t_report_reply)
        lat = sorted(max(0.0, t - last_report) for t in t_commit)
        mem = srv.memory()
        written = [len(w) for w in writes]
        out: dict[str, Any] = {
            "step": step,
            "wall_s": t_end - t0,
            "commit_phase_s": max(t_commit) - last_report,
            "commit_p50_s": _pct(lat, 50),
            "commit_p99_s": _pct(lat, 99),
            "commit_max_s": lat[-1],
            "server_cpu_s": cpu["end"] - cpu["start"],
            "client_cpu_s": client_cpu3 - client_cpu0,
            "vm_rss": mem.get("VmRSS", 0),
            "vm_hwm": mem.get("VmHWM", 0),
            "server_threads": srv.threads(),
            "chunks_written": sum(written),
            "ranks_writing_nothing": sum(1 for w in written if not w),
            "bytes_written": sum(i.size for i in infos),
            "rpcs": self.calls_made() - rpcs0,
            "begin_request_bytes": sum(q.ByteSize() for q in begin_reqs),
        }
        if not self.args.pipelined:
            begin_s = max(t_begin_reply) - t0
            report_s = last_report - min(t_report_sent)
            out.update(
                {
                    "begin_s": begin_s,
                    "begin_first_reply_s": min(t_begin_reply) - t0,
                    "rank_io_s": t_io1 - t_io0,
                    "report_s": report_s,
                    "coordinator_s": begin_s + report_s + out["commit_phase_s"],
                    "server_cpu_begin_s": cpu["begin"] - cpu["start"],
                    "server_cpu_io_s": cpu["io"] - cpu["begin"],
                    "server_cpu_report_commit_s": cpu["end"] - cpu["io"],
                    "client_cpu_begin_s": client_cpu1 - client_cpu0,
                    "client_cpu_report_commit_s": client_cpu3 - client_cpu2,
                }
            )
            out["rpcs_per_s"] = out["rpcs"] / out["coordinator_s"]
        else:
            out["rpcs_per_s"] = out["rpcs"] / out["wall_s"]
        return out

    def check_committed(self, step: int) -> dict[str, Any]:
        """Read back the manifest of `step` (not timed): every rank's shard, every chunk once."""
        ck = ckfmt.open_checkpoint(self.storage, step)
        m = ck.manifest
        assert m.world_size == self.world and len(m.shards) == self.world, "shards missing"
        return {"manifest_shards": len(m.shards), "generation": m.generation}


def _pct(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, int(-(-p * len(sorted_values) // 100)) - 1))
    return sorted_values[k]


async def run_world(args: argparse.Namespace, world: int, work: Path) -> dict[str, Any]:
    job = Job(args, world, work)
    steps: list[dict[str, Any]] = []
    try:
        await job.open()
        total = args.warmup + args.steps
        for i in range(total):
            os.sync()  # leave no earlier dirty data for this step's fsyncs to flush
            res = await job.save(step=i + 1)
            res["warmup"] = i < args.warmup
            steps.append(res)
            tag = "warmup" if res["warmup"] else f"step {i + 1 - args.warmup}/{args.steps}"
            extra = (
                ""
                if args.pipelined
                else (
                    f" begin {res['begin_s']:.3f} io {res['rank_io_s']:.3f} "
                    f"report {res['report_s']:.3f} commit {res['commit_phase_s']:.3f} "
                    f"coord {res['coordinator_s']:.3f} s"
                )
            )
            print(
                f"N={world:5d} {tag:>11}: wall {res['wall_s']:.3f} s{extra}  "
                f"p99 {res['commit_p99_s'] * 1e3:.1f} ms  srv cpu {res['server_cpu_s']:.2f} s  "
                f"rss {res['vm_rss'] / C.MiB:.0f} MiB  "
                f"BeginSave {res['begin_request_bytes'] / 1024:.0f} KiB",
                flush=True,
            )
        check = job.check_committed(total)
    except Failed as e:
        print(f"N={world:5d} FAILED after {len(steps)} saves: {e}", flush=True)
        print(f"--- ckptd serve log (N={world}) ---\n{job.server.log_tail(12)}", flush=True)
        return {
            "ranks": world,
            "error": str(e),
            "steps": steps,
            "idle_vm_rss": job.idle_memory.get("VmRSS", 0),
        }
    finally:
        await job.close()
        if not args.keep:
            C.remove(job.root)
    measured = [s for s in steps if not s["warmup"]]
    keys = [k for k, v in measured[0].items() if isinstance(v, (int, float)) and k != "step"]
    med = {k: statistics.median(s[k] for s in measured) for k in keys if k != "warmup"}
    return {
        "ranks": world,
        "median": med,
        "steps": steps,
        "idle_vm_rss": job.idle_memory.get("VmRSS", 0),
        "final_vm_hwm": max(s["vm_hwm"] for s in steps),
        "readback": check,
    }


# -- report --------------------------------------------------------------------------------
def report(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    phased = not args.pipelined
    hdr = f"{'ranks':>6} {'wall s':>8}"
    if phased:
        hdr += f" {'begin s':>8} {'rank I/O':>9} {'report s':>9} {'commit s':>9} {'coord s':>8}"
    hdr += (
        f" {'p50 ms':>8} {'p99 ms':>8} {'RPCs':>7} {'RPC/s':>8} {'srv CPU s':>9} {'cli CPU s':>9}"
        f" {'RSS MiB':>8} {'HWM MiB':>8} {'Begin KiB':>9}"
    )
    print(
        f"\nmedians of {args.steps} steps per N (GB = 1e9; MiB = 2^20); "
        f"{'phased (client barriers between phases)' if phased else 'pipelined'}; "
        f"{args.channels} channels; "
        + (
            f"{args.ranks_per_node} ranks a node (node aggregators)"
            if args.ranks_per_node > 1
            else "per-rank RPCs (no node aggregators)"
        )
    )
    print(hdr)
    print("-" * len(hdr))
    ok_results = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print(f"{r['ranks']:>6} FAILED: {r['error'][:100]}")
            continue
        m = r["median"]
        line = f"{r['ranks']:>6} {m['wall_s']:>8.3f}"
        if phased:
            line += (
                f" {m['begin_s']:>8.3f} {m['rank_io_s']:>9.3f} {m['report_s']:>9.3f}"
                f" {m['commit_phase_s']:>9.3f} {m['coordinator_s']:>8.3f}"
            )
        line += (
            f" {m['commit_p50_s'] * 1e3:>8.1f} {m['commit_p99_s'] * 1e3:>8.1f}"
            f" {m['rpcs']:>7.0f} {m['rpcs_per_s']:>8.0f} {m['server_cpu_s']:>9.2f} {m['client_cpu_s']:>9.2f}"
            f" {m['vm_rss'] / C.MiB:>8.0f} {r['final_vm_hwm'] / C.MiB:>8.0f}"
            f" {m['begin_request_bytes'] / 1024:>9.0f}"
        )
        print(line)
    if phased and ok_results:
        print(
            "\nserver CPU by phase (median s): "
            + "; ".join(
                f"N={r['ranks']}: begin {r['median']['server_cpu_begin_s']:.2f}, "
                f"report+commit {r['median']['server_cpu_report_commit_s']:.2f}"
                for r in ok_results
            )
        )
    limit = args.grpc_pending_limit
    print(
        "coordinator: "
        + (
            "stock `ckptd serve`"
            if not limit
            else f"`ckptd serve` with grpc.server.max_pending_requests raised to {limit}"
        )
        + f"; idle RSS {statistics.median(r['idle_vm_rss'] for r in results) / C.MiB:.0f} MiB"
    )
    checks: dict[str, Any] = {}
    by_n = {r["ranks"]: r for r in results}
    if 1024 in by_n:
        key = "coordinator_s" if phased else "wall_s"
        r = by_n[1024]
        v = r["median"][key] if "error" not in r else float("inf")
        checks["coordinator_work_1024_within_2s"] = {
            "value_s": v if "error" not in r else None,
            "metric": key,
            "error": r.get("error"),
            "pass": v <= 2.0,
        }
        what = "coordinator work" if phased else "wall (pipelined: includes rank I/O)"
        shown = f"{v:.3f} s" if "error" not in r else "the save failed"
        print(
            f"\n[{'PASS' if v <= 2.0 else 'FAIL'}] 1024-rank save, {what}: {shown} (target <= 2 s)"
        )
    else:
        print("\n[SKIP] 1024-rank target: 1024 is not among --ranks")
    ns = sorted(by_n)
    if len(ns) >= 2 and "error" not in by_n[ns[0]]:
        n0 = ns[0]
        p0 = by_n[n0]["median"]["commit_p99_s"]
        lin = []
        for n in ns[1:]:
            if "error" in by_n[n]:
                lin.append({"ranks": n, "error": by_n[n]["error"], "pass": False})
                print(f"[FAIL] p99 commit latency N={n}: the save failed")
                continue
            p = by_n[n]["median"]["commit_p99_s"]
            ratio = p / p0 if p0 > 0 else float("inf")
            ok = ratio <= n / n0
            lin.append({"ranks": n, "p99_ratio": ratio, "n_ratio": n / n0, "pass": ok})
            print(
                f"[{'PASS' if ok else 'FAIL'}] p99 commit latency N={n} vs N={n0}: "
                f"{p * 1e3:.1f} / {p0 * 1e3:.1f} ms = x{ratio:.2f} (linear would be x{n / n0:.0f})"
            )
        checks["p99_commit_latency_at_most_linear"] = {
            "base_ranks": n0,
            "per_n": lin,
            "pass": all(x["pass"] for x in lin),
        }
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", default="64,256,1024,4096", help="comma-separated rank counts")
    p.add_argument("--steps", type=int, default=5, help="measured saves per N (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured saves per N first")
    p.add_argument("--channels", type=int, default=8, help="grpc.aio channels shared by ranks")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=8,
        help="ranks a node aggregator batches (1: every rank calls the coordinator)",
    )
    p.add_argument(
        "--node-calls",
        choices=("session", "unary"),
        default="session",
        help="how the node aggregators call the coordinator: one node session stream each "
        "(as ckptd's aggregator does) or one unary call per node and phase (before it)",
    )
    p.add_argument("--chunk-bytes", type=int, default=64, help="bytes of each chunk")
    p.add_argument(
        "--keys", type=int, default=0, help="more keys per rank, each cut Shard(0) like sharded/w"
    )
    p.add_argument("--io-threads", type=int, default=16, help="threads writing rank files")
    p.add_argument("--lease", type=float, default=600.0, help="coordinator lease (no keepalives)")
    p.add_argument("--pipelined", action="store_true", help="no barriers between phases")
    p.add_argument(
        "--no-plan-cache",
        dest="plan_cache",
        action="store_false",
        help="send every rank's whole plan at every save (as a first save does), not the "
        "cached plan (layout digest + chunk digests) from the second save on",
    )
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-coord", help="work dir")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint files")
    p.add_argument(
        "--grpc-pending-limit",
        type=int,
        default=0,
        help="run the coordinator with gRPC's grpc.server.max_pending_requests(_hard_limit) "
        "raised to this (0: stock `ckptd serve`, whose gRPC default cancels calls beyond ~1000 "
        "waiting to be picked up)",
    )
    p.add_argument(
        "--profile-server",
        type=Path,
        help="run the coordinator under cProfile (its event loop thread); pstats files here",
    )
    args = p.parse_args(argv)
    worlds = [int(x) for x in args.ranks.split(",") if x.strip()]
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.dir))
    print(f"work dir {work}; ranks {worlds}; {args.steps} steps (+{args.warmup} warmup)")
    results = []
    load_before = os.getloadavg()
    try:
        for n in worlds:
            results.append(asyncio.run(run_world(args, n, work)))
        checks = report(results, args)
    finally:
        if not args.keep:
            C.remove(work)
    data = {
        "benchmark": "coordinator_scale",
        "machine": C.machine_info(args.dir),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "definitions": {
            "wall_s": "first BeginSave sent -> last AwaitCommit answered (includes rank I/O)",
            "begin_s": "first BeginSave sent -> last BeginSave answered",
            "rank_io_s": "all simulated ranks write+fsync shard and index (coordinator idle)",
            "report_s": "first ReportShard sent -> last ReportShard answered",
            "commit_phase_s": "last ReportShard answered -> last AwaitCommit answered",
            "coordinator_s": "begin_s + report_s + commit_phase_s",
            "commit_p50_s/p99_s": "per rank: AwaitCommit answer - last ReportShard answer",
            "rpcs": "calls the coordinator answered during the save, unary or on node sessions "
            "(3 per rank, 3 per node)",
            "begin_request_bytes": "serialized BeginSave requests of all ranks (cached plans "
            "from the second save on unless --no-plan-cache)",
            "rpcs_per_s": "rpcs / coordinator_s",
            "server_cpu_s": "coordinator process utime+stime over the save",
            "vm_rss/vm_hwm": "coordinator /proc/<pid>/status after the step",
        },
        "results": results,
        "checks": checks,
        "loadavg_before_after": [load_before, os.getloadavg()],
    }
    print(f"\nresults: {C.write_results('coordinator_scale', data)}")
    failed = [r["ranks"] for r in results if "error" in r]
    return 0 if not failed and all(c.get("pass", True) for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
