"""The agent's server: one thread per connection, length-prefixed JSON frames (wire.py).

Every request carries the job's token (compared in constant time); a request without it
is refused and the connection closed. Paths are relative to the agent's root and checked
by the storage's confinement (ckptd.storage.paths); the only file a client may write is a
step's QUARANTINED.json (a load that found the copy damaged marks it, as in storage).

Operations: ping; prepare / seal (a rank of this node writes its shard in place, then the
agent checks it and sends it on to the peer agents the rank names: `replicas`);
put (a peer's copy arrives); commit (the memory commit's manifest); usage; drop; and the
reads a Storage needs (listdir, exists, size, read, write_atomic), so another node's
ranks can read what this agent holds (ckptd.agent.client.AgentStorage). seal answers
with the nodes now holding the shard and the index digest each one's agent computed: what
the rank reports to the coordinator, which commits on it (ckptd.coordinator.memory).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import socketserver
import threading
import time
from typing import Any

from ckptd.agent import wire
from ckptd.agent.holdings import Holdings
from ckptd.errors import CkptError, InvalidRequest, Unauthenticated
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout

log = logging.getLogger("ckptd.agent")

AGENT_FILE = "agent.json"
MAX_SMALL = 64 << 20
MAX_READ = 256 << 20


class AgentServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, holdings: Holdings, token: str, host: str = "127.0.0.1", port: int = 0):
        if not token:
            raise Unauthenticated("a memory agent needs the job's token (none was given)")
        self.holdings, self.token = holdings, token
        super().__init__((host, port), _Handler)
        self.host = host
        self.port = int(self.server_address[1])

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def publish(self) -> None:
        """Write agent.json (pid, address) into the root, atomically: how ranks find it."""
        info = {"pid": os.getpid(), "address": self.address, "node": self.holdings.node}
        self.holdings.storage.write_atomic(AGENT_FILE, json.dumps(info).encode())

    def serve_until_root_gone(self, poll_s: float = 1.0) -> None:
        """Serve until stopped, or until the root directory is removed (the node's shared
        memory was wiped: nothing is left to serve)."""
        t = threading.Thread(target=self.serve_forever, name="ckptd-agent", daemon=True)
        t.start()
        try:
            while t.is_alive():
                if not os.path.isdir(self.holdings.root):
                    log.warning("memory agent: %s is gone; exiting", self.holdings.root)
                    break
                time.sleep(poll_s)
        finally:
            self.shutdown()
            self.server_close()


class _Handler(socketserver.BaseRequestHandler):
    server: AgentServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                header = wire.recv_header(sock)
            except (CkptError, OSError) as e:
                log.warning("memory agent: dropping a connection: %s", e)
                return
            if header is None:
                return
            if not wire.token_ok(header.get("token"), self.server.token):
                wire.send(
                    sock,
                    wire.error_reply(
                        Unauthenticated(
                            "memory agent: missing or wrong token: pass the job's token "
                            "(CKPTD_TOKEN or the job directory's agent token)"
                        )
                    ),
                )
                return
            consumed = header["nbytes"] == 0
            try:
                reply, payload, consumed = self._dispatch(sock, header)
            except (CkptError, OSError, ValueError, KeyError, TypeError) as e:
                if not isinstance(e, CkptError):
                    e = InvalidRequest(f"memory agent op {header.get('op')!r}: {e}")
                log.warning("memory agent: %s", e)
                wire.send(sock, wire.error_reply(e))
                if not consumed:
                    return  # the payload is still on the socket: this connection is done
                continue
            wire.send(sock, dict(reply, ok=True), payload)

    def _dispatch(
        self, sock: socket.socket, h: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Any], bool]:
        hold = self.server.holdings
        st = hold.storage
        op = h.get("op")
        if op == "ping":
            return {"node": hold.node, "pid": os.getpid(), "root": hold.root}, [], True
        if op == "usage":
            return {"usage": hold.usage()}, [], True
        if op == "prepare":
            hold.prepare(int(h["step"]), [str(f) for f in h["files"]], int(h["size"]))
            return {}, [], True
        if op == "release":
            hold.release(int(h["step"]), [str(f) for f in h["files"]])
            return {}, [], True
        if op == "seal":
            shard, digest = hold.seal(h)
            held, failures = [{"node": hold.node, "index_blake3": digest}], []
            for peer in h.get("replicas", []):
                try:
                    node, got = _replicate(self.server, int(h["step"]), h["shard"], str(peer))
                    held.append({"node": node, "index_blake3": got})
                except (CkptError, OSError) as e:
                    failures.append(f"{peer}: {e}")
                    log.error(
                        "memory agent node %d: step %s rank %d: the copy to %s failed: %s",
                        hold.node,
                        h["step"],
                        shard.rank,
                        peer,
                        e,
                    )
            # What each holder's agent computed: the coordinator commits on these.
            return {"held": held, "failures": failures}, [], True
        if op == "put":
            _, digest = hold.receive(sock, h)
            return {"node": hold.node, "index_blake3": digest}, [], True
        if op == "commit":
            data = wire.recv_payload(sock, h, MAX_SMALL)
            return {"missing": hold.commit(data)}, [], True
        if op == "drop":
            hold.drop(int(h["step"]))
            return {}, [], True
        if op == "listdir":
            return {"names": st.listdir(str(h["path"]))}, [], True
        if op == "exists":
            return {"exists": st.exists(str(h["path"]))}, [], True
        if op == "size":
            return {"size": st.size(str(h["path"]))}, [], True
        if op == "read":
            off, n = int(h["offset"]), int(h["length"])
            if off < 0 or n < 0 or n > MAX_READ:
                raise InvalidRequest(f"memory agent read of {n} bytes at {off}: out of range")
            return {}, [_read(st, str(h["path"]), off, n)], True
        if op == "write_atomic":
            path = str(h["path"])
            data = wire.recv_payload(sock, h, 1 << 16)
            parts = path.split("/")
            if (
                len(parts) != 2
                or layout.parse_step_dir(parts[0]) is None
                or parts[1] != (ckfmt.QUARANTINE_NAME)
            ):
                raise InvalidRequest(
                    f"memory agent: {path!r} is not a step's {ckfmt.QUARANTINE_NAME}; "
                    "clients write nothing else"
                )
            st.write_atomic(path, data)
            return {}, [], True
        raise InvalidRequest(f"memory agent: unknown op {op!r}")


def _read(st: Any, path: str, off: int, n: int) -> Any:
    full = st.full(path)
    with open(full, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if off + n > size:
            raise InvalidRequest(f"memory agent read of {path}: {off}+{n} past its {size} bytes")
        f.seek(off)
        buf = bytearray(n)
        got = f.readinto(buf)
        return memoryview(buf)[:got]


def _replicate(server: AgentServer, step: int, shard: dict[str, Any], peer: str) -> tuple[int, str]:
    """Send a sealed shard and its index to a peer agent; returns the peer's node and the
    index digest it computed."""
    hold = server.holdings
    files = [
        hold.storage.full(f"{layout.step_dir(step)}/{shard['path']}"),
        hold.storage.full(f"{layout.step_dir(step)}/{shard['index']}"),
    ]
    host, _, port = peer.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        maps, fds = [], []
        try:
            for full in files:
                fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
                fds.append(fd)
                size = os.fstat(fd).st_size
                maps.append(mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b"")
            views = [memoryview(m) for m in maps]
            try:
                wire.send(
                    sock, {"op": "put", "token": server.token, "step": step, "shard": shard}, views
                )
            finally:
                for v in views:
                    v.release()
        finally:
            for m in maps:
                if isinstance(m, mmap.mmap):
                    m.close()
            for fd in fds:
                os.close(fd)
        reply = wire.recv_header(sock)
        if reply is None:
            raise ConnectionError(f"memory agent {peer} closed the connection")
        wire.raise_for(reply, f"memory agent {peer} step {step} rank {shard.get('rank')}")
        return int(reply["node"]), str(reply["index_blake3"])
