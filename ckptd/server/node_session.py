"""The node session: a node aggregator's calls to the coordinator on one long-lived stream.

A unary gRPC call costs the coordinator about 0.35 ms of CPU in call setup alone (HTTP/2
stream, metadata, interceptors), a request and its answer on an open stream about 0.07 ms
(measured on this project's 2-core machine). At 2,048 nodes of 8 ranks the node calls'
setup was most of a save's coordinator CPU, so each aggregator keeps one bidirectional
`NodeSession` stream open and sends its BeginSaveNode, KeepAliveNode, ReportShardsNode and
AwaitCommit calls on it as `NodeCall`s, each answered by the `NodeAnswer` of its id.

Nothing else changes. The server side (`serve`) hands each message to the same body the
unary RPC runs (ckptd.server.servicer) and answers a failure with the status code, message
and trailers the unary call would have ended with (`errors.failure`). The token is checked
once, when the stream opens (the auth interceptor). The client side (`SessionUpstream`, an
`Upstream` of ckptd.server.node) falls back to its unary upstream, with its retries and
its failover to a standby, for every call that the stream cannot carry: a stream that
breaks (coordinator restart, network), will not open, times out, or answers UNAVAILABLE (a
standby, an unreachable catalog). Every call of the save protocol may be sent again, so a
call whose answer was lost with the stream is simply sent again by unary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc

from ckptd.errors import InvalidRequest
from ckptd.server import errors
from ckptd.server.client import (
    AWAIT_COMMIT_S,
    REPORT_DEADLINE_S,
    UNANSWERED,
    barrier_deadline_s,
    named_once,
    what_node,
    what_pb,
)
from ckptd.server.guard import Undecodable
from ckptd.v1 import coordinator_pb2 as pb

log = logging.getLogger("ckptd.node")

# Calls one stream may have in flight: an aggregator has a few per save (begin, report,
# keep-alive, await) and a few saves at most; more is a runaway client (the CallGuard's
# per-connection limit does not see inside a stream).
MAX_IN_FLIGHT = 64
# Which answer field carries each call's answer.
ANSWER_OF = {
    "begin_save": "begin_save",
    "keep_alive": "statuses",
    "report_shards": "statuses",
    "await_commit": "status",
}

Handler = Callable[[Any], Awaitable[Any]]


# -- the coordinator's side ------------------------------------------------------------
async def serve(
    handlers: Mapping[str, Handler],
    requests: AsyncIterator[pb.NodeCall | Undecodable],
    context: grpc.aio.ServicerContext,
) -> None:
    """Answer the stream's calls concurrently (a BeginSaveNode waits at the barrier while
    KeepAliveNodes of an earlier save go on), each by its handler, until the aggregator
    closes its side and every call is answered."""
    out: asyncio.Queue[pb.NodeAnswer | None] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()

    async def one(msg: pb.NodeCall) -> None:
        out.put_nowait(await answer(handlers, msg))

    async def read() -> None:
        try:
            async for msg in requests:
                if isinstance(msg, Undecodable):  # the call guard's lenient decoding
                    await errors.abort(context, msg.error("NodeSession"))
                if len(tasks) >= MAX_IN_FLIGHT:
                    e = InvalidRequest(
                        f"node session from {context.peer()}: {len(tasks)} calls in flight, the "
                        f"limit is {MAX_IN_FLIGHT}; wait for answers before sending more"
                    )
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED
                    out.put_nowait(pb.NodeAnswer(id=msg.id, error=error_pb(code, str(e), ())))
                    continue
                t = asyncio.get_running_loop().create_task(one(msg))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(set(tasks))
        finally:
            out.put_nowait(None)

    reader = asyncio.get_running_loop().create_task(read())
    try:
        while (a := await out.get()) is not None:
            await context.write(a)
        await reader  # its failure (a message that does not parse) ends the call
    finally:
        reader.cancel()
        for t in list(tasks):  # the aggregator went away: its waits end, as a unary call's
            t.cancel()


async def answer(handlers: Mapping[str, Handler], msg: pb.NodeCall) -> pb.NodeAnswer:
    """One call's answer, or the failure the unary call would have ended with."""
    kind = msg.WhichOneof("call")
    if kind is None or kind not in handlers:
        e = InvalidRequest(
            f"node session call {msg.id}: no call in the message (or one this coordinator "
            "does not know); check that the aggregator and the coordinator run the same "
            "ckptd version"
        )
        return pb.NodeAnswer(id=msg.id, error=error_pb(*errors.failure("NodeSession", e)))
    try:
        result = await handlers[kind](getattr(msg, kind))
    except Exception as e:
        return pb.NodeAnswer(id=msg.id, error=error_pb(*errors.failure(f"NodeSession.{kind}", e)))
    return pb.NodeAnswer(id=msg.id, **{ANSWER_OF[kind]: result})


