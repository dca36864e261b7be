"""A client of one memory agent, and the read-only Storage over what it holds.

`AgentClient.call` sends one request frame and reads the reply on a connection it keeps
(reconnecting once when the agent restarted). `AgentStorage` is the Storage the load
policy reads another node's memory through (the "peer" tier): every read is a request to
that node's agent, and every byte read is then verified like any stored byte. Its only
write is a step's QUARANTINED.json (a load that found the copy damaged marks it).
`HeldStorage` reads a memory step's files from whichever node of the ring holds each one
(this node's memory first), so a ring of more nodes than copies loads too.
"""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from ckptd.agent import wire
from ckptd.errors import CkptError, InvalidManifest, StorageError
from ckptd.storage.base import ReadHandle, Storage, WriteHandle


class AgentClient:
    def __init__(self, address: str, token: str, *, timeout_s: float = 600.0):
        self.address, self.token, self.timeout_s = address, token, timeout_s
        self._local = threading.local()  # one connection per thread (reads run in pools)
        self._all: set[socket.socket] = set()
        self._lock = threading.Lock()

    def _sock(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            host, _, port = self.address.rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock = sock
            with self._lock:
                self._all.add(sock)
        return sock

    def _drop(self) -> None:
        """Close this thread's connection (after an error: the stream may be mid-frame)."""
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            self._local.sock = None
            with self._lock:
                self._all.discard(sock)
            sock.close()

    def close(self) -> None:
        """Close every thread's connection."""
        self._local = threading.local()
        with self._lock:
            socks, self._all = self._all, set()
        for sock in socks:
            sock.close()

    def call(
        self, op: str, what: str, payload: Iterable[Any] = (), **fields: Any
    ) -> tuple[dict[str, Any], bytes]:
        """One request; returns the reply header and its payload. Raises the agent's
        error as its ckptd.errors class, and StorageError when the agent is unreachable."""
        pieces = list(payload)
        reply: dict[str, Any] = {}
        data = b""
        for attempt in (0, 1):
            try:
                sock = self._sock()
                wire.send(sock, {"op": op, "token": self.token, **fields}, pieces)
                got = wire.recv_header(sock)
                if got is None:
                    raise ConnectionError("the agent closed the connection")
                reply = got
                data = wire.recv_payload(sock, reply, 1 << 31)
                break
            except (OSError, ValueError) as e:
                self._drop()
                if attempt == 1 or pieces:
                    raise StorageError(
                        errno.ECONNREFUSED,
                        f"{what}: the memory agent at {self.address} cannot be reached "
                        f"({type(e).__name__}: {e})",
                    ) from e
        if not reply.get("ok") and reply.get("error", {}).get("type") == "Unauthenticated":
            self._drop()  # the agent hangs up on a refused token
        wire.raise_for(reply, what)
        return reply, data


class AgentStorage(Storage):
    """Read what another node's agent holds, as a Storage (the load policy's "peer")."""

    def __init__(self, client: AgentClient, *, node: int):
        self.client, self.node = client, node
        self.url = f"agent://{client.address}/node{node}"

    def _what(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url

    def listdir(self, path: str) -> list[str]:
        return list(self.client.call("listdir", self._what(path), path=path)[0]["names"])

    def exists(self, path: str) -> bool:
        return bool(self.client.call("exists", self._what(path), path=path)[0]["exists"])

    def size(self, path: str) -> int:
        return int(self.client.call("size", self._what(path), path=path)[0]["size"])

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        n = self.size(path)
        if n > limit:
            raise InvalidManifest(f"{self._what(path)} is {n} bytes, over the {limit}-byte limit")
        return self.client.call("read", self._what(path), path=path, offset=0, length=n)[1]

    def open_read(self, path: str, *, cold: bool = False) -> ReadHandle:
        return _AgentRead(self, path, self.size(path))

    def write_atomic(self, path: str, data: bytes) -> None:
        self.client.call("write_atomic", self._what(path), [data], path=path)

    def makedirs(self, path: str) -> None:
        raise CkptError(f"{self._what(path)}: a peer's memory is written by its agent only")

    def open_write(
        self, path: str, size: int, *, preallocate: bool = False, reuse: str | None = None
    ) -> WriteHandle:
        raise CkptError(f"{self._what(path)}: a peer's memory is written by its agent only")

    def remove_tree(self, path: str) -> None:
        raise CkptError(f"{self._what(path)}: a peer's memory is evicted by its agent only")

    def rename(self, src: str, dst: str) -> None:
        raise CkptError(f"{self._what(src)}: a peer's memory is written by its agent only")

    @property
    def supports_reuse(self) -> bool:
        return False

    def local_path(self, path: str) -> str | None:
        return None


class _AgentRead(ReadHandle):
    _PIECE = 64 << 20

    def __init__(self, storage: AgentStorage, path: str, size: int):
        self.storage, self.path, self.size = storage, path, size

    def read(self, offset: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.uint8)
        at = 0
        while at < length:
            n = min(self._PIECE, length - at)
            _, data = self.storage.client.call(
                "read", self.storage._what(self.path), path=self.path, offset=offset + at, length=n
            )
            if len(data) != n:
                raise StorageError(
                    errno.EIO,
                    f"{self.storage._what(self.path)}: short read at {offset + at} "
                    f"({len(data)} of {n} bytes)",
                )
            out[at : at + n] = np.frombuffer(data, dtype=np.uint8)
            at += n
        return out

    def close(self) -> None:
        pass


class HeldStorage(Storage):
    """A memory step's files wherever the ring holds them (the load policy's "memory" and
    "peer" tiers).

    A ring of more nodes than copies spreads a step's shards: a node holds its own and its
    ring predecessors', and a rank may need another's (a replicated tensor written once, a
    resharded load). `members` are storages nearest first (this node's shared memory, then
    the peers' agents in ring order); each file is read from the first member that holds
    it, and a member that cannot be reached (its node is gone) is skipped. The root lists
    the `listed` members' steps (this node's memory: its own commits; the peers' tier: the
    union of theirs). A damaged copy fails verification like any stored byte; its
    QUARANTINED.json goes to the first member holding the step, which marks the step in
    this tier (any member's marker does).

    `nodes` names each member's node and `home` this rank's: `origin(path)` is the node a
    file was read from (the member that served it last), which the load policy reports
    per shard file (LoadResult.shard_tiers, ckpt._provenance).
    """

    def __init__(
        self,
        members: list[Storage],
        *,
        nodes: list[int],
        home: int,
        listed: int | None = None,
        url: str = "",
    ):
        if not members or len(nodes) != len(members):
            raise ValueError("HeldStorage needs at least one member, and one node for each")
        self.members, self.nodes, self.home = members, nodes, home
        self.listed = members[: listed if listed is not None else len(members)]
        self.url = url or "+".join(m.url for m in members)
        self._served: dict[str, int] = {}  # path -> the member that served it last

    def _holder(self, path: str) -> Storage:
        for i, m in enumerate(self.members):
            try:
                if m.exists(path):
                    self._served[path] = i
                    return m
            except (CkptError, OSError):
                continue  # that node is gone or refuses: the next holder
        return self.members[0]  # nobody holds it: the nearest member says so, its own way

    def origin(self, path: str) -> int:
        """The node `path` was read from (else the node that would serve it now)."""
        i = self._served.get(path)
        if i is None:
            self._holder(path)
            i = self._served.get(path, 0)
        return self.nodes[i]

    def label(self, node: int) -> str:
        """How a load names a file read from `node`'s memory: "memory" for this rank's
        node, "peer:node<N>" for another's."""
        return "memory" if node == self.home else f"peer:node{node}"

    def listdir(self, path: str) -> list[str]:
        names: set[str] = set()
        errors: list[BaseException] = []
        for m in self.listed if path == "" else self.members:
            try:
                names.update(m.listdir(path))
            except (CkptError, OSError) as e:
                errors.append(e)
        if errors and len(errors) == len(self.listed if path == "" else self.members):
            raise errors[0]
        return sorted(names)

    def exists(self, path: str) -> bool:
        return self._holder(path).exists(path)

    def size(self, path: str) -> int:
        return self._holder(path).size(path)

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        return self._holder(path).read_bytes(path, limit=limit)

    def open_read(self, path: str, *, cold: bool = False) -> ReadHandle:
        return self._holder(path).open_read(path, cold=cold)

    def local_path(self, path: str) -> str | None:
        return self._holder(path).local_path(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        step = path.split("/", 1)[0]
        self._holder(step).write_atomic(path, data)

    def makedirs(self, path: str) -> None:
        raise CkptError(f"{self.url}/{path}: memory is written by the agents only")

    def open_write(
        self, path: str, size: int, *, preallocate: bool = False, reuse: str | None = None
    ) -> WriteHandle:
        raise CkptError(f"{self.url}/{path}: memory is written by the agents only")

    def remove_tree(self, path: str) -> None:
        raise CkptError(f"{self.url}/{path}: memory is evicted by the agents only")

    def rename(self, src: str, dst: str) -> None:
        raise CkptError(f"{self.url}/{src}: memory is written by the agents only")

    @property
    def supports_reuse(self) -> bool:
        return False
