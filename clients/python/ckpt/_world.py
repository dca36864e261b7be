"""Who am I in the job: rank, world size, attempt, and how to find the coordinator.

Rank and world size come from torch.distributed when it is initialized, else from the
RANK / WORLD_SIZE environment (torchrun sets them), else 1 process.

The attempt names one launch of the job (a torchelastic restart is a new attempt); the
coordinator maps it to a generation, so a rank of an earlier attempt is fenced. It is,
in order: the user's `attempt=`, $CKPT_ATTEMPT, torchelastic's run id + restart count,
or, for one process, a fresh random id (every Checkpointer of one process is its own
attempt). Under torchrun with a store per round, rank 0 names each launch afresh and the
others take its name from the store (see rank0_names_attempt). PROCESS_ATTEMPT names this process for the integrations, whose connections
outlive one save and must not fence each other.
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PROCESS_ATTEMPT = f"process-{uuid.uuid4()}"


def rank_and_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not integers"
        ) from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    return rank, world


def attempt_id(explicit: str | None, world: int) -> str | None:
    """The attempt name, or None when the ranks must agree on one through the store."""
    if explicit:
        return explicit
    env = os.environ.get("CKPT_ATTEMPT")
    if env:
        return env
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:
        return f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if world == 1:
        return f"process-{uuid.uuid4()}"
    return None


def rank0_names_attempt(explicit: str | None) -> bool:
    """Whether rank 0 names this launch afresh, in a store of the round's own, for all.

    torchrun's restart count does not name a launch across nodes: it is each node's agent's
    (a node started again counts from 0 while the others count on), and a restart because
    a node joined or left is not counted at all (the next launch has the last one's name,
    and its generation). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every rendezvous round
    has a store of its own (rank 0's worker hosts it; torchrun sets
    TORCHELASTIC_USE_AGENT_STORE=False) that holds no earlier round's key: rank 0 puts a
    fresh name there and the others take it. In torchrun's shared store the count stays
    the name (a key of an earlier round is still there; torch's own keys are scoped by it).
    """
    return (
        not explicit
        and not os.environ.get("CKPT_ATTEMPT")
        and "TORCHELASTIC_RUN_ID" in os.environ
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False"
    )


def dist_store() -> object | None:
    """torch.distributed's key-value store when a process group exists (not a collective)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None
    return None


def collective_device() -> torch.device:
    """Where the tensors of this rank's collectives live: under nccl the rank's CUDA device
    (the one the default group was bound to with init_process_group(device_id=...), else
    the current one), otherwise the CPU (gloo). A job that binds its device only through
    device_id, without torch.cuda.set_device, would otherwise put every rank's tensor on
    cuda:0, and nccl refuses two ranks on one GPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    from torch.distributed.distributed_c10d import _get_default_group

    bound = getattr(_get_default_group(), "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
