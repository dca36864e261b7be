"""One rank of a torch.distributed (gloo, CPU) job that saves and loads through the
zero-config coordinator (rank 0 hosts it, the others find it through the store).

Run as a multiprocessing (spawn) target, `spawn_entry(rank, world, port, job, out_dir)`,
or as a script under torchrun: `python -m torch.distributed.run ... dist_worker.py JOB OUT_DIR`.

Each rank writes OUT_DIR/rank<r>.json: {"rank", "generation", "checks": {name: bool},
"divergent": "<error type>: <message>", "error": traceback-or-null}. The checks compare
bit-exactly what was saved with what was loaded into a fresh state.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback


def raw(t) -> bytes:  # noqa: ANN001
    t = t.detach()
    return t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes()


def finished(result):  # noqa: ANN001, ANN201
    wait = getattr(result, "wait", None)
    return wait() if callable(wait) else result


def make_state(rank: int, world: int, mesh, fresh: bool):  # noqa: ANN001, ANN201
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ckpt

    torch.manual_seed(1234 if fresh else 0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if not fresh:  # one identical step on every rank (the DDP case): momentum buffers exist
        torch.manual_seed(7)
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    scale = 0.0 if fresh else 1.0
    rows = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6) * scale
    grid = (torch.arange(8 * 8, dtype=torch.int64).reshape(8, 8) - 5) * int(scale)
    rep = torch.linspace(-1, 1, 10).to(torch.bfloat16) * scale
    if mesh.ndim == 1:
        rows_pl = [Shard(0)]
        rep_pl = [Replicate()]
        grid_pl = [Shard(1)]
    else:
        rows_pl = [Shard(0), Replicate()]  # each row block held by 2 ranks: written once
        rep_pl = [Replicate(), Replicate()]
        grid_pl = [Shard(0), Shard(1)]
    state = {
        "model": model,
        "optim": opt,
        "rows": distribute_tensor(rows, mesh, rows_pl),
        "grid": distribute_tensor(grid, mesh, grid_pl),
        "rep": distribute_tensor(rep, mesh, rep_pl),
        "plain": torch.full((33,), 2.5 * scale),  # a plain replicated tensor (DDP-style)
        "mine": ckpt.PerRank(torch.full((5,), (rank + 1) * int(scale), dtype=torch.int32)),
        "info": ckpt.PerRank({"rank": -1 if fresh else rank, "tag": "" if fresh else f"r{rank}"}),
        "epoch": 0 if fresh else 3,
    }
    return state


def scenario(rank: int, world: int, job: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ckpt

    shape = (world,) if world <= 2 else (2, world // 2)
    mesh = init_device_mesh("cpu", shape)
    out: dict = {"rank": rank, "checks": {}}
    saved = make_state(rank, world, mesh, fresh=False)
    with ckpt.Checkpointer(job, timeout_s=60) as cp:
        out["generation"] = cp.generation
        out["attempt"] = cp.attempt
        r = finished(cp.save(saved, 10, metadata={"world": world}))
        out["saved_bytes"] = r.bytes
        dist.barrier()
        got = make_state(rank, world, mesh, fresh=True)
        res = cp.load(got)
        checks = out["checks"]
        checks["step"] = res.step == 10 and res.metadata == {"world": world}
        checks["model"] = all(
            raw(a) == raw(b)
            for a, b in zip(got["model"].parameters(), saved["model"].parameters(), strict=True)
        )
        so, go = saved["optim"].state_dict(), got["optim"].state_dict()
        checks["optim"] = len(go["state"]) == len(so["state"]) > 0 and all(
            raw(go["state"][k]["momentum_buffer"]) == raw(so["state"][k]["momentum_buffer"])
            for k in so["state"]
        )
        for k in ("rows", "grid", "rep"):
            checks[k] = (
                got[k].to_local().dtype == saved[k].to_local().dtype
                and raw(got[k].to_local()) == raw(saved[k].to_local())
                and got[k].placements == saved[k].placements
            )
        checks["plain"] = raw(got["plain"]) == raw(saved["plain"])
        checks["mine"] = (
            raw(got["mine"].value) == raw(saved["mine"].value)
            and got["mine"].value[0].item() == rank + 1
        )
        checks["info"] = got["info"].value == {"rank": rank, "tag": f"r{rank}"}
        checks["epoch"] = got["epoch"] == 3
        # Replicas that differ: every rank must be told, and nothing committed.
        try:
            finished(cp.save({"x": torch.full((4,), float(rank)), "same": torch.ones(2)}, 11))
            out["divergent"] = "no error"
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            out["divergent"] = f"{type(e).__name__}: {e}"
        dist.barrier()
    return out


def _run(rank: int, world: int, job: str, out_dir: str) -> int:
    import torch.distributed as dist

    result: dict = {"rank": rank}
    code = 0
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        try:
            result = scenario(rank, world, job)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported through the result file
        result["error"] = traceback.format_exc()
        traceback.print_exc()
        code = 1
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return code


def spawn_entry(rank: int, world: int, port: int, job: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log = os.open(
        os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
    )
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    code = _run(rank, world, job, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)


if __name__ == "__main__":  # under torchrun: RANK, WORLD_SIZE, MASTER_* come from the env
    sys.exit(_run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1], sys.argv[2]))
