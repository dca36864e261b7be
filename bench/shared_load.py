"""Loads at 1, 2 and 4 ranks: bytes read from storage per byte of state, and wall time,
for ckpt reading once for the job (read="auto"), ckpt with every rank reading for itself
(read="each", what every load did before shared reads) and DCP's load of the same state.

Each configuration (a state kind x a world size) is one gloo job of spawned ranks on this
machine. The ranks save the state once with ckpt and once with DCP, then, for each
repetition (outermost, so a slow period of the disk hits all methods alike), drop the page
cache and load with every method in turn. Bytes are counted where they reach storage:
ckptd.storage.counters for ckpt (each rank's positional reads) and /proc/self/io
read_bytes (the block layer's count, after the cache was dropped) for every method; both
are summed over the ranks. On one host, ranks that read the same file through the page
cache (DCP's buffered reads of replicated tensors) share it, so the block layer counts
one read where a cluster's shared filesystem would serve one per rank; ckpt reads with
O_DIRECT, so its counts are what each rank asked of the device. The "gloo broadcast
floor" row times only the transfer a shared load of the replicated part needs (each
tensor broadcast once from a rotating rank): what the process group can do at best. Wall time is from a barrier before the load to a barrier after.

State kinds: "replicated" (every rank holds the whole state: DDP) and "half" (half of it
a DTensor split by rows over the ranks, half replicated).

    .venv/bin/python bench/shared_load.py                       # 256 MiB, 3 reps
    .venv/bin/python bench/shared_load.py --size-mib 64 --reps 1  # quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import drop_caches, machine_info, write_results  # noqa: E402

METHODS = ("ckpt shared", "ckpt each", "dcp", "gloo broadcast floor")
TENSOR_MIB = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _block_reads() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _state(kind: str, size: int, world: int, seed: int | None) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    n_tensors = max(1, size // (TENSOR_MIB << 20))
    numel = (TENSOR_MIB << 20) // 4
    g = torch.Generator().manual_seed(seed or 0)
    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world,)) if kind == "half" else None
    for i in range(n_tensors):
        t = torch.randn(numel, generator=g) if seed is not None else torch.zeros(numel)
        if mesh is not None and i % 2 == 0:
            rows = 64 * world
            out[f"t{i}"] = distribute_tensor(t.reshape(rows, -1), mesh, [Shard(0)])
        else:
            out[f"t{i}"] = t
    return out


def _broadcast_all(state: dict[str, Any], world: int) -> None:
    """The transfer a shared load of the replicated tensors needs, alone: each tensor's
    bytes broadcast from a rotating source (what the process group can do at best)."""
    import torch
    import torch.distributed as dist

    if world == 1:
        return
    replicated = [t for t in state.values() if not hasattr(t, "to_local")]
    bufs = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8) for t in replicated]
    work = [dist.broadcast(b, src=i % world, async_op=True) for i, b in enumerate(bufs)]
    for w in work:
        w.wait()


def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckpt
    from ckptd.storage import counters

    result: dict[str, Any] = {"rank": rank, "rows": []}
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        work = Path(args["dir"])
        job, dcp_dir = work / "ckpt-job", work / "dcp"
        state = _state(args["kind"], args["size"], world, seed=1)
        with ckpt.Checkpointer(str(job)) as cp:
            cp.save(state, 1, blocking=True)
        dcp.save(state, checkpoint_id=str(dcp_dir))
        dist.barrier()
        for rep in range(args["reps"]):
            for method in METHODS:
                target = _state(args["kind"], args["size"], world, seed=None)
                if rank == 0:
                    drop_caches(work)
                dist.barrier()
                c0, b0, t0 = counters.snapshot(), _block_reads(), time.perf_counter()
                if method == "gloo broadcast floor":
                    _broadcast_all(state, world)
                    target = state
                elif method == "dcp":
                    dcp.load(target, checkpoint_id=str(dcp_dir))
                else:
                    read = "auto" if method == "ckpt shared" else "each"
                    ckpt.load(target, str(job), read=read)
                dist.barrier()
                seconds = time.perf_counter() - t0
                got = counters.snapshot() - c0
                ok = all(
                    torch.equal(
                        a.to_local() if hasattr(a, "to_local") else a,
                        b.to_local() if hasattr(b, "to_local") else b,
                    )
                    for a, b in zip(target.values(), state.values(), strict=True)
                )
                result["rows"].append(
                    {
                        "rep": rep,
                        "method": method,
                        "seconds": seconds,
                        "counted_read": got.read_bytes,
                        "block_read": _block_reads() - b0,
                        "exact": ok,
                    }
                )
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported through the result file
        result["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_config(kind: str, world: int, size: int, reps: int, base: Path) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(dir=base) as d:
        out = Path(d, "out")
        out.mkdir()
        args = {"kind": kind, "size": size, "reps": reps, "dir": d}
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [
            ctx.Process(target=_rank, args=(r, world, port, args, str(out))) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1200)
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    for r in results:
        if r.get("error"):
            raise RuntimeError(f"{kind} at {world} ranks, rank {r['rank']}:\n{r['error']}")
    rows = []
    for method in METHODS:
        per_rep = []
        for rep in range(reps):
            mine = [
                row
                for r in results
                for row in r["rows"]
                if row["method"] == method and row["rep"] == rep
            ]
            per_rep.append(
                {
                    "seconds": max(row["seconds"] for row in mine),
                    "counted": sum(row["counted_read"] for row in mine),
                    "block": sum(row["block_read"] for row in mine),
                    "exact": all(row["exact"] for row in mine),
                }
            )
        secs = [p["seconds"] for p in per_rep]
        rows.append(
            {
                "kind": kind,
                "world": world,
                "method": method,
                "median_s": statistics.median(secs),
                "min_s": min(secs),
                "max_s": max(secs),
                "counted_per_state": statistics.median(p["counted"] for p in per_rep) / size,
                "block_per_state": statistics.median(p["block"] for p in per_rep) / size,
                "exact": all(p["exact"] for p in per_rep),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--kinds", default="replicated,half")
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    size = a.size_mib << 20
    rows: list[dict[str, Any]] = []
    for kind in a.kinds.split(","):
        for world in (int(w) for w in a.worlds.split(",")):
            rows.extend(run_config(kind, world, size, a.reps, base))
            print(f"done: {kind} at {world} ranks", file=sys.stderr, flush=True)
    print(
        f"state {a.size_mib} MiB, {a.reps} reps; read/state: bytes read from storage summed "
        "over ranks / state size (ckpt's counters; block layer /proc/self/io)\n"
    )
    print(
        "| state | ranks | method | load s (median, min-max) | read/state counted | read/state block layer | exact |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        counted = f"{r['counted_per_state']:.3f}" if r["method"].startswith("ckpt") else "-"
        print(
            f"| {r['kind']} | {r['world']} | {r['method']} | {r['median_s']:.2f} "
            f"({r['min_s']:.2f}-{r['max_s']:.2f}) | {counted} | {r['block_per_state']:.3f} "
            f"| {r['exact']} |"
        )
    path = write_results(
        "shared_load",
        {"machine": machine_info(base), "size_bytes": size, "reps": a.reps, "rows": rows},
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
