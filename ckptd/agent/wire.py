"""The agent's wire format: a length-prefixed JSON header, then raw bytes. No pickle.

One frame is `!II` (header length, 0), the header (UTF-8 JSON object, at most 1 MiB),
then `header["nbytes"]` raw bytes. Requests carry `op` and `token`; replies carry `ok`
and, on failure, `error` {type, message}. Raw bytes rather than gRPC: a shard is streamed
from its shared-memory file straight into a socket (and back into a file) in large
pieces, with no 2 GiB message limit and no protobuf copy of the payload; the header is
JSON so every field is checked by name, and nothing on the wire is ever unpickled.

Errors travel as a ckptd.errors class name and message; only CkptError subclasses are
rebuilt from a name (any other name reads as CkptError), so a peer cannot make a client
construct an arbitrary type.
"""

from __future__ import annotations

import hmac
import json
import socket
import struct
from collections.abc import Iterable
from typing import Any

from ckptd import errors

_FRAME = struct.Struct("!II")
MAX_HEADER = 1 << 20
_PIECE = 8 << 20


def send(sock: socket.socket, header: dict[str, Any], payload: Iterable[Any] = ()) -> None:
    """Send one frame: `header` (its nbytes set from `payload`), then the payload pieces
    (buffers: bytes, memoryview, numpy arrays)."""
    pieces = [memoryview(p).cast("B") for p in payload]
    header = dict(header, nbytes=sum(p.nbytes for p in pieces))
    data = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_HEADER:
        raise errors.InvalidRequest(f"agent header of {len(data)} bytes is over {MAX_HEADER}")
    sock.sendall(_FRAME.pack(len(data), 0) + data)
    for p in pieces:
        for start in range(0, p.nbytes, _PIECE):
            sock.sendall(p[start : start + _PIECE])


def recv_header(sock: socket.socket) -> dict[str, Any] | None:
    """The next frame's header (its payload is still on the socket); None at a clean EOF."""
    head = _recv_exact(sock, _FRAME.size, eof_ok=True)
    if head is None:
        return None
    n, _ = _FRAME.unpack(head)
    if n > MAX_HEADER:
        raise errors.InvalidRequest(f"agent header of {n} bytes is over {MAX_HEADER}")
    raw = _recv_exact(sock, n)
    assert raw is not None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise errors.InvalidRequest(f"agent header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise errors.InvalidRequest("agent header is not a JSON object")
    nbytes = doc.get("nbytes", 0)
    if not isinstance(nbytes, int) or nbytes < 0:
        raise errors.InvalidRequest(f"agent header nbytes {nbytes!r} is not a size")
    return doc


def recv_into(sock: socket.socket, buf: memoryview) -> None:
    """Fill `buf` from the socket (a frame's payload, or part of it)."""
    got = 0
    while got < buf.nbytes:
        n = sock.recv_into(buf[got:], min(buf.nbytes - got, _PIECE))
        if n == 0:
            raise ConnectionError("the agent connection closed in the middle of a payload")
        got += n


def recv_payload(sock: socket.socket, header: dict[str, Any], limit: int) -> bytes:
    n = int(header.get("nbytes", 0))
    if n > limit:
        raise errors.InvalidRequest(f"agent payload of {n} bytes is over {limit} for this op")
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def discard(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, _PIECE) or 1))
    while n > 0:
        k = min(n, scratch.nbytes)
        recv_into(sock, scratch[:k])
        n -= k


def _recv_exact(sock: socket.socket, n: int, *, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if eof_ok and got == 0:
                return None
            raise ConnectionError("the agent connection closed in the middle of a frame")
        got += k
    return bytes(buf)


def token_ok(given: object, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def error_reply(e: BaseException) -> dict[str, Any]:
    kind = type(e).__name__ if isinstance(e, errors.CkptError) else "CkptError"
    return {"ok": False, "error": {"type": kind, "message": str(e) or type(e).__name__}}


def raise_for(reply: dict[str, Any], what: str) -> None:
    """Raise the error a reply carries, as its ckptd.errors class (CkptError otherwise)."""
    if reply.get("ok"):
        return
    err = reply.get("error") or {}
    name = str(err.get("type", "CkptError"))
    kind = getattr(errors, name, None)
    if not (isinstance(kind, type) and issubclass(kind, errors.CkptError)):
        kind = errors.CkptError
    raise kind(f"{what}: {err.get('message', 'the agent gave no reason')}")
