"""The node aggregator: a node's ranks talk to it, and it talks to the coordinator once.

It runs on a node's local rank 0 (ckpt wires it in under torchrun; docs/coordinator.md,
"Nodes, not ranks"). The node's ranks speak the per-rank save protocol to it, unchanged
(BeginSave, KeepAlive, ReportShard, AwaitCommit, AbortSave: the same CoordinatorClient,
pointed at the aggregator's 127.0.0.1 port, with the job's token), and it makes one call
per node and phase upstream:

    BeginSave (last part)  gathered until every local rank sent it (or `linger_s` after the
                           first), sent as one BeginSaveNode; earlier parts pass through
    ReportShard            gathered likewise, sent as one ReportShardsNode
    KeepAlive              answered here from the save's last known status; every lease/3
                           one KeepAliveNode lists the ranks heard from within the lease
    AwaitCommit            one upstream wait per save, its answer fanned out
    AbortSave              passed through

A rank silent for two thirds of the lease (its process died or hung) is not renewed and
the aggregator aborts the save naming it and the node, within the lease; a dead aggregator
is a dead node (every one of its ranks' leases runs out at the coordinator, which says so).
A rank outside the node's ranks is refused here; one that another node already spoke for
is refused by the coordinator (Session.claim).

`NodeBatcher` is the transport-free logic over an `Upstream` (the real one sends the node
calls on one long-lived stream, ckptd.server.node_session, and everything the stream cannot
carry by the synchronous CoordinatorClient, with its retries across a coordinator restart,
in threads);
`NodeAggregator` serves it over grpc.aio on a private event loop thread. The bench's
simulated ranks call a NodeBatcher directly (bench/coordinator_scale.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from ckptd.errors import CkptError, InvalidRequest, SaveAborted
from ckptd.server.auth import TokenAuthInterceptor
from ckptd.server.client import CoordinatorClient
from ckptd.server.node_session import SessionUpstream
from ckptd.server.servicer import translated
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("ckptd.node")

LINGER_S = 0.5  # how long a batch waits for a node's slower ranks before it goes anyway
FINAL = (pb.COMMITTED, pb.ABORTED)


class Upstream(Protocol):
    """The coordinator as the aggregator calls it: wire messages in and out."""

    async def begin_save(self, req: pb.BeginSaveRequest) -> pb.BeginSaveResponse: ...
    async def begin_save_node(
        self, node: str, reqs: Sequence[pb.BeginSaveRequest]
    ) -> Sequence[pb.BeginSaveResponse]: ...
    async def keep_alive_node(
        self, node: str, reqs: Sequence[pb.KeepAliveRequest]
    ) -> Sequence[pb.SaveStatus]: ...
    async def report_shards_node(
        self, node: str, reqs: Sequence[pb.ReportShardRequest]
    ) -> Sequence[pb.SaveStatus]: ...
    async def await_commit(self, req: pb.AwaitCommitRequest) -> pb.SaveStatus: ...
    async def abort_save(self, req: pb.AbortSaveRequest) -> pb.SaveStatus: ...


class ClientUpstream:
    """The real upstream: CoordinatorClient's calls (retries, error classes) in threads."""

    def __init__(self, client: CoordinatorClient):
        self.client = client

    async def begin_save(self, req: pb.BeginSaveRequest) -> pb.BeginSaveResponse:
        return await asyncio.to_thread(self.client.begin_save_pb, req)

    async def begin_save_node(
        self, node: str, reqs: Sequence[pb.BeginSaveRequest]
    ) -> Sequence[pb.BeginSaveResponse]:
        return await asyncio.to_thread(self.client.begin_save_node, node, reqs)

    async def keep_alive_node(
        self, node: str, reqs: Sequence[pb.KeepAliveRequest]
    ) -> Sequence[pb.SaveStatus]:
        return await asyncio.to_thread(self.client.keep_alive_node, node, reqs)

    async def report_shards_node(
        self, node: str, reqs: Sequence[pb.ReportShardRequest]
    ) -> Sequence[pb.SaveStatus]:
        return await asyncio.to_thread(self.client.report_shards_node, node, reqs)

    async def await_commit(self, req: pb.AwaitCommitRequest) -> pb.SaveStatus:
        return await asyncio.to_thread(self.client.await_commit_pb, req)

    async def abort_save(self, req: pb.AbortSaveRequest) -> pb.SaveStatus:
        return await asyncio.to_thread(self.client.abort_save_pb, req)


class _Batch:
    """Messages of one phase of one save waiting to go upstream together."""

    def __init__(self) -> None:
        self.items: dict[int, tuple[Any, asyncio.Future[Any]]] = {}
        self.timer: asyncio.TimerHandle | None = None


