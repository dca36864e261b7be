"""One rank of a gloo (CPU) job that saves at one world size and loads at another.

Run as a multiprocessing (spawn) target: `entry(rank, world, port, mode, job, out_dir)`.

mode "save": 4 ranks save steps 10 and 20 of the state below (DTensors Shard(0), Shard(1),
Replicate, a 2-D mesh (Shard, Shard), uneven splits, a model with DTensor parameters and its
Adam state, a plain replicated tensor, PerRank values) through the zero-config coordinator;
rank 0 writes the full tensors of each step to OUT_DIR/ref<step>.pt for the loaders.

mode "load" / "load-fallback": every rank builds the same state for its own world size
(zeros), loads the newest step with ckpt.load, and compares its local shards bit-exactly
with the reference (step 20, or step 10 when step 20 was damaged and must be skipped).

Each rank writes OUT_DIR/<mode>-rank<r>.json: {"checks": {name: bool}, "result": {...},
"error": traceback-or-null}.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from ranks.gloo_rank import run_rank

SHAPES = {
    "rows": (
        (13, 6),
        "float32",
    ),  # Shard(0), uneven at 2, 3, 4 and 8 ranks (a rank of 8 gets 0 rows)
    "cols": ((5, 11), "bfloat16"),  # Shard(1)
    "rep": ((10,), "int64"),  # Replicate
    "grid": ((9, 10), "float64"),  # 2-D mesh (Shard(0), Shard(1))
    "plain": ((33,), "float32"),  # a plain tensor, the same on every rank
}


# mode "save-incremental": these keep their step-10 values at step 20, saved with
# Checkpointer(incremental=True), so step 20 borrows them from step 10.
FROZEN = ("rows", "grid", "plain")
_frozen = False


def full_value(name: str, step: int) -> Any:
    import torch

    if _frozen and name in FROZEN and step:
        step = 10
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    t = torch.randn(shape, generator=g, dtype=torch.float64) * 100
    return t.to(getattr(torch, dtype))


def meshes(world: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    two = (world // 2, 2) if world % 2 == 0 else (world, 1)
    return init_device_mesh("cpu", (world,)), init_device_mesh("cpu", two)


def make_state(rank: int, world: int, step: int | None) -> dict[str, Any]:
    """The state at `step`, or a zeroed one of the same structure (step None)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ckpt

    m1, m2 = meshes(world)

    def value(name: str) -> Any:
        v = full_value(name, step or 0)
        return v if step is not None else torch.zeros_like(v)

    model = torch.nn.Linear(7, 10)
    with torch.no_grad():
        g = torch.Generator().manual_seed(step or 0)
        w = torch.randn(10, 7, generator=g) if step is not None else torch.zeros(10, 7)
        b = torch.randn(10, generator=g) if step is not None else torch.zeros(10)
    model.weight = torch.nn.Parameter(distribute_tensor(w, m1, [Shard(0)]))
    model.bias = torch.nn.Parameter(distribute_tensor(b, m1, [Replicate()]))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # Optimizer state must exist to be loaded into (as DCP's get_state_dict ensures): one
    # step with gradients that are zero in the fresh state and real in the saved one.
    scale = 0.0 if step is None else 1.0
    model.weight.grad = distribute_tensor(torch.ones(10, 7) * scale * (step or 0), m1, [Shard(0)])
    model.bias.grad = distribute_tensor(torch.ones(10) * scale, m1, [Replicate()])
    opt.step()
    return {
        "rows": distribute_tensor(value("rows"), m1, [Shard(0)]),
        "cols": distribute_tensor(value("cols"), m1, [Shard(1)]),
        "rep": distribute_tensor(value("rep"), m1, [Replicate()]),
        "grid": distribute_tensor(value("grid"), m2, [Shard(0), Shard(1)]),
        "plain": value("plain"),
        "model": model,
        "optim": opt,
        "mine": ckpt.PerRank(torch.full((5,), rank + 1 if step is not None else 0)),
        "step": step or 0,
    }


