"""create_server(): the coordinator as a grpc.aio server, with health and reflection;
create_standby_server(): what a standby coordinator serves until it leads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ckptd.coordinator.core import Coordinator
from ckptd.errors import CoordinatorUnavailable
from ckptd.server import errors
from ckptd.server.auth import TokenAuthInterceptor
from ckptd.server.guard import CallGuard
from ckptd.server.servicer import CoordinatorServicer
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
STREAMING = {
    m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods if m.client_streaming
}
# A part of a rank's plan is at most 20,000 chunks (~2-3 MiB); 8 MiB leaves headroom and
# anything larger is refused with RESOURCE_EXHAUSTED before it is parsed.
MAX_MESSAGE_BYTES = 8 << 20


@dataclasses.dataclass
class ServerOptions:
    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_client_ca: bytes | None = None  # set: clients must present a certificate from this CA
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # BeginSave waits for every rank, so a save of N ranks holds N calls open at once.
    max_concurrent_rpcs: int = 20_000
    # One client connection's share (ckptd/server/guard.py): a runaway client is refused
    # with RESOURCE_EXHAUSTED before it can take more than half of max_concurrent_rpcs.
    max_calls_per_client: int = 10_000


async def create_server(
    core: Coordinator, address: str = "127.0.0.1:0", options: ServerOptions | None = None
) -> tuple[grpc.aio.Server, int]:
    """A started server bound to `address` (port 0 picks one); returns (server, port).

    The caller owns the core's lifecycle (core.start() before, core.close() after
    server.stop(grace)).
    """
    opts = options or ServerOptions()
    server = _new_server(opts)
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(core), server)
    return server, await _start(server, address, opts, health_pb2.HealthCheckResponse.SERVING)


async def create_standby_server(
    address: str, options: ServerOptions | None, why: Callable[[], str]
) -> tuple[grpc.aio.Server, int]:
    """A started server for a coordinator standing by (catalog_pg): every Coordinator call
    is answered UNAVAILABLE with `why()` (who leads, what to do), so a client given several
    addresses moves on to the next; health says NOT_SERVING. Token and TLS as the real
    server's. Stop it before create_server binds the same address."""
    opts = options or ServerOptions()
    server = _new_server(opts)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await errors.abort(context, CoordinatorUnavailable(why()))

    class Standby(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if not details.method.startswith(f"/{SERVICE_NAME}/"):
                return None
            if details.method.rpartition("/")[2] in STREAMING:  # the node session
                return grpc.stream_stream_rpc_method_handler(refuse)
            return grpc.unary_unary_rpc_method_handler(refuse)

    server.add_generic_rpc_handlers((Standby(),))
    return server, await _start(server, address, opts, health_pb2.HealthCheckResponse.NOT_SERVING)


def _new_server(opts: ServerOptions) -> grpc.aio.Server:
    interceptors: list[grpc.aio.ServerInterceptor] = [CallGuard(opts.max_calls_per_client)]
    if opts.token:
        interceptors.append(TokenAuthInterceptor(opts.token))
    return grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", opts.max_message_bytes),
            ("grpc.max_send_message_length", opts.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # gRPC cancels calls beyond 1,000 (soft) / 3,000 (hard) waiting for a handler;
            # a save of N ranks holds N BeginSave calls at the barrier.
            ("grpc.server.max_pending_requests", opts.max_concurrent_rpcs),
            ("grpc.server.max_pending_requests_hard_limit", opts.max_concurrent_rpcs),
        ],
        maximum_concurrent_rpcs=opts.max_concurrent_rpcs,
    )


async def _start(
    server: grpc.aio.Server, address: str, opts: ServerOptions, health_status: Any
) -> int:
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if opts.tls_cert and opts.tls_key:
        creds = grpc.ssl_server_credentials(
            [(opts.tls_key, opts.tls_cert)],
            root_certificates=opts.tls_client_ca,
            require_client_auth=opts.tls_client_ca is not None,
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_status)
    await health_servicer.set("", health_status)
    return port
