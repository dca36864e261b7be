"""One rank of a gloo job that saves a state through the zero-config coordinator and
reports the bytes its save wrote to storage (ckptd.storage.counters), then loads it back
into a fresh state and compares bit-exactly.

`spawn_entry(rank, world, port, job, out_dir, spec)` as a multiprocessing (spawn) target;
spec: {"kind": "replicated" | "half", "mib": total MiB of the state (global),
"staging_budget_bytes": int | null}. "replicated": every tensor equal on every rank (DDP);
"half": half of the bytes replicated, half DTensors sharded over the ranks (Shard(0)).
Writes OUT_DIR/rank<r>.json: {"rank", "state_bytes", "written", "exact", "error"}.
"""

from __future__ import annotations

import os

from ranks.gloo_rank import run_rank

N_TENSORS = 8


def make_state(world: int, kind: str, mib: int, fresh: bool):  # noqa: ANN201
    import torch

    mesh = None
    if kind == "half":  # DTensors need the process group
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    rows = mib * (1 << 20) // N_TENSORS // 4 // 256  # fp32 rows of 256: 1 KiB each
    g = torch.Generator().manual_seed(99)
    state = {}
    for i in range(N_TENSORS):
        t = torch.randn(rows, 256, generator=g)
        if fresh:
            t = torch.zeros_like(t)
        if mesh is not None and i % 2:
            from torch.distributed.tensor import Shard, distribute_tensor

            state[f"sharded{i}"] = distribute_tensor(t, mesh, [Shard(0)])
        else:
            state[f"replicated{i}"] = t
    return state, rows * 256 * 4 * N_TENSORS


def raw(t) -> bytes:  # noqa: ANN001
    import torch

    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def scenario(rank: int, world: int, job: str, spec: dict) -> dict:
    import ckpt
    from ckptd.storage import counters

    state, state_bytes = make_state(world, spec["kind"], spec["mib"], fresh=False)
    with ckpt.Checkpointer(
        job, timeout_s=60, staging_budget_bytes=spec.get("staging_budget_bytes")
    ) as cp:
        before = counters.snapshot()
        cp.save(state, 1).wait()
        written = (counters.snapshot() - before).written_bytes
        fresh, _ = make_state(world, spec["kind"], spec["mib"], fresh=True)
        cp.load(fresh, 1)
    exact = all(raw(fresh[k]) == raw(state[k]) for k in state)
    return {"rank": rank, "state_bytes": state_bytes, "written": written, "exact": exact}


def spawn_entry(rank: int, world: int, port: int, job: str, out_dir: str, spec: dict) -> None:
    run_rank(
        rank,
        world,
        port,
        log=os.path.join(out_dir, f"rank{rank}.log"),
        result=os.path.join(out_dir, f"rank{rank}.json"),
        body=lambda: scenario(rank, world, job, spec),
    )