def full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state, whole (collective: every rank calls it)."""
    out = {k: state[k].full_tensor() for k in ("rows", "cols", "rep", "grid")}
    out["plain"] = state["plain"]
    out["model.weight"] = state["model"].weight.full_tensor()
    out["model.bias"] = state["model"].bias.full_tensor()
    for name, p in state["model"].named_parameters():
        for k, v in state["optim"].state[p].items():
            full = v.full_tensor() if type(v).__name__ == "DTensor" else v
            out[f"optim.{name}.{k}"] = full.detach().clone()
    return out


def raw(t: Any) -> bytes:
    import torch

    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def local_matches(got: Any, full: Any) -> bool:
    """A DTensor's local shard equals its box of the full tensor, bit for bit."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if type(got).__name__ != "DTensor":
        return got.dtype == full.dtype and raw(got) == raw(full)
    sizes, offsets = compute_local_shape_and_global_offset(
        got.shape, got.device_mesh, got.placements
    )
    want = full
    for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        want = want.narrow(d, o, n)
    local = got.to_local()
    return (
        local.dtype == full.dtype and tuple(local.shape) == tuple(sizes) and raw(local) == raw(want)
    )


def save(
    rank: int, world: int, job: str, out_dir: str, incremental: bool = False
) -> dict[str, Any]:
    import torch

    import ckpt

    global _frozen
    _frozen = incremental
    out: dict[str, Any] = {"checks": {}}
    with ckpt.Checkpointer(job, timeout_s=60, incremental=incremental) as cp:
        for step in (10, 20):
            state = make_state(rank, world, step)
            r = cp.save(state, step)
            wait = getattr(r, "wait", None)
            if callable(wait):
                wait()
            ref = full_tensors(state)
            if rank == 0:
                torch.save(ref, os.path.join(out_dir, f"ref{step}.pt"))
    out["checks"]["saved"] = True
    return out


def load(rank: int, world: int, job: str, out_dir: str, want_step: int) -> dict[str, Any]:
    import torch

    import ckpt

    ref = torch.load(os.path.join(out_dir, f"ref{want_step}.pt"), weights_only=True)
    state = make_state(rank, world, None)
    res = ckpt.load(state, job, strict=False)
    checks = {"step": res.step == want_step and state["step"] == want_step}
    for k in ("rows", "cols", "rep", "grid", "plain"):
        checks[k] = local_matches(state[k], ref[k])
    model = state["model"]
    checks["model.weight"] = local_matches(model.weight, ref["model.weight"])
    checks["model.bias"] = local_matches(model.bias, ref["model.bias"])
    for name, p in model.named_parameters():
        for k, v in state["optim"].state[p].items():
            checks[f"optim.{name}.{k}"] = local_matches(v, ref[f"optim.{name}.{k}"])
            if k != "step":  # Adam's step is a plain tensor; its moments are sharded like p
                checks[f"optim.{name}.{k}.placement"] = (
                    type(v).__name__ == "DTensor" and v.placements == p.placements
                )
    mine = state["mine"].value
    if rank < 4:
        checks["mine"] = mine.tolist() == [rank + 1] * 5 and not res.missing_keys
    else:
        checks["mine"] = mine.tolist() == [0] * 5 and res.missing_keys == [f"mine/@rank{rank}"]
    return {
        "checks": checks,
        "result": {
            "step": res.step,
            "bytes": res.bytes,
            "fell_back_from": res.fell_back_from,
            "fallback_reason": res.fallback_reason,
            "quarantined": res.quarantined,
            "missing": res.missing_keys,
        },
    }


def entry(rank: int, world: int, port: int, mode: str, job: str, out_dir: str) -> None:
    def body() -> dict[str, Any]:
        if mode in ("save", "save-incremental"):
            return save(rank, world, job, out_dir, incremental=mode == "save-incremental")
        return load(rank, world, job, out_dir, 10 if mode == "load-fallback" else 20)

    run_rank(
        rank,
        world,
        port,
        log=os.path.join(out_dir, f"{mode}-w{world}-rank{rank}.log"),
        result=os.path.join(out_dir, f"{mode}-w{world}-rank{rank}.json"),
        body=body,
    )
