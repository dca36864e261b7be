"""One rank of a 4-rank torchrun (gloo, CPU) job running DCP's storage scenarios through
ckpt.integrations.dcp: what DCP's own FileSystemWriter/Reader tests exercise, written anew.

    python -m torch.distributed.run --standalone --nproc-per-node 4 dcp_contract_worker.py BASE OUT

Each scenario saves into its own job under BASE and loads back; it returns {check: bool}.
Each rank writes OUT/rank<r>.json: {"rank", "scenarios": {name: {"checks": {...},
"error": traceback or null}}}. A scenario that raises is recorded and the next one runs
(DCP raises its CheckpointException on every rank alike, so the ranks stay in step).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardMetadata,
)
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import (
    _load_state_dict,
    _load_state_dict_from_keys,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckpt.integrations.dcp import (
    StorageReader,
    StorageWriter,
    dcp_to_torch_save,
    torch_save_to_dcp,
)

ROWS, COLS = 16, 8
GLOBAL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def local_ok(st, full: torch.Tensor) -> bool:  # noqa: ANN001 - a ShardedTensor
    """Every local shard of `st` holds its box of `full`."""
    ok = True
    for sh in st.local_shards():
        (r0, c0), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
        ok = ok and torch.equal(sh.tensor, full[r0 : r0 + nr, c0 : c0 + nc])
    return ok


def filled(spec, full: torch.Tensor):  # noqa: ANN001, ANN201
    st = sharded_tensor.zeros(spec, *full.shape)
    for sh in st.local_shards():
        (r0, c0), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
        sh.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
    return st


def rowwise(world: int) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])


def colwise(world: int) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=1, placements=[f"rank:{r}/cpu" for r in reversed(range(world))])


def two_blocks_per_rank(world: int) -> EnumerableShardingSpec:
    """2 x world row blocks, block i on rank i % world: every rank holds two chunks."""
    n = 2 * world
    h = ROWS // n
    return EnumerableShardingSpec(
        [ShardMetadata([i * h, 0], [h, COLS], f"rank:{i % world}/cpu") for i in range(n)]
    )


def full_of(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# -- scenarios ------------------------------------------------------------------------------
def tensors_only(ctx: dict) -> dict:
    job = ctx["job"]
    state = {"a": torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), "b": torch.ones(7)}
    dcp.save(state, storage_writer=StorageWriter(job, 1))
    got = {"a": torch.zeros(4, 3), "b": torch.zeros(7)}
    dcp.load(got, storage_reader=StorageReader(job))
    return {"a": torch.equal(got["a"], state["a"]), "b": torch.equal(got["b"], state["b"])}


def sharded(threads: int):  # noqa: ANN201
    def run(ctx: dict) -> dict:
        job, world = ctx["job"], ctx["world"]
        dcp.save(
            {"st": filled(rowwise(world), GLOBAL)},
            storage_writer=StorageWriter(job, 1, io_threads=threads),
        )
        got = {"st": sharded_tensor.zeros(rowwise(world), ROWS, COLS)}
        dcp.load(got, storage_reader=StorageReader(job, io_threads=threads))
        return {"loaded": local_ok(got["st"], GLOBAL)}

    return run


def different_shard_plan(ctx: dict) -> dict:
    """Saved with two chunks of the key on every rank; loaded with one per rank, and
    with the blocks on other ranks."""
    job, world = ctx["job"], ctx["world"]
    dcp.save(
        {"st": filled(two_blocks_per_rank(world), GLOBAL)}, storage_writer=StorageWriter(job, 1)
    )
    idx = json.load(open(os.path.join(job, "step-000000000001", "shards", "rank-00000.json")))
    two_here = sum(e["key"] == "st" for e in idx["entries"]) == 2
    got = {"st": sharded_tensor.zeros(colwise(world), ROWS, COLS)}
    dcp.load(got, storage_reader=StorageReader(job))
    one = {"st": sharded_tensor.zeros(rowwise(world), ROWS, COLS)}
    dcp.load(one, storage_reader=StorageReader(job))
    # and back: one chunk per rank saved, two per rank loaded
    dcp.save({"st": filled(rowwise(world), GLOBAL + 1)}, storage_writer=StorageWriter(job, 2))
    two = {"st": sharded_tensor.zeros(two_blocks_per_rank(world), ROWS, COLS)}
    dcp.load(two, storage_reader=StorageReader(job))
    return {
        "two_chunks_in_rank0_shard": two_here,
        "to_colwise": local_ok(got["st"], GLOBAL),
        "to_rowwise": local_ok(one["st"], GLOBAL),
        "to_two_per_rank": local_ok(two["st"], GLOBAL + 1),
    }


def rowwise_to_colwise(ctx: dict) -> dict:
    job, world = ctx["job"], ctx["world"]
    dcp.save({"st": filled(rowwise(world), GLOBAL)}, storage_writer=StorageWriter(job, 1))
    got = {"st": sharded_tensor.zeros(colwise(world), ROWS, COLS)}
    dcp.load(got, storage_reader=StorageReader(job))
    return {"loaded": local_ok(got["st"], GLOBAL)}


def bytes_values(ctx: dict) -> dict:
    job, rank = ctx["job"], ctx["rank"]
    state = {"raw": b"\x00\xffckptd", "bio": io.BytesIO(b"buffer bytes"), "t": torch.ones(2)}
    dcp.save(state, storage_writer=StorageWriter(job, 1))
    got = {"raw": b"", "bio": io.BytesIO(), "t": torch.zeros(2)}
    dcp.load(got, storage_reader=StorageReader(job))
    bio = got["bio"]
    return {
        "bytes": got["raw"] == b"\x00\xffckptd",
        "bytesio": isinstance(bio, io.BytesIO) and bio.getvalue() == b"buffer bytes",
        "tensor": torch.equal(got["t"], torch.ones(2)) and rank >= 0,
    }


def dtensor_meshes(ctx: dict) -> dict:
    """DTensors resharded 1-D <-> 2-D across 4 ranks."""
    job, m1, m2 = ctx["job"], ctx["mesh1"], ctx["mesh2"]
    dcp.save({"w": distribute_tensor(GLOBAL, m1, [Shard(0)])}, storage_writer=StorageWriter(job, 1))
    out: dict = {}
    for name, mesh, placements in (
        ("1d_to_2d_shard_shard", m2, [Shard(0), Shard(1)]),
        ("1d_to_2d_replicate_shard", m2, [Replicate(), Shard(1)]),
        ("1d_to_1d_colwise", m1, [Shard(1)]),
    ):
        got = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, placements)}
        dcp.load(got, storage_reader=StorageReader(job, 1))
        out[name] = torch.equal(full_of(got["w"]), GLOBAL)
    dcp.save(
        {"w": distribute_tensor(GLOBAL * 2, m2, [Shard(1), Shard(0)])},
        storage_writer=StorageWriter(job, 2),
    )
    for name, mesh, placements in (
        ("2d_to_1d", m1, [Shard(0)]),
        ("2d_to_2d_other", m2, [Shard(0), Replicate()]),
        ("2d_to_replicate", m1, [Replicate()]),
    ):
        got = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, placements)}
        dcp.load(got, storage_reader=StorageReader(job, 2))
        out[name] = torch.equal(full_of(got["w"]), GLOBAL * 2)
    return out


def async_save(kind: str):  # noqa: ANN201
    def run(ctx: dict) -> dict:
        # DTensor, not ShardedTensor: DCP's async stager cannot copy a ShardedTensor
        # (data_ptr is not supported for it), with any storage writer.
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        job, mesh = ctx["job"], ctx["mesh1"]
        which = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
        state = {
            "d": distribute_tensor(GLOBAL, mesh, [Shard(0)]),
            "w": torch.full((3,), 4.0),
            "n": 5,
        }
        fut = dcp.async_save(
            state, storage_writer=StorageWriter(job, 1), async_checkpointer_type=which
        )
        getattr(fut, "upload_completion", fut).result(timeout=120)
        dist.barrier()
        got = {"d": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
               "w": torch.zeros(3), "n": 0}  # fmt: skip
        dcp.load(got, storage_reader=StorageReader(job))
        return {
            "committed": os.path.exists(os.path.join(job, "step-000000000001", "MANIFEST.json")),
            "d": torch.equal(full_of(got["d"]), GLOBAL),
            "w": torch.equal(got["w"], torch.full((3,), 4.0)),
            "plain": got["n"] == 5,
        }

    return run


def partial_and_empty_planner(ctx: dict) -> dict:
    job, rank, world = ctx["job"], ctx["rank"], ctx["world"]
    state = {
        "model": {"a": torch.arange(6.0), "b": torch.ones(2, 2)},
        "st": filled(rowwise(world), GLOBAL),
        "n": 3,
    }
    dcp.save(state, storage_writer=StorageWriter(job, 1))
    out: dict = {}
    # a state dict holding some of the keys loads those keys only
    some = {"model": {"a": torch.zeros(6)}}
    dcp.load(some, storage_reader=StorageReader(job))
    out["subset_by_target"] = torch.equal(some["model"]["a"], torch.arange(6.0))
    # DCP's load by keys (every rank of the group takes part; each gets the whole values)
    by_keys = _load_state_dict_from_keys({"model.b", "n"}, storage_reader=StorageReader(job))
    out["by_keys"] = (
        set(by_keys) == {"model", "n"}
        and set(by_keys["model"]) == {"b"}
        and torch.equal(by_keys["model"]["b"], torch.ones(2, 2))
        and by_keys["n"] == 3
    )
    if rank == 0:  # no_dist: this process alone
        empty: dict = {}
        # the private loader, as DCP's format_utils call it: dcp.load plans into a copy of
        # the dict it is given, so what this planner adds to an empty one would be lost
        _load_state_dict(
            empty, storage_reader=StorageReader(job), planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )  # fmt: skip
        out["empty_planner"] = (
            torch.equal(empty["model"]["a"], torch.arange(6.0))
            and torch.equal(empty["st"], GLOBAL)
            and empty["n"] == 3
        )
        only: dict = {}
        _load_state_dict(
            only, storage_reader=StorageReader(job),
            planner=_EmptyStateDictLoadPlanner(keys={"model.a"}), no_dist=True,
        )  # fmt: skip
        out["empty_planner_keys"] = set(only) == {"model"} and set(only["model"]) == {"a"}
        path = os.path.join(ctx["base"], "converted.pt")
        dcp_to_torch_save(job, path)
        back = torch.load(path, weights_only=True)
        out["dcp_to_torch_save"] = torch.equal(back["st"], GLOBAL) and back["n"] == 3
        torch_save_to_dcp(path, job + "-from-torch", 5)
        again: dict = {}
        _load_state_dict(
            again, storage_reader=StorageReader(job + "-from-torch"),
            planner=_EmptyStateDictLoadPlanner(), no_dist=True,
        )  # fmt: skip
        out["torch_save_to_dcp"] = torch.equal(again["st"], GLOBAL) and torch.equal(
            again["model"]["b"], torch.ones(2, 2)
        )
    return out  # the caller's barrier waits for rank 0's part, raised or not


def overwrite_refused(ctx: dict) -> dict:
    job = ctx["job"]
    dcp.save({"x": torch.ones(2)}, storage_writer=StorageWriter(job, 1))
    try:
        dcp.save({"x": torch.zeros(2)}, storage_writer=StorageWriter(job, 1))
        refused = "no error"
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException
        refused = f"{type(e).__name__}: {e}"
    got = {"x": torch.zeros(2)}
    dcp.load(got, storage_reader=StorageReader(job))
    return {"refused": "already committed" in refused, "kept": torch.equal(got["x"], torch.ones(2))}


def no_collectives(ctx: dict) -> dict:
    """dcp.save(use_collectives=False): each rank plans alone and commits its own part
    through ckptd's coordinator; replicas that every rank planned are written once."""
    job, mesh, world = ctx["job"], ctx["mesh1"], ctx["world"]
    out: dict = {}
    for step in (1, 2):
        state = {
            "d": distribute_tensor(GLOBAL * step, mesh, [Shard(0)]),
            "rep": torch.full((6,), float(step)),
            "n": step,
        }
        dcp.save(state, storage_writer=StorageWriter(job, step), use_collectives=False)
        got = {"d": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
               "rep": torch.zeros(6), "n": 0}  # fmt: skip
        dcp.load(got, storage_reader=StorageReader(job, step))
        out[f"step{step}"] = (
            torch.equal(full_of(got["d"]), GLOBAL * step)
            and torch.equal(got["rep"], torch.full((6,), float(step)))
            and got["n"] == step
        )
    sdir = os.path.join(job, "step-000000000002")
    m = json.load(open(os.path.join(sdir, "MANIFEST.json")))
    reps = 0
    for sh in m["shards"]:
        idx = json.load(open(os.path.join(sdir, sh["index"])))
        reps += sum(e["key"] == "rep" for e in idx["entries"])
    out["replica_written_once"] = reps == 1 and m["world_size"] == world
    return out


