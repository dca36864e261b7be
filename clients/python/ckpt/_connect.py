"""How a Checkpointer reaches its job's coordinator, and under which attempt.

A configured service ("host:port", or $CKPTD_ADDRESS) is used as it is; the ranks then
agree on the attempt through the process group's store when nothing names it. With no
address (zero-config), one process hosts an embedded coordinator: the process itself
when it is alone, else rank 0, which publishes the address, token and attempt in the
process group's key-value store for the others (a key-value service, not a collective:
a slow rank never blocks another's training). Under torchrun with a store per round,
rank 0 names every launch afresh too (a replaced node counts its restarts from 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

from ckpt import _world
from ckpt._embedded import EmbeddedCoordinator
from ckptd.errors import CkptError
from ckptd.server.client import CoordinatorClient


@dataclasses.dataclass
class Connection:
    """An open job: the client, this attempt's generation, and what hosts the coordinator."""

    client: CoordinatorClient
    address: str
    attempt: str
    generation: int
    job_name: str
    embedded: EmbeddedCoordinator | None

    def close(self) -> None:
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
    if address is None:
        address, token, attempt, embedded = _zero_config(
            path, rank, world_size, attempt, lease_s, barrier_timeout_s
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
    return Connection(client, address, attempt, generation, job_name, embedded)


def _zero_config(
    path: str,
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
    key = f"ckptd/coordinator/{path}" + (f"/{attempt}" if attempt else "")
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
        try:
            embedded = EmbeddedCoordinator(
                path, host=host, lease_s=lease_s, barrier_timeout_s=barrier_timeout_s
            )
        except CkptError as e:
            # The other ranks wait for this key: tell them why, not a store timeout later.
            store.set(key, json.dumps({"error": str(e)}))  # type: ignore[attr-defined]
            raise
        info = {
            "address": embedded.address,
            "token": embedded.token,
            "attempt": attempt or str(uuid.uuid4()),
        }
        store.set(key, json.dumps(info))  # type: ignore[attr-defined]
    else:
        info = json.loads(store.get(key))  # type: ignore[attr-defined]
        if "error" in info:
            raise CkptError(
                f"job {path!r} rank {rank} of {world_size}: rank 0 could not host the job's "
                f"coordinator: {info['error']}"
            )
    return info["address"], info["token"], info["attempt"], embedded


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
