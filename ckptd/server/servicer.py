"""grpc.aio servicer: convert the request, call the core, convert the answer.

The node-batch RPCs (BeginSaveNode, KeepAliveNode, ReportShardsNode) convert each embedded
per-rank message exactly as the per-rank RPC does (`_begin_call`, ...) and hand the list to
the core's node methods (ckptd.coordinator.nodes). The same bodies answer the node session's
messages (ckptd.server.node_session): one stream per aggregator instead of a call a phase.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ckptd.coordinator.core import Coordinator
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import SaveRef
from ckptd.server import converters as cv
from ckptd.server import errors, node_session
from ckptd.v1 import coordinator_pb2 as pb
from ckptd.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("ckptd.server")
R = TypeVar("R")


def translated(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """End a failed call through the error map (`errors.failure`: code, class, logging)."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code, details, trailers = errors.failure(fn.__name__, e)
            await context.abort(code, details, trailing_metadata=trailers)
        raise AssertionError("unreachable")

    return wrapper


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, core: Coordinator):
        self.core = core

    @translated
    async def OpenJob(
        self, request: pb.OpenJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenJobResponse:
        generation, job = await self.core.open_job(request.job, request.attempt)
        return pb.OpenJobResponse(generation=generation, job=job)

    @translated
    async def BeginSave(
        self, request: pb.BeginSaveRequest, context: grpc.aio.ServicerContext
    ) -> pb.BeginSaveResponse:
        ref, chunks, kwargs = _begin_call(request)
        return cv.begin_to_pb(await self.core.begin_save(ref, chunks, **kwargs))

    @translated
    async def BeginSaveNode(
        self, request: pb.NodeBeginSaveRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeBeginSaveResponse:
        return await self.begin_save_node(request)

    @translated
    async def KeepAliveNode(
        self, request: pb.NodeKeepAliveRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeStatusResponse:
        return await self.keep_alive_node(request)

    @translated
    async def ReportShardsNode(
        self, request: pb.NodeReportRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeStatusResponse:
        return await self.report_shards_node(request)

    async def NodeSession(
        self, request_iterator: AsyncIterator[pb.NodeCall], context: grpc.aio.ServicerContext
    ) -> None:
        await node_session.serve(
            {
                "begin_save": self.begin_save_node,
                "keep_alive": self.keep_alive_node,
                "report_shards": self.report_shards_node,
                "await_commit": self.await_commit,
            },
            request_iterator,
            context,
        )

    # -- the node calls' bodies: one each, for the unary RPC and the node session ----------
    async def begin_save_node(self, request: pb.NodeBeginSaveRequest) -> pb.NodeBeginSaveResponse:
        begun = await self.core.begin_save_node(
            request.node, [_begin_call(r) for r in request.ranks]
        )
        return pb.NodeBeginSaveResponse(ranks=[cv.begin_to_pb(b) for b in begun])

    async def keep_alive_node(self, request: pb.NodeKeepAliveRequest) -> pb.NodeStatusResponse:
        refs = [cv.ref_from_pb(r.ref) for r in request.ranks]
        answers = await self.core.keep_alive_node(request.node, refs)
        return pb.NodeStatusResponse(ranks=[cv.status_to_pb(a) for a in answers])

    async def report_shards_node(self, request: pb.NodeReportRequest) -> pb.NodeStatusResponse:
        reports = [(cv.ref_from_pb(r.ref), cv.report_from_pb(r)) for r in request.ranks]
        answers = await self.core.report_shards_node(request.node, reports)
        return pb.NodeStatusResponse(ranks=[cv.status_to_pb(a) for a in answers])

    async def await_commit(self, request: pb.AwaitCommitRequest) -> pb.SaveStatus:
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        return cv.status_to_pb(await self.core.await_commit(cv.ref_from_pb(request.ref), timeout))

    @translated
    async def KeepAlive(
        self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveStatus:
        return cv.status_to_pb(await self.core.keep_alive(cv.ref_from_pb(request.ref)))

    @translated
    async def ReportShard(
        self, request: pb.ReportShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveStatus:
        return cv.status_to_pb(
            await self.core.report_shard(cv.ref_from_pb(request.ref), cv.report_from_pb(request))
        )

    @translated
    async def AwaitCommit(
        self, request: pb.AwaitCommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveStatus:
        return await self.await_commit(request)

    @translated
    async def AbortSave(
        self, request: pb.AbortSaveRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveStatus:
        return cv.status_to_pb(
            await self.core.abort_save(cv.ref_from_pb(request.ref), request.reason)
        )

    @translated
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListCheckpointsResponse:
        return pb.ListCheckpointsResponse(
            checkpoints=[cv.record_to_pb(r) for r in self.core.list_checkpoints(request.job)]
        )

    @translated
    async def GetCheckpoint(
        self, request: pb.GetCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointInfo:
        step = request.step if request.WhichOneof("which") == "step" else None
        return cv.record_to_pb(self.core.get_checkpoint(request.job, step))

    @translated
    async def Quarantine(
        self, request: pb.QuarantineRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointInfo:
        return cv.record_to_pb(
            await self.core.quarantine(request.job, request.step, request.reason)
        )

    @translated
    async def RecordTier(
        self, request: pb.RecordTierRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordTierResponse:
        await self.core.record_tier(
            request.job, request.step, request.tier, request.url, request.status, request.reason
        )
        return pb.RecordTierResponse()

    @translated
    async def MemorySave(
        self, request: pb.MemorySaveRequest, context: grpc.aio.ServicerContext
    ) -> pb.MemorySaveResponse:
        status, manifest = await self.core.memory_save(
            cv.ref_from_pb(request.ref),
            request.phase,
            cv.json_field(request.report, "memory report"),
            timeout_s=request.timeout_ms / 1000,
            reason=request.reason,
        )
        return pb.MemorySaveResponse(
            status=cv.status_to_pb(status),
            manifest=manifest,
            lease_ms=int(self.core.lease_s * 1000),
        )


def _begin_call(
    request: pb.BeginSaveRequest,
) -> tuple[SaveRef, list[ChunkPlan], dict[str, Any]]:
    """One rank's BeginSave as the core's arguments (per rank, or embedded in a node batch)."""
    return (
        cv.ref_from_pb(request.ref),
        [cv.chunk_from_pb(c) for c in request.chunks],
        {
            "part": request.part,
            "parts": max(1, request.parts),
            "state": cv.json_field(request.state, "state"),
            "rank_state": cv.json_field(request.rank_state, "rank_state"),
            "metadata": cv.json_field(request.metadata, "metadata") or {},
            "allow_divergent": request.allow_divergent_replicas,
            "keep_last": request.keep_last,
            "timeout_s": request.timeout_ms / 1000 if request.timeout_ms else None,
            "parent": cv.parent_from_pb(request),
            "layout_digest": request.layout_digest,
            "digests": request.digests,
        },
    )
