"""One map from ckptd errors to gRPC statuses and back: the code, and the class in metadata.

The server side (`abort`) sends each error with a status code, for clients that only know
gRPC, and trailing metadata naming the ckptd error class, so the client raises the same
class without reading the message. A storage error also carries its errno, the path (when
the storage named it) and advice. The client side (`error_from`) rebuilds the error from
a fixed allow-list of class names, never by eval or unpickling; a status without the
metadata (gRPC's own: deadline, oversize message, transport) falls back to the code.

Storage errors are FAILED_PRECONDITION: the coordinator is up and answered, but its
storage is in a state (full, read-only, failing) that a retry will not change until an
operator fixes it, which is what that code means in gRPC's guide. UNAVAILABLE would be
retried by the client for its whole retry window and then reported as an unreachable
coordinator; INTERNAL says "a bug", which a full disk is not.
"""

from __future__ import annotations

import errno as errno_codes
import logging
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

from ckptd import errors as E

log = logging.getLogger("ckptd.server")

ERROR_KEY = "ckptd-error"  # the class name, from KINDS
ERRNO_KEY = "ckptd-errno"
PATH_KEY = "ckptd-path-bin"  # -bin: a path need not be ASCII (gRPC sends it base64)
ADVICE_KEY = "ckptd-advice"
MAX_PATH_BYTES = 2048  # metadata is small; a longer path is cut (the message has it whole)

