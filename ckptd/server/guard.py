"""Per-call guards in front of the servicer: undecodable requests and runaway clients.

gRPC answers a request whose bytes do not parse with UNKNOWN and a Python exception
name; here it becomes INVALID_ARGUMENT with a message that says what to check. And one
client (one connection) may hold at most `max_calls` calls at once: BeginSave and
AwaitCommit legitimately wait, so the server-wide limit (ServerOptions.
max_concurrent_rpcs) is high, and without a per-client share a single buggy client that
leaks waiting calls would exhaust it and lock every other job out. A client over its share
gets RESOURCE_EXHAUSTED at once; the others are not affected.

A client is a connection (the peer address gRPC reports): every rank process has its own.
Channels of one process with equal options share one connection (gRPC's global subchannel
pool) and so one share; over a unix socket all clients share one peer name.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from ckptd.errors import InvalidRequest
from ckptd.server import errors


class Undecodable:
    """What a request that does not parse becomes, for the handler to refuse clearly."""

    def __init__(self, why: str):
        self.why = why

    def error(self, method: str) -> InvalidRequest:
        return InvalidRequest(
            f"{method}: the request is not a valid protobuf message for this method "
            f"({self.why}); check that the client and the coordinator run the same ckptd "
            "version"
        )


class CallGuard(grpc.aio.ServerInterceptor):
    def __init__(self, max_calls_per_client: int):
        self.max_calls = max_calls_per_client
        self.active: collections.Counter[str] = collections.Counter()
        # method -> (its handler, the guarded one): handlers are made once at registration,
        # so each call reuses its method's wrapper instead of building one.
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not (
            handler.unary_unary is not None
            or (
                handler.stream_stream is not None
                and not inspect.isasyncgenfunction(handler.stream_stream)
            )
        ):
            return handler  # generators (health Watch, reflection): not ours to guard
        method = details.method
        known = self._guarded.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        decode = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            if decode is None:
                return data
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 - any parse failure is the client's
                return Undecodable(f"{type(e).__name__}: {e}"[:300])

        async def admit(context: grpc.aio.ServicerContext) -> str:
            peer = context.peer()
            n = self.active[peer]
            if n >= self.max_calls:
                # RESOURCE_EXHAUSTED, gRPC's word for "over a limit"; the class says why.
                await errors.abort(
                    context,
                    InvalidRequest(
                        f"{method}: client {peer} already has {n} calls in flight, the limit "
                        f"per client connection is {self.max_calls}; wait for answers before "
                        "sending more calls (a rank needs a few), or raise "
                        "--max-calls-per-client"
                    ),
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
            self.active[peer] = n + 1
            return peer

        def leave(peer: str) -> None:
            self.active[peer] -= 1
            if self.active[peer] <= 0:
                del self.active[peer]

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Undecodable):
                    await errors.abort(context, request.error(method))
                peer = await admit(context)
                try:
                    return await inner(request, context)
                finally:
                    leave(peer)

            wrapped = handler._replace(unary_unary=guarded, request_deserializer=lenient)
        else:  # the node session: one call however long it stays open; it refuses an
            # Undecodable message itself (no generator wrapped around every message)
            inner_stream = handler.stream_stream

            async def guarded_stream(
                requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
            ) -> Any:
                peer = await admit(context)
                try:
                    return await inner_stream(requests, context)
                finally:
                    leave(peer)

            wrapped = handler._replace(stream_stream=guarded_stream, request_deserializer=lenient)
        self._guarded[method] = (handler, wrapped)
        return wrapped