SCENARIOS = {
    "no_collectives": no_collectives,
    "tensors_only": tensors_only,
    "sharded_threads_1": sharded(1),
    "sharded_threads_2": sharded(2),
    "different_shard_plan": different_shard_plan,
    "rowwise_to_colwise": rowwise_to_colwise,
    "bytes_values": bytes_values,
    "dtensor_meshes": dtensor_meshes,
    "async_thread": async_save("thread"),
    "async_process": async_save("process"),
    "partial_and_empty_planner": partial_and_empty_planner,
    "overwrite_refused": overwrite_refused,
}


def main(base: str, out_dir: str, names: list[str]) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result: dict = {"rank": rank, "scenarios": {}}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ctx = {
        "rank": rank,
        "world": world,
        "base": base,
        "mesh1": init_device_mesh("cpu", (world,)),
        "mesh2": init_device_mesh("cpu", (2, world // 2)),
    }
    for name in names or list(SCENARIOS):
        rec: dict = {"checks": {}, "error": None}
        try:
            rec["checks"] = SCENARIOS[name]({**ctx, "job": os.path.join(base, name)})
        except BaseException:  # noqa: BLE001 - recorded; the next scenario runs
            rec["error"] = traceback.format_exc()
        result["scenarios"][name] = rec
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:  # after each: a
            json.dump(result, f)  # hang later still leaves what ran
        print(f"rank {rank}: {name} done", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1], sys.argv[2], sys.argv[3:])
    from ckpt.integrations import _coordinator

    _coordinator.close_all()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # as dcp_worker: torch's C++ threads may abort interpreter teardown
