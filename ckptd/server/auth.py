"""Token authentication: every call but health checks carries `authorization: Bearer <token>`."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ckptd.errors import Unauthenticated
from ckptd.server import errors

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def load_token(token_file: str | None = None, env: str = "CKPTD_TOKEN") -> str | None:
    """The shared secret from a file (first line) or the environment; None if neither."""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.readline().strip()
        except OSError as e:
            raise Unauthenticated(f"cannot read token file {token_file}: {e.strerror}") from None
        if not token:
            raise Unauthenticated(f"token file {token_file} is empty")
        return token
    return os.environ.get(env) or None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
        handler = await continuation(details)
        if hmac.compare_digest(given, self._expected):
            return handler
        return _deny("missing token" if not given else "wrong token", handler)


def _deny(why: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the method's own kind that refuses the call (a stream is refused when
    it opens, before its first message is read)."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await errors.abort(
            context,
            Unauthenticated(
                f"{why}: pass the coordinator's token (CKPTD_TOKEN or token=...) with every call"
            ),
        )

    if handler is not None and handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