def error_pb(
    code: grpc.StatusCode, details: str, trailers: Sequence[tuple[str, str | bytes]]
) -> pb.NodeError:
    return pb.NodeError(
        code=code.value[0],
        details=details,
        trailers=[
            pb.NodeErrorTrailer(key=k, value=v if isinstance(v, bytes) else v.encode())
            for k, v in trailers
        ],
    )


def error_from_pb(err: pb.NodeError, what: str, where: str) -> tuple[grpc.StatusCode, Exception]:
    """The ckptd error an error answer stands for (as the unary client would raise it)."""
    code = _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
    trailers = [
        (t.key, t.value if t.key.endswith("-bin") else t.value.decode("utf-8", "replace"))
        for t in err.trailers
    ]
    return code, errors.error_from(code, named_once(what, err.details), trailers, where=where)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


# -- the aggregator's side --------------------------------------------------------------
class SessionUpstream:
    """An aggregator's upstream over one NodeSession stream, opened when first needed and
    again after it broke (`reopen_after_s` later, doubling while it breaks with no answer
    between); `fallback`, the unary upstream, carries every call the stream cannot. Runs
    on the aggregator's event loop.

    `open_session()` starts the stream call (with the token in its metadata);
    `on_begin(answers)` sees each BeginSaveNode answer (the client learns its lease)."""

    def __init__(
        self,
        open_session: Callable[[], grpc.aio.StreamStreamCall],
        fallback: Any,
        *,
        where: str = "",
        on_begin: Callable[[Sequence[pb.BeginSaveResponse]], None] | None = None,
        call_timeout_s: float = 30.0,
        reopen_after_s: float = 5.0,
    ):
        self._open, self.fallback, self.where = open_session, fallback, where
        self._on_begin = on_begin
        self.call_timeout_s, self.reopen_after_s = call_timeout_s, reopen_after_s
        self._call: grpc.aio.StreamStreamCall | None = None
        self._pending: dict[int, asyncio.Future[pb.NodeAnswer | None]] = {}
        self._ids = itertools.count(1)
        self._write = asyncio.Lock()  # one write at a time on a gRPC stream
        self._readers: set[asyncio.Task[None]] = set()  # the stream's reader (and a broken one's)
        self._broken_at = float("-inf")
        self._unsupported = False  # an older coordinator without NodeSession
        self._failures = 0  # breaks in a row with no answer between
        self.calls_sent = 0  # calls this stream carried (the bench counts them)
        self.fell_back = 0  # calls the unary path carried instead

    # -- the Upstream calls ---------------------------------------------------------------
    async def begin_save(self, req: pb.BeginSaveRequest) -> pb.BeginSaveResponse:
        return await self.fallback.begin_save(req)  # an earlier part of a large plan

    async def begin_save_node(
        self, node: str, reqs: Sequence[pb.BeginSaveRequest]
    ) -> Sequence[pb.BeginSaveResponse]:
        what = what_node(node, [q.ref for q in reqs])
        req = pb.NodeBeginSaveRequest(node=node, ranks=reqs)
        got = await self._ask("begin_save", req, barrier_deadline_s(reqs), what)
        if got is None:
            self.fell_back += 1
            return await self.fallback.begin_save_node(node, reqs)
        answers = list(got.begin_save.ranks)
        if self._on_begin is not None:
            self._on_begin(answers)
        return answers

    async def keep_alive_node(
        self, node: str, reqs: Sequence[pb.KeepAliveRequest]
    ) -> Sequence[pb.SaveStatus]:
        req = pb.NodeKeepAliveRequest(node=node, ranks=reqs)
        got = await self._ask("keep_alive", req, None, what_node(node, [q.ref for q in reqs]))
        if got is None:
            self.fell_back += 1
            return await self.fallback.keep_alive_node(node, reqs)
        return list(got.statuses.ranks)

    async def report_shards_node(
        self, node: str, reqs: Sequence[pb.ReportShardRequest]
    ) -> Sequence[pb.SaveStatus]:
        req = pb.NodeReportRequest(node=node, ranks=reqs)
        what = what_node(node, [q.ref for q in reqs])
        got = await self._ask("report_shards", req, REPORT_DEADLINE_S, what)
        if got is None:
            self.fell_back += 1
            return await self.fallback.report_shards_node(node, reqs)
        return list(got.statuses.ranks)

    async def await_commit(self, req: pb.AwaitCommitRequest) -> pb.SaveStatus:
        # One long wait on the stream (the unary client waits in lease-sized slices).
        wait = (req.timeout_ms / 1000 if req.timeout_ms else AWAIT_COMMIT_S) + 30
        got = await self._ask("await_commit", req, wait, what_pb(req.ref))
        if got is None:
            self.fell_back += 1
            return await self.fallback.await_commit(req)
        return got.status

    async def abort_save(self, req: pb.AbortSaveRequest) -> pb.SaveStatus:
        return await self.fallback.abort_save(req)

    async def close(self) -> None:
        """End the stream and wait for its reader: nothing of it may outlive the loop."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        self._fail_pending()
        readers, self._readers = self._readers, set()
        for t in readers:
            t.cancel()
        if readers:
            await asyncio.wait(readers)

    # -- the stream -----------------------------------------------------------------------
    async def _ask(
        self, kind: str, req: Any, timeout_s: float | None, what: str
    ) -> pb.NodeAnswer | None:
        """The answer to one call on the stream; None sends the call by unary instead. An
        error answer the unary path would not retry is raised as the unary call's error."""
        call = self._stream()
        if call is None:
            return None
        msg_id = next(self._ids)
        fut: asyncio.Future[pb.NodeAnswer | None] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        try:
            async with self._write:
                await call.write(pb.NodeCall(id=msg_id, **{kind: req}))
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            await self._ended(call)
            self._broken(call, f"write failed: {e}")
            return None
        self.calls_sent += 1
        try:
            got = await asyncio.wait_for(fut, timeout_s or self.call_timeout_s)
        except TimeoutError:
            log.warning("%s: no answer on the node session; sending it by unary", what)
            return None
        finally:
            self._pending.pop(msg_id, None)
        if got is None or got.WhichOneof("answer") != "error":
            return got
        code, failed = error_from_pb(got.error, what, self.where)
        # A standby, say: the unary path decides whether to send it again (and to which
        # address: CoordinatorClient.sends_again); the stream reopens later, where it went.
        if code in UNANSWERED:
            self._broken(call, f"{code.name}: {got.error.details}")
            return None
        raise failed

    def _stream(self) -> grpc.aio.StreamStreamCall | None:
        if self._call is not None:
            return self._call
        # After each break in a row with no answer between, wait twice as long (up to
        # 5 min): an older coordinator's UNIMPLEMENTED is not always seen (a write that
        # failed first reports INTERNAL), nor is a network that keeps dropping the stream.
        wait = min(self.reopen_after_s * 2 ** max(0, self._failures - 1), 300.0)
        if self._unsupported or time.monotonic() - self._broken_at < wait:
            return None
        try:
            call = self._open()
        except Exception as e:  # noqa: BLE001 - no channel: the unary path says why
            self._broken_at = time.monotonic()
            log.debug("node session: cannot open: %s", e)
            return None
        self._call = call
        reader = asyncio.get_running_loop().create_task(self._read(call))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        why = "the coordinator ended the stream"
        try:
            while True:
                got = await call.read()
                if got is grpc.aio.EOF:
                    break
                self._failures = 0
                fut = self._pending.get(got.id)
                if fut is not None and not fut.done():
                    fut.set_result(got)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
            why = f"{code.name if code else type(e).__name__}: {e.details() if code else e}"
        except asyncio.CancelledError:
            self._broken(call, "closed")
            return
        await self._ended(call)
        self._broken(call, why)

    async def _ended(self, call: grpc.aio.StreamStreamCall) -> None:
        """The ended stream's status: an older coordinator's UNIMPLEMENTED sends every call
        by unary from now on (learnt by the reader, or by a write that failed first)."""
        try:
            code = await asyncio.wait_for(call.code(), 5.0)
        except (TimeoutError, grpc.RpcError):
            return
        if code == grpc.StatusCode.UNIMPLEMENTED:
            self._unsupported = True

    def _broken(self, call: Any, why: str) -> None:
        if self._call is not call or call is None:
            return
        self._call = None
        self._broken_at = time.monotonic()
        self._failures += 1
        call.cancel()
        if self._pending:
            log.info("node session broke (%s): %d call(s) go by unary", why, len(self._pending))
        self._fail_pending()

    def _fail_pending(self) -> None:
        pending, self._pending = self._pending, {}
        for f in pending.values():
            if not f.done():
                f.set_result(None)  # None: send it by unary
