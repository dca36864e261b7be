"""One coordinator connection per job and process, for integrations that commit from one rank.

DCP gathers every rank's write results to its coordinator rank, so only that process talks
to ckptd's coordinator: the `ckptd serve` at $CKPTD_ADDRESS (token $CKPTD_TOKEN), or else
an embedded one started in that process (ckpt._embedded), kept for the life of the process
so that saves of later steps reuse it. The attempt (see ckpt._world) is stable for the
process: a new StorageWriter per save does not fence the previous save still in flight.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import uuid

from ckpt import _world
from ckpt._embedded import EmbeddedCoordinator
from ckpt._transport import CoordinatorClient

_PROCESS_ATTEMPT = f"process-{uuid.uuid4()}"


@dataclasses.dataclass
class Connection:
    client: CoordinatorClient
    generation: int
    attempt: str
    embedded: EmbeddedCoordinator | None


_lock = threading.Lock()
_connections: dict[tuple[str, str | None, str], Connection] = {}
_at_exit = False


def connect(
    path: str, *, address: str | None, token: str | None, attempt: str | None
) -> Connection:
    """The (cached) connection for job `path`; opens the job to learn its generation."""
    address = address or os.environ.get("CKPTD_ADDRESS")
    token = token if token is not None else os.environ.get("CKPTD_TOKEN")
    attempt = _world.attempt_id(attempt, 2) or _PROCESS_ATTEMPT
    key = (path, address, attempt)
    with _lock:
        conn = _connections.get(key)
        if conn is not None:
            return conn
        embedded = None
        if address is None:
            embedded = EmbeddedCoordinator(path)
            address, token = embedded.address, embedded.token
        client = CoordinatorClient(address, token=token)
        try:
            generation, _ = client.open_job(path, attempt)
        except BaseException:
            client.close()
            if embedded is not None:
                embedded.close()
            raise
        global _at_exit
        if not _at_exit:
            atexit.register(close_all)
            _at_exit = True
        conn = _connections[key] = Connection(client, generation, attempt, embedded)
        return conn


def close(path: str) -> None:
    """Close the connections of job `path` (before its directory is removed)."""
    with _lock:
        conns = [_connections.pop(k) for k in list(_connections) if k[0] == path]
    _close(conns)


def close_all() -> None:
    """Close every cached connection (and embedded coordinator); later saves reopen them."""
    with _lock:
        conns = list(_connections.values())
        _connections.clear()
    _close(conns)


def _close(conns: list[Connection]) -> None:
    for c in conns:
        c.client.close()
        if c.embedded is not None:
            c.embedded.close()
