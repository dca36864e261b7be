"""The object stores' one retry policy (ckptd/storage/retry.py): what is transient, the
time bound of an attempt, how many tries, and what an error says."""

from __future__ import annotations

import asyncio

import pytest
from botocore.exceptions import ClientError

from ckptd.storage import retry

FAST = retry.Policy(attempts=3, timeout_s=0.2, backoff_s=0.01, backoff_max_s=0.02)


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "UploadPart",
    )


def translated(e: BaseException) -> OSError:
    """As s3fs raises it: an OSError with only the message, the ClientError its cause."""
    out = OSError(16, str(e))
    out.__cause__ = e
    return out


@pytest.mark.parametrize(
    "err, want",
    [
        (translated(client_error("SlowDown", 503)), True),
        (translated(client_error("ServiceUnavailable", 503)), True),
        (translated(client_error("InternalError", 500)), True),
        (client_error("ThrottlingException", 400), True),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (translated(client_error("AccessDenied", 403)), False),
        (FileNotFoundError("no such key"), False),
        (FileExistsError("precondition failed"), False),
        (ValueError("bad argument"), False),
    ],
)
def test_what_is_transient(err, want):
    assert retry.transient(err) is want


def test_describe_names_the_stores_code_and_status():
    msg = retry.describe(translated(client_error("SlowDown", 503)))
    assert msg.startswith("OSError: SlowDown (HTTP 503): ")


def test_a_transient_failure_is_retried_then_succeeds():
    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise translated(client_error("SlowDown", 503))
        return "etag"

    assert asyncio.run(retry.call("part 1", flaky, FAST)) == "etag"
    assert len(calls) == 3


def test_a_stalled_attempt_is_cut_off_and_the_last_one_raises_naming_the_bound():
    calls: list[int] = []

    async def stall() -> None:
        calls.append(1)
        await asyncio.sleep(3600)

    with pytest.raises(retry.RequestTimedOut, match=r"part 7: no answer within 0.2 s \(attempt 3"):
        asyncio.run(retry.call("part 7", stall, FAST))
    assert len(calls) == 3


def test_a_final_failure_is_raised_at_once():
    calls: list[int] = []

    async def denied() -> None:
        calls.append(1)
        raise translated(client_error("AccessDenied", 403))

    with pytest.raises(OSError, match="AccessDenied"):
        asyncio.run(retry.call("put", denied, FAST))
    assert len(calls) == 1


def test_blocking_calls_retry_too():
    calls: list[int] = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) < 2:
            raise ConnectionResetError(104, "reset")
        return 5

    assert retry.call_blocking("read", flaky, FAST) == 5
    assert len(calls) == 2
