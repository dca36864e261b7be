"""One map from ckptd errors to gRPC status codes, and back for the client."""

from __future__ import annotations

import grpc

from ckptd import errors as E

# Most specific first.
TO_CODE: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (E.StaleGeneration, grpc.StatusCode.FAILED_PRECONDITION),
    (E.DivergentReplicas, grpc.StatusCode.FAILED_PRECONDITION),
    (E.SaveAborted, grpc.StatusCode.ABORTED),
    (E.CheckpointExists, grpc.StatusCode.ALREADY_EXISTS),
    (E.CheckpointNotFound, grpc.StatusCode.NOT_FOUND),
    (E.UnsafePath, grpc.StatusCode.PERMISSION_DENIED),
    (E.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (E.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (E.InvalidManifest, grpc.StatusCode.INVALID_ARGUMENT),
    (E.CorruptCheckpoint, grpc.StatusCode.DATA_LOSS),
    (E.StorageError, grpc.StatusCode.UNAVAILABLE),
    (E.CkptError, grpc.StatusCode.INTERNAL),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]

FROM_CODE: dict[grpc.StatusCode, type[E.CkptError]] = {
    grpc.StatusCode.ABORTED: E.SaveAborted,
    grpc.StatusCode.ALREADY_EXISTS: E.CheckpointExists,
    grpc.StatusCode.NOT_FOUND: E.CheckpointNotFound,
    grpc.StatusCode.PERMISSION_DENIED: E.UnsafePath,
    grpc.StatusCode.UNAUTHENTICATED: E.Unauthenticated,
    grpc.StatusCode.INVALID_ARGUMENT: E.InvalidRequest,
    grpc.StatusCode.DATA_LOSS: E.CorruptCheckpoint,
    grpc.StatusCode.RESOURCE_EXHAUSTED: E.InvalidRequest,
    grpc.StatusCode.UNAVAILABLE: E.CoordinatorUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: E.CoordinatorUnavailable,
}


def code_for(e: BaseException) -> grpc.StatusCode:
    for kind, code in TO_CODE:
        if isinstance(e, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_from(code: grpc.StatusCode, details: str) -> E.CkptError:
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        if "replica" in details or "PerRank" in details:
            return E.DivergentReplicas(details)
        return E.StaleGeneration(details)
    return FROM_CODE.get(code, E.CkptError)(details)
