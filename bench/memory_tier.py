"""Memory tier: recovery time from this node's memory, the peer's and storage; the stall
and background time of a memory save against a persistent save.

Four gloo ranks as two nodes on this machine (ranks 0-1 node 0, ranks 2-3 node 1), each
node with its own shared-memory directory (under /dev/shm) and its own `ckptd agent`;
the state is `--gib-per-node` GiB per node of random fp32 (each rank's rows of a
Shard(0) DTensor). One training launch saves steps 1..8: persistent at 3 and 6, memory
at the others. Then each recovery launch starts four fresh processes that resume and take
one training step, `--reps` times per tier:

- memory: the agents and their shared memory are as the training left them;
- peer:   node 1's agent is killed and its shared memory removed (a replaced node);
- storage: both nodes' are (the persistent step 6 is what is left).

"process start -> first step" is the wall time from starting the four processes to the
last rank's first step after resume (it includes Python and torch start-up, measured
alone as "start-up floor": four processes that import torch, join the group and exit);
"resume" is Checkpointer.resume alone, per rank.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, job: str, shm: str, out: str, mode: str, gib: float) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank % 2),
        LOCAL_WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
        CKPTD_AGENT_HOST="127.0.0.1",
    )
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    res: dict[str, Any] = {"rank": rank}
    if mode == "floor":
        dist.barrier()  # rank 0 hosts the store: nobody leaves before all have joined
        res["first_step_unix"] = time.time()
        _write(out, rank, res)
        os._exit(0)
    import logging

    import ckpt

    logging.basicConfig(
        level=logging.INFO if os.environ.get("BENCH_LOG") else logging.WARNING,
        format=f"%(asctime)s rank{rank} %(name)s %(message)s",
    )
    node = rank // 2
    n = int(gib * (1 << 30) / 2 / 4)
    g = torch.Generator().manual_seed(rank)
    mesh = init_device_mesh("cpu", (WORLD,))
    state = {"w": DTensor.from_local(torch.rand(n, generator=g), mesh, [Shard(0)], run_check=False)}
    tier = ckpt.MemoryTier(
        every=1, root=f"{shm}/node{node}", node=node, nodes=2, max_steps=2, timeout_s=600
    )
    cp = ckpt.Checkpointer(job, memory=tier, timeout_s=600)
    if mode == "train":
        saves: list[dict[str, Any]] = []
        for step in range(1, 9):
            state["w"].to_local().mul_(0.999)
            t0 = time.perf_counter()
            p = cp.maybe_save(state, step, every=3)
            assert p is not None
            stall = time.perf_counter() - t0
            p.wait()
            total = time.perf_counter() - t0
            kind = "persistent" if step % 3 == 0 else "memory"
            saves.append({"step": step, "kind": kind, "stall_s": stall, "total_s": total})
        cp.wait()
        dist.barrier()
        res["saves"] = saves
        _write(out, rank, res)
        os._exit(0)  # leave as a crash would: no close, the agents keep the memory
    t0 = time.perf_counter()
    step = cp.resume(state)
    res["resume_s"] = time.perf_counter() - t0
    res["step"] = step
    res["tier"] = cp.last_load.tier if cp.last_load is not None else None
    state["w"].to_local().mul_(0.999)  # the first training step
    dist.barrier()
    res["first_step_unix"] = time.time()
    _write(out, rank, res)
    os._exit(0)


def _write(out: str, rank: int, res: dict[str, Any]) -> None:
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)


def launch(job: str, shm: str, out: Path, mode: str, gib: float) -> tuple[float, list[dict]]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    t0 = time.time()
    procs = [
        ctx.Process(target=_rank, args=(r, port, job, shm, str(out), mode, gib))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
        if p.exitcode != 0:
            raise SystemExit(f"{mode}: a rank failed (exit {p.exitcode})")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return max(r.get("first_step_unix", t0) for r in results) - t0, results


def wipe(shm: str, node: int) -> None:
    root = Path(shm) / f"node{node}"
    try:
        pid = json.loads((root / "agent.json").read_text())["pid"]
        os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass
    shutil.rmtree(root, ignore_errors=True)


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib-per-node", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="bench/results/tmp-data")
    args = ap.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="memtier-", dir=args.dir))
    shm = tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm")
    job = str(work / "job")
    try:
        floor = [
            launch(job, shm, work / "out", "floor", args.gib_per_node)[0] for _ in range(args.reps)
        ]
        _, train = launch(job, shm, work / "out", "train", args.gib_per_node)
        rows: dict[str, dict[str, list[float]]] = {}
        for tier, lost in (("memory", ()), ("peer", (1,)), ("storage", (0, 1))):
            for _ in range(args.reps):
                for node in lost:
                    wipe(shm, node)
                wall, res = launch(job, shm, work / "out", "recover", args.gib_per_node)
                r = rows.setdefault(tier, {"wall": [], "resume": [], "tiers": []})
                r["wall"].append(wall)
                r["resume"].append(max(x["resume_s"] for x in res))
                r["tiers"].append(sorted({x["tier"] for x in res}))  # type: ignore[arg-type]
                r.setdefault("steps", []).append(sorted({x["step"] for x in res}))  # type: ignore[arg-type]
    finally:
        for node in (0, 1):
            wipe(shm, node)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    gib = args.gib_per_node
    print(f"state {gib:.2f} GiB per node (2 nodes, 4 ranks), {args.reps} reps, median (min-max) s")
    print(f"  start-up floor (4 processes: python, torch, gloo group)  {med(floor)}")
    for tier, r in rows.items():
        print(
            f"  recover from {tier:8s} start->first step {med(r['wall'])}   resume {med(r['resume'])}"
            f"   loaded from {r['tiers'][0]} step {r['steps'][0]}"
        )
    for kind in ("memory", "persistent"):
        saves = [s for x in train for s in x["saves"] if s["kind"] == kind]
        print(
            f"  {kind:10s} save: stall {med([s['stall_s'] for s in saves])}   "
            f"until placed/committed {med([s['total_s'] for s in saves])}   ({len(saves)} rank-saves)"
        )


if __name__ == "__main__":
    sys.exit(main())
