"""How a Checkpointer reaches its job's coordinator, and under which attempt.

A configured service ("host:port", or $CKPTD_ADDRESS) is used as it is; the ranks then
agree on the attempt through the process group's store when nothing names it. With no
address (zero-config), one process hosts an embedded coordinator: the process itself
when it is alone, else rank 0, which publishes the address, token and attempt in the
process group's key-value store for the others (a key-value service, not a collective:
a slow rank never blocks another's training). Under torchrun with a store per round,
rank 0 names every launch afresh too (a replaced node counts its restarts from 0).

Under torchrun with more than one rank per node (LOCAL_WORLD_SIZE > 1), each node's local
rank 0 also hosts the node's aggregator (ckptd.server.node) on 127.0.0.1 and publishes its
port in the store; the node's ranks then speak the save protocol to it (`save_client`), and
it makes one RPC per node and phase to the coordinator. Zero configuration, with either
coordinator; CKPT_NODE_AGGREGATOR=0 opts out (every rank talks to the coordinator).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from ckpt import _world
from ckpt._embedded import EmbeddedCoordinator
from ckptd.errors import CkptError
from ckptd.server.client import CoordinatorClient
from ckptd.server.node import NodeAggregator

log = logging.getLogger("ckpt")

_opens_lock = threading.Lock()
_opens: dict[str, int] = {}  # connect() calls for each job in this process


@dataclasses.dataclass
class Connection:
    """An open job: the client, this attempt's generation, and what hosts the coordinator."""

    client: CoordinatorClient
    address: str
    attempt: str
    generation: int
    job_name: str
    embedded: EmbeddedCoordinator | None
    # The save protocol's client: the node's aggregator, or `client` itself.
    save_client: CoordinatorClient | None = None
    aggregator: NodeAggregator | None = None  # hosted here (local rank 0 of a node)
    opened: int = 1  # the n-th open of this job in this process (its store keys' suffix)

    def __post_init__(self) -> None:
        if self.save_client is None:
            self.save_client = self.client

    def close(self) -> None:
        if self.save_client is not self.client and self.save_client is not None:
            self.save_client.close()
        if self.aggregator is not None:
            self.aggregator.close()
        self.client.close()
        if self.embedded is not None:
            self.embedded.close()


def connect(
    path: str,
    *,
    rank: int,
    world_size: int,
    address: str | None,
    token: str | None,
    attempt: str | None,
    lease_s: float,
    barrier_timeout_s: float,
    tls_root_cert: bytes | None = None,
    tls_client_cert: tuple[bytes, bytes] | None = None,
) -> Connection:
    """Find (or host) the coordinator of job `path` and open the job under this attempt."""
    address = address or os.environ.get("CKPTD_ADDRESS")
    token = token if token is not None else os.environ.get("CKPTD_TOKEN")
    # None: rank 0 names the launch and the others take its name from the store.
    attempt = (
        None if _world.rank0_names_attempt(attempt) else _world.attempt_id(attempt, world_size)
    )
    embedded: EmbeddedCoordinator | None = None
    # The store keys of this open: a later Checkpointer of the job in this launch (a
    # second trainer.train()) must not be handed the closed one's coordinator or node
    # aggregator. Every rank opens a job's Checkpointers in the same order (its rank 0
    # hosts each), so the n-th open names the same keys on every rank.
    with _opens_lock:
        opened = _opens[path] = _opens.get(path, 0) + 1
    if address is None:
        address, token, attempt, embedded = _zero_config(
            path, opened, rank, world_size, attempt, lease_s, barrier_timeout_s
        )
    elif attempt is None:
        attempt = _shared_attempt(path, rank, world_size)
    try:
        # UNAVAILABLE is retried for about the lease once the coordinator answered (the
        # ranks' leases expire then anyway); a first contact gets a short window.
        client = CoordinatorClient(
            address,
            token=token,
            root_certificates=tls_root_cert,
            client_cert=tls_client_cert,
            retry_for_s=lease_s,
        )
        try:
            generation, job_name = client.open_job(path, attempt)
        except BaseException:
            client.close()
            raise
    except BaseException:
        if embedded is not None:
            embedded.close()
        raise
    conn = Connection(client, address, attempt, generation, job_name, embedded, opened=opened)
    try:
        _join_node(conn, path, opened, rank, world_size, token)
    except BaseException:
        conn.close()
        raise
    return conn


