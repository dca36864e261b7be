"""Ranks agree on a number: the one collective the client library uses.

A load that chooses its step (ckpt._load) must end on the same step on every rank, even
when only one rank's reads hit the damage, so each decision is one tiny all_reduce of an
int64 over the default process group: the largest or the smallest value any rank holds.
Without an initialized process group (one process, or ranks that share only a
coordinator) it is the rank's own value: each rank decides alone. Every rank of the group
must make the same calls in the same order, or the collective hangs; callers keep the
number of calls independent of what a rank found.

Saves never use it: ranks coordinate a save only through the coordinator, so a slow or
dead rank never hangs the others' training collectives (ckpt._checkpointer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ckpt._world import collective_device


def _reduce(value: int, op: dist.ReduceOp.RedOpType) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=op)
    return int(t.item())


def agree_max(value: int) -> int:
    """The largest `value` over the ranks of the process group (a collective)."""
    return _reduce(value, dist.ReduceOp.MAX)


def agree_min(value: int) -> int:
    """The smallest `value` over the ranks of the process group (a collective)."""
    return _reduce(value, dist.ReduceOp.MIN)
