"""A small HTTP fault proxy between a store client and a real store server (moto).

It forwards each request to the server (one upstream connection per request, answered
with `Connection: close`) unless a rule matches it; a rule answers in its place with a
fault, a number of times or for ever:

    slowdown   503 with S3's <Code>SlowDown</Code>: throttled
    503        503 ServiceUnavailable
    reset      the connection is reset halfway through the body (the request's body
               for an upload, the response's for a GET)
    stall      the request is read and nothing is ever sent back, not a byte
    lost       the request reaches the server, its answer never reaches the client (the
               connection is reset): the client cannot tell whether it took effect

Requests are matched by what they do to an object: `upload_part`, `create_upload`,
`complete_upload`, `put` (a whole-object PUT), `get` (a ranged GET), or `any`.

    proxy = FaultProxy("127.0.0.1", moto_port); proxy.start()
    proxy.inject("upload_part", "slowdown", times=2)
    ...point the client at proxy.endpoint...
    proxy.stop()
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import threading
from urllib.parse import parse_qs, urlsplit

FAULTS = ("slowdown", "503", "reset", "stall", "lost")
OPS = ("upload_part", "create_upload", "complete_upload", "put", "get", "any")

_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>{msg}</Message><RequestId>fault-proxy</RequestId></Error>"
)


@dataclasses.dataclass
class Rule:
    op: str
    fault: str
    times: int  # < 0: for ever
    key: str = ""  # only requests whose path contains this
    hits: int = 0


def classify(method: str, target: str, headers: dict[str, str]) -> str:
    q = parse_qs(urlsplit(target).query, keep_blank_values=True)
    if method == "PUT" and "partNumber" in q and "uploadId" in q:
        return "upload_part"
    if method == "POST" and "uploads" in q:
        return "create_upload"
    if method == "POST" and "uploadId" in q:
        return "complete_upload"
    if method == "PUT" and not q:
        return "put"
    if method == "GET" and "range" in headers:
        return "get"
    return "other"


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self.rules: list[Rule] = []
        self.faults_sent: list[tuple[str, str, str]] = []  # (op, fault, path)
        self.seen: list[tuple[str, str]] = []  # (op, target) of every request
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._stalled: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- control, from the test's thread ----------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        )
        self._server = fut.result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            for w in list(self._stalled):
                w.close()
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def inject(self, op: str, fault: str, *, times: int = 1, key: str = "") -> Rule:
        assert op in OPS and fault in FAULTS, (op, fault)
        rule = Rule(op, fault, times, key)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def release_stalls(self) -> None:
        """Close the connections that stalled (their clients gave up on them already)."""
        asyncio.run_coroutine_threadsafe(self._release(), self._loop).result(10)

    async def _release(self) -> None:
        for w in list(self._stalled):
            w.close()
        self._stalled.clear()

    def _match(self, op: str, target: str) -> Rule | None:
        with self._lock:
            self.seen.append((op, target))
            for r in self.rules:
                if r.op not in ("any", op) or r.key not in target:
                    continue
                if r.times >= 0 and r.hits >= r.times:
                    continue
                r.hits += 1
                self.faults_sent.append((op, r.fault, target))
                return r
        return None

    # -- the proxy, on its loop ----------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            if writer not in self._stalled:
                writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        op = classify(method, target, headers)
        rule = self._match(op, target)
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        length = int(headers.get("content-length", "0") or 0)
        if rule is not None and rule.fault == "reset" and length > 0:
            await reader.readexactly(length // 2)
            _reset(writer)
            return
        body = await _read_body(reader, headers, length)
        if rule is not None and rule.fault in ("slowdown", "503"):
            code, msg = (
                ("SlowDown", "Please reduce your request rate.")
                if rule.fault == "slowdown"
                else ("ServiceUnavailable", "Service is unable to handle request.")
            )
            xml = _XML.format(code=code, msg=msg).encode()
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(xml)}\r\nConnection: close\r\n\r\n".encode()
                + xml
            )
            await writer.drain()
            return
        if rule is not None and rule.fault == "stall":
            self._stalled.add(writer)
            await reader.read()  # until the client gives up and closes
            return
        response = await self._forward(lines, headers, body)
        if rule is not None and rule.fault == "lost":
            _reset(writer)
            return
        if rule is not None and rule.fault == "reset":  # no request body: cut the response
            cut = response.index(b"\r\n\r\n") + 4
            writer.write(response[: cut + (len(response) - cut) // 2])
            await writer.drain()
            _reset(writer)
            return
        writer.write(response)
        await writer.drain()

    async def _forward(self, lines: list[str], headers: dict[str, str], body: bytes) -> bytes:
        ur, uw = await asyncio.open_connection(*self.upstream)
        try:
            out = [lines[0]]
            for line in lines[1:]:
                name = line.split(":", 1)[0].strip().lower()
                if line and name not in ("connection", "expect", "transfer-encoding"):
                    out.append(line)
            if "transfer-encoding" in headers:
                out.append(f"Content-Length: {len(body)}")
            out.append("Connection: close")
            uw.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body)
            await uw.drain()
            raw = await ur.read()
        finally:
            uw.close()
        cut = raw.index(b"\r\n\r\n")
        rhead = [
            h
            for h in raw[:cut].decode("latin-1").split("\r\n")
            if h.split(":", 1)[0].strip().lower() != "connection"
        ]
        return ("\r\n".join([*rhead, "Connection: close"]) + "\r\n\r\n").encode("latin-1") + raw[
            cut + 4 :
        ]


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], length: int) -> bytes:
    if headers.get("transfer-encoding", "").lower() != "chunked":
        return await reader.readexactly(length) if length else b""
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST, not FIN: the peer sees 'connection reset by peer'."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