def node_of(rank: int, world_size: int) -> tuple[str, list[int]] | None:
    """This rank's node (name, its ranks) when its ranks should batch through an
    aggregator: under torchrun with LOCAL_WORLD_SIZE > 1, unless CKPT_NODE_AGGREGATOR=0."""
    if os.environ.get("CKPT_NODE_AGGREGATOR", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if local_world <= 1 or world_size <= 1 or not 0 <= local_rank < local_world:
        return None
    first = rank - local_rank  # torchrun numbers a node's ranks contiguously
    group = os.environ.get("GROUP_RANK") or str(first // local_world)
    ranks = list(range(first, first + local_world))
    if first < 0 or ranks[-1] >= world_size:
        return None
    return f"{socket.gethostname()}/node{group}", ranks


def _join_node(
    conn: Connection, path: str, opened: int, rank: int, world_size: int, token: str | None
) -> None:
    """Host (local rank 0) or find this node's aggregator, through the process group's store."""
    node = node_of(rank, world_size)
    store = _world.dist_store() if node is not None else None
    if node is None or store is None:
        return
    name, ranks = node
    key = f"ckptd/node/{path}/{conn.attempt}/{opened}/{name}"
    if rank == ranks[0]:
        agg = conn.aggregator = _hosted(
            store, key, lambda: NodeAggregator(conn.client, name, ranks, token=token)
        )
        info = _publish(store, key, {"address": agg.address, "ranks": ranks})
    else:
        info = _published(
            store,
            key,
            lambda error: (
                f"job {path!r} rank {rank}: local rank 0 of node {name!r} could not "
                f"host the node's aggregator: {error} (CKPT_NODE_AGGREGATOR=0 opts out)"
            ),
        )
        if rank not in info["ranks"]:
            log.warning(
                "job %r rank %d: node %s's aggregator serves ranks %s, not this one; saving "
                "directly through the coordinator",
                path,
                rank,
                name,
                info["ranks"],
            )
            return
    conn.save_client = CoordinatorClient(
        info["address"], token=token, retry_for_s=conn.client.retry_for_s
    )


def _zero_config(
    path: str,
    opened: int,
    rank: int,
    world_size: int,
    attempt: str | None,
    lease_s: float,
    barrier_timeout_s: float,
) -> tuple[str, str | None, str, EmbeddedCoordinator | None]:
    if world_size == 1:
        alone = EmbeddedCoordinator(path, lease_s=lease_s, barrier_timeout_s=barrier_timeout_s)
        return alone.address, alone.token, attempt or f"process-{uuid.uuid4()}", alone
    store = _world.dist_store()
    # torchrun keeps its store across restarts: a key without the attempt would hand the
    # restarted ranks the address of the previous attempt's (dead) coordinator.
    key = f"ckptd/coordinator/{path}" + (f"/{attempt}" if attempt else "") + f"/{opened}"
    if store is None:
        raise CkptError(
            f"job {path!r} rank {rank} of {world_size}: no coordinator address and no "
            "torch.distributed process group to find one; call dist.init_process_group() before "
            "creating the Checkpointer, or start `ckptd serve` and set CKPTD_ADDRESS"
        )
    embedded: EmbeddedCoordinator | None = None
    if rank == 0:
        single_node = os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)
        host = "127.0.0.1" if single_node else "0.0.0.0"  # noqa: S104 - other nodes must reach it
        embedded = _hosted(
            store,
            key,
            lambda: EmbeddedCoordinator(
                path, host=host, lease_s=lease_s, barrier_timeout_s=barrier_timeout_s
            ),
        )
        info = _publish(
            store,
            key,
            {
                "address": embedded.address,
                "token": embedded.token,
                "attempt": attempt or str(uuid.uuid4()),
            },
        )
    else:
        info = _published(
            store,
            key,
            lambda error: (
                f"job {path!r} rank {rank} of {world_size}: rank 0 could not host "
                f"the job's coordinator: {error}"
            ),
        )
    return info["address"], info["token"], info["attempt"], embedded


T = TypeVar("T")


def _hosted(store: Any, key: str, host: Callable[[], T]) -> T:
    """The hosting rank starts what the others will reach; when it cannot, it publishes
    why under `key` first: the others wait for that key, and learn the cause instead of
    a store timeout later."""
    try:
        return host()
    except (OSError, CkptError) as e:
        store.set(key, json.dumps({"error": str(e)}))
        raise


def _publish(store: Any, key: str, info: dict[str, Any]) -> dict[str, Any]:
    store.set(key, json.dumps(info))
    return info


def _published(store: Any, key: str, failed: Callable[[str], str]) -> dict[str, Any]:
    """What the hosting rank published under `key` (waits for it); when it could not host,
    CkptError(failed(its error))."""
    info: dict[str, Any] = json.loads(store.get(key))
    if "error" in info:
        raise CkptError(failed(info["error"]))
    return info


def _shared_attempt(path: str, rank: int, world_size: int) -> str:
    store = _world.dist_store()
    if store is None:
        raise CkptError(
            f"job {path!r} rank {rank} of {world_size}: cannot name this launch; pass "
            "attempt=... (the same on every rank, new for every launch) or set CKPT_ATTEMPT"
        )
    key = f"ckptd/attempt/{path}"
    if rank == 0:
        store.set(key, str(uuid.uuid4()))  # type: ignore[attr-defined]
    return str(store.get(key).decode())  # type: ignore[attr-defined]


def wait_for_closed(
    store: Any, key: str, world_size: int, *, hosting: bool, job: str, timeout_s: float
) -> None:
    """Count this rank closed under `key`; the rank hosting the coordinator then waits
    (bounded) for every rank, since another may still wait for its last commit answer and
    stopping the coordinator under it would turn a committed save into an error there."""
    try:
        n = store.add(key, 1)
        if not hosting:
            return
        deadline = time.monotonic() + timeout_s
        while n < world_size and time.monotonic() < deadline:
            time.sleep(0.02)
            n = store.add(key, 0)
        if n < world_size:
            log.warning(
                "job %s: %d of %d ranks closed their Checkpointer within %.0f s; "
                "stopping the coordinator anyway",
                job,
                n,
                world_size,
                timeout_s,
            )
    except Exception as e:  # noqa: BLE001 - the store is gone (the job is ending): go on
        log.debug("job %s: could not wait for the other ranks to close: %s", job, e)
