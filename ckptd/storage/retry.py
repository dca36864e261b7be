"""Time bounds and retries for requests to an object store: the one policy.

Every request that moves a shard's bytes (an UploadPart, a PUT, a ranged GET) and every
step of a multipart upload (create, complete, abort) goes through `call`: each attempt
is cut off after `store_request_timeout_s` (a stalled connection that never sends a byte
ends there, not at the client library's 60 s read timeout times its own retries), and
an attempt that failed for a transient reason (throttling such as S3's `SlowDown`, a
429/5xx status, a reset connection, a timeout) is retried after an exponential backoff
with jitter, at most `store_attempts` times in all. Anything else (missing object,
refused precondition, bad credentials) is raised at once. So a request that keeps
failing raises within

    attempts x timeout + the backoffs (at most attempts x store_backoff_max_s)

and the caller names the object and the rank in the error it raises (a save aborts; the
coordinator tells the other ranks).

The client libraries retry underneath (botocore's modes, s3fs's own loop); those retries
happen inside one attempt here and are cut off by its time bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ckptd import knobs

log = logging.getLogger("ckptd.storage")

T = TypeVar("T")

# Statuses that say "try again": request timeout, throttled, server-side trouble.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Error codes the stores use for the same (S3, GCS JSON, Azure).
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "ServerBusy",
        "OperationTimedOut",
        "rateLimitExceeded",
        "backendError",
    }
)
_TRANSIENT_TEXT = ("SlowDown", "reduce your request rate", "ServiceUnavailable", "ServerBusy")
# Transport failures, by the class name (the client libraries are optional imports).
_TRANSIENT_TYPES = frozenset(
    {
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ClientOSError",
        "ClientConnectorError",
        "ServerTimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteRead",
        "ResponseParserError",
        "HTTPClientError",
        "ServiceRequestError",
        "ServiceResponseError",
        "FSTimeoutError",
    }
)
# Never retried, whatever their cause says.
_FINAL = (FileNotFoundError, FileExistsError, PermissionError, NotImplementedError)


class RequestTimedOut(OSError):
    """A request got no answer within its time bound, on every attempt. An OSError, not
    a TimeoutError: fsspec's sync() would replace a TimeoutError by its own, message-less
    FSTimeoutError."""


@dataclasses.dataclass(frozen=True)
class Policy:
    attempts: int
    timeout_s: float
    backoff_s: float
    backoff_max_s: float

    @property
    def bound_s(self) -> float:
        """The longest one `call` can take before it raises."""
        return self.attempts * (self.timeout_s + self.backoff_max_s)


def policy() -> Policy:
    k = knobs.get()
    return Policy(
        attempts=max(1, k.store_attempts),
        timeout_s=k.store_request_timeout_s,
        backoff_s=k.store_backoff_s,
        backoff_max_s=k.store_backoff_max_s,
    )


def _status(e: BaseException) -> int | None:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):  # botocore ClientError
        meta = resp.get("ResponseMetadata") or {}
        if isinstance(meta.get("HTTPStatusCode"), int):
            return int(meta["HTTPStatusCode"])
    for attr in ("status", "status_code", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    return None


def _code(e: BaseException) -> str | None:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        code = (resp.get("Error") or {}).get("Code")
        return str(code) if code is not None else None
    code = getattr(e, "error_code", None)  # azure
    return str(code) if code is not None else None


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in out and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def transient(e: BaseException) -> bool:
    """Whether a failed request may succeed when sent again (see the module docstring)."""
    if isinstance(e, _FINAL):
        return False
    for x in _chain(e):
        if isinstance(x, _FINAL):
            return False
        if isinstance(
            x,
            (TimeoutError, asyncio.TimeoutError, socket.timeout, ConnectionError, RequestTimedOut),
        ):
            return True
        if type(x).__name__ in _TRANSIENT_TYPES:
            return True
        if _status(x) in TRANSIENT_STATUS or _code(x) in TRANSIENT_CODES:
            return True
        if any(t in str(x) for t in _TRANSIENT_TEXT):
            return True
    return False


def describe(e: BaseException) -> str:
    """The failure in words, with the store's error code and HTTP status where the chain
    holds them (s3fs's OSError keeps only the message): `SlowDown (HTTP 503): ...`."""
    code = status = None
    for x in _chain(e):
        code = code or _code(x)
        status = status or _status(x)
    tag = " ".join(t for t in (code, f"(HTTP {status})" if status else None) if t is not None)
    return f"{type(e).__name__}: {tag + ': ' if tag else ''}{e}"


def _delay(p: Policy, attempt: int) -> float:
    # Full jitter: ranks throttled together do not come back together.
    return random.uniform(0, min(p.backoff_max_s, p.backoff_s * 2 ** (attempt - 1)))


def _give_up(what: str, p: Policy, n: int, e: BaseException) -> None:
    log.warning("%s: attempt %d of %d failed: %s", what, n, p.attempts, describe(e))


async def call(
    what: str,
    fn: Callable[[], Awaitable[T]],
    p: Policy | None = None,
) -> T:
    """Await `fn()` under the policy: each attempt time-bounded, transient failures retried.

    A timeout raises RequestTimedOut naming `what` and the bound; the last failure
    otherwise.
    """
    p = p or policy()
    for n in range(1, p.attempts + 1):
        try:
            return await asyncio.wait_for(fn(), p.timeout_s)
        except asyncio.TimeoutError:
            err: BaseException = RequestTimedOut(
                errno.ETIMEDOUT,
                f"{what}: no answer within {p.timeout_s:g} s (attempt {n} of {p.attempts})",
            )
        except Exception as e:  # noqa: BLE001 - classified below; the final one is raised
            if not transient(e):
                raise
            err = e
        if n == p.attempts:
            raise err
        _give_up(what, p, n, err)
        await asyncio.sleep(_delay(p, n))
    raise AssertionError("unreachable")  # pragma: no cover


def call_blocking(
    what: str,
    fn: Callable[[], T],
    p: Policy | None = None,
) -> T:
    """`call` for a store without an event loop (memory://, local fsspec): transient
    failures retried with backoff; there is no attempt to cut off, the call is local."""
    p = p or policy()
    for n in range(1, p.attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified; the final one is raised
            if not transient(e) or n == p.attempts:
                raise
            _give_up(what, p, n, e)
            time.sleep(_delay(p, n))
    raise AssertionError("unreachable")  # pragma: no cover
