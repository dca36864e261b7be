"""One rank of a torchrun (gloo, CPU) job that saves and loads through DCP into ckptd.

    python -m torch.distributed.run --standalone --nproc-per-node 2 dcp_worker.py JOB OUT_DIR

An FSDP2 model (fully_shard on CPU) and AdamW after one step, their state through
get_state_dict, a DTensor sharded by rows, a plain replicated tensor and plain values are
saved with dcp.save (step 1) and dcp.async_save (step 2) through ckpt.integrations.dcp;
loaded back with dcp.load into a fresh model and optimizer (set_state_dict) and into a
DTensor of another placement; loaded with ckpt.load into a Replicate DTensor; and a state
holding a value ckptd cannot store without pickle must be refused (step 3, no manifest).

Each rank writes OUT_DIR/rank<r>.json: {"rank", "checks": {name: bool}, "refused": str,
"expected": {key: nested list} (rank 0: the full tensors of step 1), "error"}.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback


def make_model(mesh, seed: int):  # noqa: ANN001, ANN201
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(seed + 1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def full(t):  # noqa: ANN001, ANN201
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def same(a, b) -> bool:  # noqa: ANN001
    import torch

    a, b = full(a), full(b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def scenario(rank: int, world: int, job: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ckpt
    from ckpt.integrations.dcp import StorageReader, StorageWriter

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"rank": rank, "checks": {}}
    checks = out["checks"]
    model, opt = make_model(mesh, seed=0)
    msd, osd = get_state_dict(model, opt)
    rows = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)
    state = {
        "model": msd,
        "optim": osd,
        "rows": distribute_tensor(rows, mesh, [Shard(0)]),
        "rep": torch.full((5,), 2.5, dtype=torch.bfloat16),
        "step": 7,
        "cfg": {"name": "run", "betas": (0.9, 0.99), "none": None},
    }
    dcp.save(state, storage_writer=StorageWriter(job, step=1, metadata={"world": world}))
    expected = {  # full_tensor() is a collective: every rank computes it
        **{f"model/{k}": full(v).tolist() for k, v in msd.items()},
        **{
            f"optim/state/{k}/exp_avg": full(v["exp_avg"]).tolist() for k, v in osd["state"].items()
        },
    }
    if rank == 0:
        out["expected"] = expected

    # Same world, fresh model and optimizer, rows in another placement.
    model2, opt2 = make_model(mesh, seed=100)
    msd2, osd2 = get_state_dict(model2, opt2)
    got = {
        "model": msd2,
        "optim": osd2,
        "rows": distribute_tensor(torch.zeros(12, 6), mesh, [Shard(1)]),
        "rep": torch.zeros(5, dtype=torch.bfloat16),
        "step": 0,
        "cfg": {"name": "", "betas": (0.0, 0.0), "none": 1},  # DCP loads the keys the target has
    }
    dcp.load(got, storage_reader=StorageReader(job))
    set_state_dict(model2, opt2, model_state_dict=got["model"], optim_state_dict=got["optim"])
    checks["model"] = all(
        same(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    checks["optim"] = len(s1) == len(s2) == 4 and all(
        same(s1[k]["exp_avg"], s2[k]["exp_avg"]) and same(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"])
        for k in s1
    )
    checks["rows_resharded"] = same(got["rows"], rows) and got["rows"].placements == (Shard(1),)
    checks["rep"] = same(got["rep"], state["rep"])
    checks["plain"] = got["step"] == 7 and got["cfg"] == state["cfg"]

    # async_save: returns once staged; the commit happens in DCP's background thread.
    pending = dcp.async_save(state, storage_writer=StorageWriter(job, step=2))
    upload = getattr(pending, "upload_completion", pending)
    upload.result(timeout=120)
    dist.barrier()
    checks["async_committed"] = os.path.exists(
        os.path.join(job, "step-000000000002", "MANIFEST.json")
    )

    # ckpt.load understands the DCP checkpoint: DTensor of another placement, plain values.
    target = {"rows": distribute_tensor(torch.zeros(12, 6), mesh, [Replicate()]), "step": 0}
    res = ckpt.load(target, job, step=2, keys=["rows", "step"])
    checks["ckpt_load"] = same(target["rows"], rows) and target["step"] == 7 and res.step == 2

    # A value ckptd cannot store without pickle: refused on every rank, nothing committed.
    try:
        dcp.save({"x": torch.ones(2), "bad": object()}, storage_writer=StorageWriter(job, step=3))
        out["refused"] = "no error"
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        out["refused"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    return out


def main(job: str, out_dir: str) -> int:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result: dict = {"rank": rank}
    code = 0
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
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


if __name__ == "__main__":
    rc = main(sys.argv[1], sys.argv[2])
    from ckpt.integrations import _coordinator

    _coordinator.close_all()  # what atexit would do: stop rank 0's embedded coordinator
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: now and then torch's C++ threads (gloo, DCP's async
    # executor) abort the process there ("terminate called without an active exception")
    # after everything above has finished and been recorded.
    os._exit(rc)