@dataclasses.dataclass
class _Save:
    """What the aggregator holds of one save of its node."""

    key: tuple[str, int, int]
    begin: _Batch = dataclasses.field(default_factory=_Batch)
    report: _Batch = dataclasses.field(default_factory=_Batch)
    refs: dict[int, pb.SaveRef] = dataclasses.field(default_factory=dict)  # begun ranks
    reported: set[int] = dataclasses.field(default_factory=set)
    begun: set[int] = dataclasses.field(default_factory=set)  # ranks whose BeginSave went up
    reported_sent: set[int] = dataclasses.field(default_factory=set)
    last_seen: dict[int, float] = dataclasses.field(default_factory=dict)
    status: dict[int, pb.SaveStatus] = dataclasses.field(default_factory=dict)
    lease_s: float = 0.0
    timeout_ms: int = 0
    pinger: asyncio.Task[None] | None = None
    waiter: asyncio.Task[pb.SaveStatus] | None = None
    final: pb.SaveStatus | None = None


def _key(ref: pb.SaveRef) -> tuple[str, int, int]:
    return (ref.job, ref.step, ref.generation)


class NodeBatcher:
    """The aggregator's logic on one event loop: per-rank messages in, node batches out."""

    def __init__(
        self,
        upstream: Upstream,
        node: str,
        ranks: Sequence[int],
        *,
        linger_s: float = LINGER_S,
    ):
        self.upstream, self.node, self.ranks = upstream, node, frozenset(ranks)
        self.linger_s = linger_s
        self.saves: dict[tuple[str, int, int], _Save] = {}

    def _save(self, ref: pb.SaveRef, what: str) -> _Save:
        if ref.rank not in self.ranks:
            raise InvalidRequest(
                f"job {ref.job!r} step {ref.step}: rank {ref.rank} sent {what} to the aggregator "
                f"of node {self.node!r}, whose ranks are {sorted(self.ranks)[:16]}; a rank "
                "joins through its own node's aggregator (check RANK, LOCAL_RANK, GROUP_RANK)"
            )
        key = _key(ref)
        s = self.saves.get(key)
        if s is None:
            s = self.saves[key] = _Save(key)
            # Keep a handful of ended saves for late keep-alives; drop the oldest.
            ended = [k for k, x in self.saves.items() if x.final is not None]
            for k in ended[: max(0, len(ended) - 8)]:
                del self.saves[k]
        return s

    # -- batching ----------------------------------------------------------------------
    def _add(self, s: _Save, batch: _Batch, rank: int, item: Any, want: set[int]) -> Any:
        """Queue `item` of `rank`; the batch goes once it holds every rank of `want` not
        sent before (`s.sent`), else `linger_s` after its first item."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        old = batch.items.pop(rank, None)
        if old is not None:  # a retry of a call still waiting: the newer one answers both
            fut.add_done_callback(functools.partial(_copy, dst=old[1]))
        batch.items[rank] = (item, fut)
        sent = s.begun if batch is s.begin else s.reported_sent
        if want <= sent | set(batch.items):
            self._flush(s, batch)
        elif batch.timer is None:
            batch.timer = asyncio.get_running_loop().call_later(
                self.linger_s, self._flush, s, batch
            )
        return fut

    def _flush(self, s: _Save, batch: _Batch) -> None:
        if batch.timer is not None:
            batch.timer.cancel()
            batch.timer = None
        items, batch.items = batch.items, {}
        if not items:
            return
        ranks = sorted(items)
        (s.begun if batch is s.begin else s.reported_sent).update(ranks)
        reqs = [items[r][0] for r in ranks]
        futs = [items[r][1] for r in ranks]
        send = self._send_begin if batch is s.begin else self._send_reports
        asyncio.get_running_loop().create_task(send(s, ranks, reqs, futs))

    async def _send_begin(
        self, s: _Save, ranks: list[int], reqs: list[Any], futs: list[asyncio.Future[Any]]
    ) -> None:
        try:
            answers = list(await self.upstream.begin_save_node(self.node, reqs))
            if len(answers) != len(reqs):
                raise CkptError(f"node {self.node!r}: BeginSaveNode answered {len(answers)}")
        except BaseException as e:
            s.begun.difference_update(ranks)  # their retries form the next batch
            _fail_all(futs, e)
            return
        now = time.monotonic()
        for r, a in zip(ranks, answers, strict=True):
            s.last_seen[r] = now
            s.lease_s = s.lease_s or a.lease_ms / 1000
        if s.pinger is None and s.lease_s > 0:
            s.pinger = asyncio.get_running_loop().create_task(self._ping(s))
        for f, a in zip(futs, answers, strict=True):
            if not f.done():
                f.set_result(a)

    async def _send_reports(
        self, s: _Save, ranks: list[int], reqs: list[Any], futs: list[asyncio.Future[Any]]
    ) -> None:
        try:
            answers = list(await self.upstream.report_shards_node(self.node, reqs))
            if len(answers) != len(reqs):
                raise CkptError(f"node {self.node!r}: ReportShardsNode answered {len(answers)}")
        except BaseException as e:
            s.reported.difference_update(ranks)  # the ranks retry or abort themselves
            s.reported_sent.difference_update(ranks)
            _fail_all(futs, e)
            return
        for r, f, a in zip(ranks, futs, answers, strict=True):
            s.status[r] = a
            if not f.done():
                f.set_result(a)

    async def _ping(self, s: _Save) -> None:
        """The node's lease: renew the ranks heard from; abort naming a silent one."""
        every = max(0.05, s.lease_s / 3)
        while s.final is None:
            await asyncio.sleep(every)
            if s.final is not None or any(a.status in FINAL for a in s.status.values()):
                return  # ended while asleep (another node aborted it, say)
            now = time.monotonic()
            waiting = [r for r in sorted(s.refs) if r not in s.reported]
            if not waiting:
                return
            silent = [r for r in waiting if now - s.last_seen.get(r, now) > s.lease_s * 2 / 3]
            if silent:
                await self._abort_silent(s, silent)
                return
            try:
                reqs = [pb.KeepAliveRequest(ref=s.refs[r]) for r in waiting]
                answers = await self.upstream.keep_alive_node(self.node, reqs)
            except CkptError as e:
                log.debug("node %s: keep-alive failed: %s", self.node, e)
                continue
            for r, a in zip(waiting, answers, strict=True):
                s.status[r] = a
            if any(a.status in FINAL for a in answers):
                return

    async def _abort_silent(self, s: _Save, silent: list[int]) -> None:
        r = silent[0]
        reason = (
            f"rank(s) {', '.join(map(str, silent))} of node {self.node!r} stopped renewing "
            f"their lease with the node's aggregator for over {s.lease_s * 2 / 3:.1f}s "
            "(the process died or hung)"
        )
        log.warning("node %s: aborting job %s step %d: %s", self.node, s.key[0], s.key[1], reason)
        try:
            st = await self.upstream.abort_save(pb.AbortSaveRequest(ref=s.refs[r], reason=reason))
        except CkptError as e:
            log.warning("node %s: could not abort the save: %s", self.node, e)
            return
        for x in s.refs:
            s.status[x] = st

    # -- the per-rank RPCs -------------------------------------------------------------
    async def begin_save(self, req: pb.BeginSaveRequest) -> pb.BeginSaveResponse:
        s = self._save(req.ref, "BeginSave")
        if req.part + 1 < max(1, req.parts):  # an earlier part of a large plan: as it is
            return await self.upstream.begin_save(req)
        s.refs[req.ref.rank] = req.ref
        s.timeout_ms = max(s.timeout_ms, req.timeout_ms)
        return await self._add(s, s.begin, req.ref.rank, req, set(self.ranks))

    async def keep_alive(self, req: pb.KeepAliveRequest) -> pb.SaveStatus:
        s = self._save(req.ref, "KeepAlive")
        s.last_seen[req.ref.rank] = time.monotonic()
        if s.final is not None:
            return s.final
        return s.status.get(req.ref.rank) or pb.SaveStatus(status=pb.OPEN)

    async def report_shard(self, req: pb.ReportShardRequest) -> pb.SaveStatus:
        s = self._save(req.ref, "ReportShard")
        s.refs.setdefault(req.ref.rank, req.ref)
        s.reported.add(req.ref.rank)
        s.last_seen[req.ref.rank] = time.monotonic()
        return await self._add(s, s.report, req.ref.rank, req, set(s.refs))

    async def await_commit(self, req: pb.AwaitCommitRequest) -> pb.SaveStatus:
        s = self._save(req.ref, "AwaitCommit")
        if s.final is not None:
            return s.final
        if s.waiter is None or s.waiter.done():
            s.waiter = asyncio.get_running_loop().create_task(self._await(s, req.ref))
        timeout = req.timeout_ms / 1000 if req.timeout_ms else None
        try:
            return await asyncio.wait_for(asyncio.shield(s.waiter), timeout)
        except TimeoutError:
            return s.status.get(req.ref.rank) or pb.SaveStatus(status=pb.COMMITTING)

    async def _await(self, s: _Save, ref: pb.SaveRef) -> pb.SaveStatus:
        """One upstream wait for the node's ranks, until the save ends."""
        timeout_ms = max(s.timeout_ms, 600_000)
        while True:
            st = await self.upstream.await_commit(
                pb.AwaitCommitRequest(ref=ref, timeout_ms=timeout_ms)
            )
            if st.status in FINAL:
                s.final = st
                return st

    async def abort_save(self, req: pb.AbortSaveRequest) -> pb.SaveStatus:
        s = self._save(req.ref, "AbortSave")
        st = await self.upstream.abort_save(req)
        for r in s.refs:
            s.status[r] = st
        return st


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _fail_all(futs: Sequence[asyncio.Future[Any]], e: BaseException) -> None:
    if not isinstance(e, Exception):
        e = SaveAborted(f"the node's aggregator stopped: {type(e).__name__}")
    for f in futs:
        if not f.done():
            f.set_exception(e)
            f.exception()  # retrieved: a rank that gave up must not log "never retrieved"


