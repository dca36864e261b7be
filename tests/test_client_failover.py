"""The client's retries and failover against real servers: a call the coordinator's side cut
off with CANCELLED is sent again (to the next address first), as one answered UNAVAILABLE.

A grpc.aio server that stops cancels the calls in flight on it: a standby stops its
refusing server when it has become the leader (ckptd.cli.serve), a coordinator stops on
SIGTERM, and gRPC reports a call cut off by either as CANCELLED or UNAVAILABLE depending
on the moment. A rank whose commit call was cut with CANCELLED while the standby took
over raised it instead of carrying on against the new leader (tests/test_pg_standby.py's
takeover at coordinator.after_catalog_commit, once in a full run). Here the cut is made
certain: `Cutting` is a real grpc.aio server on port 0 in front of a real coordinator that
passes every call on and ends one of them CANCELLED after the coordinator has acted on it
(the commit made, its answer lost), as a stopping server does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from coordinator_fixtures import TOKEN, ServerThread, finished

import ckpt
from ckptd.errors import CkptError, CoordinatorUnavailable
from ckptd.server import ServerOptions
from ckptd.server.app import SERVICE_NAME
from ckptd.server.client import CoordinatorClient

pytestmark = pytest.mark.timeout(60)


class Cutting:
    """A real grpc.aio server on port 0, on its own event loop thread, that passes every
    Coordinator call on to `upstream` and answers with its answer, except the first call
    of the method `cut`: passed on too, and then ended CANCELLED instead of answered.
    With `hold`, a call of that method is held (never passed on) until the server stops."""

    def __init__(self, upstream: str, *, cut: str = "", hold: str = ""):
        self.upstream, self.cut, self.hold = upstream, cut, hold
        self.seen: list[str] = []  # the methods called here, in order
        self.held = threading.Event()  # a call of `hold` arrived
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server, self.channel, port = self._call(self._start())
        self.address = f"127.0.0.1:{port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> tuple[grpc.aio.Server, grpc.aio.Channel, int]:
        channel = grpc.aio.insecure_channel(self.upstream)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_Handler(self),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, channel, port

    async def handle(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        name = method.rpartition("/")[2]
        self.seen.append(name)
        if name == self.hold:
            self.held.set()
            await asyncio.Event().wait()  # until the server stops
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if k == "authorization"]
        try:
            answer: bytes = await self.channel.unary_unary(method)(
                request, metadata=metadata, timeout=context.time_remaining()
            )
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "", e.trailing_metadata())
        if name == self.cut and self.seen.count(name) == 1:
            await context.abort(grpc.StatusCode.CANCELLED, "cut off as a stopping server does")
        return answer

    def stop(self) -> None:
        async def stop() -> None:
            await self.server.stop(None)
            await self.channel.close()

        try:
            self._call(stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, cutting: Cutting):
        self.cutting = cutting

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        if not method.startswith(f"/{SERVICE_NAME}/"):
            return None

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await self.cutting.handle(method, request, context)

        return grpc.unary_unary_rpc_method_handler(handle)  # bytes in, bytes out


@pytest.fixture
def coordinator(tmp_path: Path):
    s = ServerThread(tmp_path / "root", options=ServerOptions(token=TOKEN))
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("failover", [True, False], ids=["two-addresses", "one-address"])
def test_a_commit_cut_off_cancelled_is_sent_again_and_answered_committed(
    coordinator: ServerThread, tmp_path: Path, failover: bool
) -> None:
    """The coordinator records the report that completes the save and commits it; the
    caller's ReportShard is then cut off CANCELLED. The report is sent again, to the next
    address when there is one (here the coordinator itself, as after a takeover), else to
    the same after a backoff, and the coordinator answers it as it did the first (the
    save is committed); the save returns committed, once."""
    cutting = Cutting(coordinator.address, cut="ReportShard")
    try:
        address = f"{cutting.address},{coordinator.address}" if failover else cutting.address
        job = str(tmp_path / "root" / "job")
        with ckpt.Checkpointer(job, coordinator=address, token=TOKEN, attempt="a") as cp:
            done = finished(cp.save({"w": torch.arange(4.0)}, 1))
            assert done.step == 1
            after = cutting.seen[cutting.seen.index("ReportShard") + 1 :]
            # Failover: nothing more came this way; one address: the report came again.
            assert after == ([] if failover else ["ReportShard", "AwaitCommit"]), cutting.seen
    finally:
        cutting.stop()
    c = CoordinatorClient(coordinator.address, token=TOKEN)
    try:
        assert [(r.step, r.status) for r in c.list_checkpoints(job)] == [(1, "COMMITTED")]
    finally:
        c.close()


def test_a_call_the_client_cancelled_by_closing_is_not_sent_again(
    coordinator: ServerThread,
) -> None:
    """close() cancels the calls in flight (CANCELLED, "Channel closed!"): that call fails
    at once, as the client's own doing, not retried nor called the coordinator's fault."""
    cutting = Cutting(coordinator.address, hold="ListCheckpoints")
    c = CoordinatorClient(cutting.address, token=TOKEN, connect_retry_s=5, retry_for_s=5)
    got: list[BaseException] = []

    def call() -> None:
        try:
            c.list_checkpoints("job")
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            got.append(e)

    t = threading.Thread(target=call)
    try:
        t.start()
        assert cutting.held.wait(10)
        t0 = time.monotonic()
        c.close()
        t.join(10)
        assert not t.is_alive()
        assert time.monotonic() - t0 < 2
    finally:
        cutting.stop()
    assert len(got) == 1 and type(got[0]) is CkptError, got
    assert not isinstance(got[0], CoordinatorUnavailable)
    assert "Channel closed" in str(got[0]), got[0]
