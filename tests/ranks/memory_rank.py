"""One rank of a gloo job training with a memory tier, its ranks as simulated nodes.

`entry(rank, world, port, job, out_dir, spec)` (a multiprocessing spawn target): ranks
are nodes of `spec["per_node"]` (default 2: four ranks are nodes 0 and 1); each node's
shared memory is `spec["shm"]/node<N>`, so each simulated node has its own agent. The "training" is deterministic: every step
updates the state from itself and the step only, so a run that resumes from a step ends
bit-identical to one that never stopped.

spec: steps (train from the resumed step + 1 up to it), memory_every, every (persistent),
crash_at (after the step's saves are placed, every rank leaves: the victim by SIGKILL, the
rest as torchrun would tear them down), victim, max_steps, max_bytes, mib (state size per
rank), per_node, replicas. Writes rank<r>.json: resumed step, the tier it loaded from and each shard file's
(shard_tiers), the final state's
digest, memory saves' outcomes.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from ranks.gloo_rank import run_rank


def entry(rank: int, world: int, port: int, job: str, out: str, spec: dict[str, Any]) -> None:
    run_rank(
        rank,
        world,
        port,
        log=os.path.join(out, f"rank{rank}.log"),
        result=os.path.join(out, f"rank{rank}.json"),
        body=lambda: _body(rank, world, job, spec),
    )


def make_state(rank: int, world: int, mib: float) -> dict[str, Any]:
    """`mib` MiB of this rank's own rows of a Shard(0) DTensor, and a replicated tensor."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    n = int(mib * (1 << 20) / 4)
    local = torch.arange(n, dtype=torch.float32) * 1e-3 + rank
    mesh = init_device_mesh("cpu", (world,))
    return {
        "model": {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)},
        "shared": torch.linspace(0, 1, 1000),  # replicated: written once (dedup)
        "step": 0,
    }


def train_step(state: dict[str, Any], step: int) -> None:
    import torch

    with torch.no_grad():
        w = state["model"]["w"].to_local()
        w.mul_(0.999).add_(step * 1e-4)
        state["shared"].mul_(0.9999).add_(1e-5)
    state["step"] = step


def digest(state: dict[str, Any]) -> str:
    import hashlib

    h = hashlib.sha256()
    h.update(state["model"]["w"].to_local().numpy().tobytes())
    h.update(state["shared"].numpy().tobytes())
    h.update(str(state["step"]).encode())
    return h.hexdigest()


def _body(rank: int, world: int, job: str, spec: dict[str, Any]) -> dict[str, Any]:
    import logging

    import torch.distributed as dist

    import ckpt

    logging.basicConfig(level=logging.INFO)
    per_node = spec.get("per_node", 2)
    node = rank // per_node
    os.environ["CKPTD_AGENT_HOST"] = "127.0.0.1"
    tier = ckpt.MemoryTier(
        every=spec.get("memory_every", 2),
        root=os.path.join(spec["shm"], f"node{node}"),
        node=node,
        nodes=world // per_node,
        replicas=spec.get("replicas", 1),
        max_steps=spec.get("max_steps", 2),
        max_bytes=spec.get("max_bytes"),
    )
    state = make_state(rank, world, spec.get("mib", 1))
    out: dict[str, Any] = {"rank": rank, "memory": {}}
    with ckpt.Checkpointer(job, memory=tier, keep_last=2) as cp:
        start = cp.resume(state) or 0
        res = cp.last_load
        out.update(resumed=start, tier=res.tier if res is not None else None)
        out["fell_back_from"] = res.fell_back_from if res is not None else None
        out["shard_tiers"] = res.shard_tiers if res is not None else {}
        for step in range(start + 1, spec["steps"] + 1):
            train_step(state, step)
            p = cp.maybe_save(state, step, every=spec.get("every", 5))
            if p is not None and step % spec.get("every", 5) != 0:
                try:
                    p.wait()
                    out["memory"][str(step)] = "placed"
                except Exception as e:  # noqa: BLE001 - the outcome is the result
                    out["memory"][str(step)] = f"{type(e).__name__}: {e}"
            if spec.get("budget_probe"):
                out.setdefault("usage", []).append(cp._memory.agent.call("usage", "t")[0]["usage"])
            if step == spec.get("crash_at"):
                cp.wait()
                dist.barrier()
                if rank == spec.get("victim", 1):
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(0)  # torchrun tears down the rest of the group
        out["digest"] = digest(state)
        out["final"] = state["step"]
    return out