def _copy(src: asyncio.Future[Any], dst: asyncio.Future[Any]) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())  # type: ignore[arg-type]
    else:
        dst.set_result(src.result())


class _Servicer(pb_grpc.CoordinatorServicer):
    """The per-rank save RPCs of the Coordinator service, answered by a NodeBatcher."""

    def __init__(self, batcher: NodeBatcher):
        self.b = batcher

    @translated
    async def BeginSave(self, request: Any, context: Any) -> pb.BeginSaveResponse:
        return await self.b.begin_save(request)

    @translated
    async def KeepAlive(self, request: Any, context: Any) -> pb.SaveStatus:
        return await self.b.keep_alive(request)

    @translated
    async def ReportShard(self, request: Any, context: Any) -> pb.SaveStatus:
        return await self.b.report_shard(request)

    @translated
    async def AwaitCommit(self, request: Any, context: Any) -> pb.SaveStatus:
        return await self.b.await_commit(request)

    @translated
    async def AbortSave(self, request: Any, context: Any) -> pb.SaveStatus:
        return await self.b.abort_save(request)


class NodeAggregator:
    """A NodeBatcher served over grpc.aio on 127.0.0.1 from a daemon thread's own loop."""

    def __init__(
        self,
        upstream: CoordinatorClient,
        node: str,
        ranks: Sequence[int],
        *,
        token: str | None,
        host: str = "127.0.0.1",
        linger_s: float = LINGER_S,
    ):
        self.node = node
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"ckptd-node-{node}", daemon=True
        )
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._client = upstream
        self._channels: dict[str, grpc.aio.Channel] = {}  # session channels, per address
        self.session = SessionUpstream(
            self._open_session,
            ClientUpstream(upstream),
            where=upstream.address,
            on_begin=upstream.note_lease,
            call_timeout_s=upstream.call_timeout_s,
        )
        fut = asyncio.run_coroutine_threadsafe(
            self._start(self.session, node, ranks, token, host, linger_s), self._loop
        )
        try:
            self.port = fut.result(timeout=30)
        except BaseException:
            self.close()
            raise
        self.address = f"{host}:{self.port}"

    def _open_session(self) -> grpc.aio.StreamStreamCall:
        """The node session, to the coordinator address that answered the client last (a
        failover moved it); on the aggregator's loop."""
        address = self._client.current_address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._client.aio_channel(address)
        return pb_grpc.CoordinatorStub(channel).NodeSession(metadata=self._client.metadata)

    async def _close_sessions(self) -> None:
        await self.session.close()
        for channel in self._channels.values():
            await channel.close()

    async def _start(
        self,
        upstream: Upstream,
        node: str,
        ranks: Sequence[int],
        token: str | None,
        host: str,
        linger_s: float,
    ) -> int:
        self.batcher = NodeBatcher(upstream, node, ranks, linger_s=linger_s)
        interceptors = [TokenAuthInterceptor(token)] if token else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", 8 << 20),
                ("grpc.max_send_message_length", 8 << 20),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_CoordinatorServicer_to_server(_Servicer(self.batcher), server)
        port = server.add_insecure_port(f"{host}:0")
        if port == 0:
            raise OSError(f"node {node!r}: the aggregator could not bind {host}")
        await server.start()
        self._server = server
        return port

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._server is not None:
            stop = asyncio.run_coroutine_threadsafe(self._server.stop(1.0), self._loop)
            try:
                stop.result(timeout=10)
            except (concurrent.futures.TimeoutError, RuntimeError) as e:
                log.debug("node %s: aggregator stop: %s", self.node, e)
        closed = asyncio.run_coroutine_threadsafe(self._close_sessions(), self._loop)
        try:
            closed.result(timeout=10)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            log.debug("node %s: session close: %s", self.node, e)
        done = asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop)
        try:  # the saves' keep-alive loops: ended here, not destroyed pending with the loop
            done.result(timeout=10)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            log.debug("node %s: aggregator tasks: %s", self.node, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
