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

from ckpt import _world
from ckpt._embedded import EmbeddedCoordinator
from ckptd.server.client import CoordinatorClient


@dataclasses.dataclass
class Connection:
    client: CoordinatorClient
    generation: int
    attempt: str


_lock = threading.Lock()
_connections: dict[tuple[str, str | None, str | None, str], Connection] = {}
# This module's handle on each job's embedded coordinator (ckpt._embedded shares one per job
# and process, stopped when its last handle closes): held so that later saves reuse it.
_embedded: dict[str, EmbeddedCoordinator] = {}
_at_exit = False


def connect(
    path: str, *, address: str | None, token: str | None, attempt: str | None
) -> Connection:
    """The (cached) connection for job `path`; opens the job to learn its generation."""
    global _at_exit
    address = address or os.environ.get("CKPTD_ADDRESS")
    token = token if token is not None else os.environ.get("CKPTD_TOKEN")
    attempt = _world.attempt_id(attempt, 2) or _world.PROCESS_ATTEMPT
    key = (path, address, token, attempt)
    with _lock:
        conn = _connections.get(key)
        if conn is not None:
            return conn
        if not _at_exit:
            atexit.register(close_all)
            _at_exit = True
        if address is None:
            embedded = _embedded.get(path)
            if embedded is None:
                embedded = _embedded[path] = EmbeddedCoordinator(path)
            address, token = embedded.address, embedded.token
        client = CoordinatorClient(address, token=token)
        try:
            generation, _ = client.open_job(path, attempt)
        except BaseException:
            client.close()
            raise
        conn = _connections[key] = Connection(client, generation, attempt)
        return conn


def close(path: str) -> None:
    """Close job `path`'s connections and embedded coordinator (before removing its files)."""
    with _lock:
        conns = [_connections.pop(k) for k in list(_connections) if k[0] == path]
        embedded = [_embedded.pop(path)] if path in _embedded else []
    _close(conns, embedded)


def close_all() -> None:
    """Close every cached connection and embedded coordinator; later saves reopen them."""
    with _lock:
        conns = list(_connections.values())
        embedded = list(_embedded.values())
        _connections.clear()
        _embedded.clear()
    _close(conns, embedded)


def _close(conns: list[Connection], embedded: list[EmbeddedCoordinator]) -> None:
    for c in conns:
        c.client.close()
    for e in embedded:
        e.close()