# Most specific first.
TO_CODE: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (E.StaleGeneration, grpc.StatusCode.FAILED_PRECONDITION),
    (E.DivergentReplicas, grpc.StatusCode.FAILED_PRECONDITION),
    (E.StepMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (E.LayoutUnknown, grpc.StatusCode.FAILED_PRECONDITION),  # the client resends the plan
    (E.SaveAborted, grpc.StatusCode.ABORTED),
    (E.CheckpointExists, grpc.StatusCode.ALREADY_EXISTS),
    (E.CheckpointNotFound, grpc.StatusCode.NOT_FOUND),
    (E.UnsafePath, grpc.StatusCode.PERMISSION_DENIED),
    (E.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (E.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (E.InvalidManifest, grpc.StatusCode.INVALID_ARGUMENT),
    (E.CorruptCheckpoint, grpc.StatusCode.DATA_LOSS),
    # A standby coordinator, or a catalog that cannot be reached: the client moves on to its
    # next address (or retries the one it has) for its retry window.
    (E.CoordinatorUnavailable, grpc.StatusCode.UNAVAILABLE),
    (E.StorageError, grpc.StatusCode.FAILED_PRECONDITION),
    (E.CkptError, grpc.StatusCode.INTERNAL),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (OSError, grpc.StatusCode.FAILED_PRECONDITION),  # an I/O call storage did not translate
]

# The classes that may travel by name: every class of ckptd.errors, and nothing else.
KINDS: dict[str, type[E.CkptError]] = {
    k.__name__: k
    for k in (
        E.CkptError,
        E.CheckpointNotFound,
        E.CheckpointExists,
        E.CorruptCheckpoint,
        E.ShardMissing,
        E.ShardSizeMismatch,
        E.HashMismatch,
        E.InvalidManifest,
        E.UnsafePath,
        E.UnsupportedValue,
        E.StateMismatch,
        E.StorageError,
        E.InvalidRequest,
        E.LayoutUnknown,
        E.Unauthenticated,
        E.CoordinatorUnavailable,
        E.SaveFailed,
        E.SaveAborted,
        E.StaleGeneration,
        E.DivergentReplicas,
        E.StepMismatch,
    )
}


def aborted_by(name: str) -> type[E.CkptError]:
    """The class an ABORTED status names in its `error` field (SaveAborted when none, or
    when the name is not one of KINDS)."""
    return KINDS.get(name, E.SaveAborted) if name else E.SaveAborted


# Without the class in metadata: the statuses gRPC itself produces, and old servers.
FROM_CODE: dict[grpc.StatusCode, type[E.CkptError]] = {
    grpc.StatusCode.ABORTED: E.SaveAborted,
    grpc.StatusCode.ALREADY_EXISTS: E.CheckpointExists,
    grpc.StatusCode.NOT_FOUND: E.CheckpointNotFound,
    grpc.StatusCode.PERMISSION_DENIED: E.UnsafePath,
    grpc.StatusCode.UNAUTHENTICATED: E.Unauthenticated,
    grpc.StatusCode.INVALID_ARGUMENT: E.InvalidRequest,
    grpc.StatusCode.DATA_LOSS: E.CorruptCheckpoint,
    grpc.StatusCode.RESOURCE_EXHAUSTED: E.InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: E.SaveFailed,
    grpc.StatusCode.UNAVAILABLE: E.CoordinatorUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: E.CoordinatorUnavailable,
}

# What to do about the coordinator's storage, by errno: the user reading it is on a
# training host and must learn that the coordinator's disk, not the network, is at fault.
_ADVICE = {
    errno_codes.ENOSPC: "the coordinator's filesystem is full: free space there or retire old "
    "checkpoints (ckptctl gc, or keep_last= on the Checkpointer), then retry",
    errno_codes.EDQUOT: "the coordinator's user is over its disk quota: raise the quota or "
    "retire old checkpoints (ckptctl gc, or keep_last= on the Checkpointer), then retry",
    errno_codes.EIO: "the coordinator's disk reported an I/O error: check the device and the "
    "kernel log on the coordinator's host before retrying",
    errno_codes.EROFS: "the coordinator's filesystem is read-only: remount it read-write, "
    "then retry",
    errno_codes.EACCES: "the coordinator may not write there: check that `ckptd serve` runs "
    "as a user that owns its --root",
    errno_codes.EPERM: "the coordinator may not write there: check that `ckptd serve` runs "
    "as a user that owns its --root",
}
_DEFAULT_ADVICE = (
    "the coordinator's storage failed (the coordinator itself is up): see its log, fix the "
    "storage, then retry"
)


def code_for(e: BaseException) -> grpc.StatusCode:
    for kind, code in TO_CODE:
        if isinstance(e, kind):
            return code
    return grpc.StatusCode.INTERNAL


def kind_of(e: BaseException) -> type[E.CkptError] | None:
    """The nearest allow-listed class of `e`; a plain ValueError is an InvalidRequest, a
    plain OSError a StorageError (as code_for maps them), anything else None."""
    for cls in type(e).__mro__:
        if KINDS.get(cls.__name__) is cls:
            return KINDS[cls.__name__]
    if isinstance(e, ValueError):
        return E.InvalidRequest
    return E.StorageError if isinstance(e, OSError) else None


def advice_for(e: BaseException) -> str:
    return _ADVICE.get(getattr(e, "errno", None) or 0, _DEFAULT_ADVICE)


def trailers_for(e: BaseException) -> tuple[tuple[str, str | bytes], ...]:
    kind = kind_of(e)
    if kind is None:
        return ()
    md: list[tuple[str, str | bytes]] = [(ERROR_KEY, kind.__name__)]
    if isinstance(e, OSError) and issubclass(kind, E.StorageError):
        if e.errno:
            md.append((ERRNO_KEY, str(e.errno)))
        if e.filename:
            md.append((PATH_KEY, str(e.filename).encode("utf-8", "replace")[:MAX_PATH_BYTES]))
        md.append((ADVICE_KEY, advice_for(e)))
    return tuple(md)


def details_for(e: BaseException) -> str:
    """The message; an OSError's errno travels in metadata, not as an "[Errno N]" prefix."""
    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        return str(e.strerror)
    return str(e)


def coordinator_stopping(e: BaseException) -> bool:
    """The error of work handed to a thread pool that no longer takes any: the
    coordinator's event loop was closed (its default pool shut down) or the interpreter
    began to exit (concurrent.futures refuses new work from its exit hook on). A call
    still running then cannot finish; concurrent.futures says so in these words."""
    return isinstance(e, RuntimeError) and str(e).startswith("cannot schedule new futures after")


def failure(
    method: str, e: BaseException
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
    """How a handler's exception ends its call (a unary call's status, or a node-session
    answer): ckptd errors, ValueError and OSError through the map above (a failed I/O
    call logged too: the operator must fix the disk); anything else is INTERNAL, logged
    with its traceback, since it is a bug."""
    if isinstance(e, E.CkptError | ValueError | OSError):
        if kind_of(e) is E.StorageError:
            log.warning("%s: storage failed: %s", method, e)
        return code_for(e), details_for(e), trailers_for(e)
    if coordinator_stopping(e):
        # Not a bug, and not worth retrying: an embedded coordinator stops with its rank.
        log.info("%s: not finished, the coordinator is stopping", method)
        return (
            grpc.StatusCode.ABORTED,
            f"{method}: not finished: the coordinator is stopping (closed, or its process "
            "is exiting: an embedded coordinator goes with the rank that hosts it). What "
            "the call had not done is left for the job's next start: a save without its "
            "manifest is found unfinished and cleaned up",
            trailers_for(E.SaveAborted()),
        )
    log.error("%s failed", method, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"{method}: internal error: {type(e).__name__}: {e}", ()


async def abort(
    context: grpc.aio.ServicerContext, e: BaseException, code: grpc.StatusCode | None = None
) -> NoReturn:
    """End the call with `e`: its status code (or `code`), its message, its class."""
    await context.abort(code or code_for(e), details_for(e), trailing_metadata=trailers_for(e))
    raise AssertionError("unreachable: context.abort raises")


def error_from(
    code: grpc.StatusCode,
    details: str,
    trailers: Sequence[tuple[str, Any]] | None = None,
    *,
    where: str = "",
) -> E.CkptError:
    """The ckptd error a failed call stands for; `details` already names the call.

    `where` (the coordinator's address) goes into the advice of a storage error, so the
    reader knows whose disk it is.
    """
    md = {k: v for k, v in trailers or ()}
    name = md.get(ERROR_KEY)
    cls = KINDS.get(name) if isinstance(name, str) else None
    if cls is None:
        cls = FROM_CODE.get(code, E.CkptError)
    advice = md.get(ADVICE_KEY)
    if isinstance(advice, str) and advice:
        details = f"{details} (coordinator{' ' + where if where else ''}: {advice})"
    if not issubclass(cls, OSError):
        return cls(details)
    raw_errno, raw_path = md.get(ERRNO_KEY), md.get(PATH_KEY)
    num = int(raw_errno) if isinstance(raw_errno, str) and raw_errno.isdigit() else None
    if num is None:
        return cls(details)
    path = raw_path.decode("utf-8", "replace") if isinstance(raw_path, bytes) else None
    # OSError(errno, strerror, filename): the attributes a caller of open() would find.
    return cls(num, details, path) if path else cls(num, details)
