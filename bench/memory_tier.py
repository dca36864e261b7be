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
"resume" is Checkpointer.resume alone, per rank. `--ranks-per-node 1` runs two ranks
(one a node) with the same bytes per node.

Also: `--saves-only` (the training launch alone, --reps times: the saves' stall and
background time), `--seal-only` (the agent's seal of one rank's shard, with and without
hashing its blocks again), `--sweep` (the interval a memory save may run at for a 2%
slowdown, bench/README.md). The machine is shared: the run is refused when its estimated
peak does not fit, and stopped when less than --floor-gib stays available.
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
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(
    rank: int, port: int, job: str, shm: str, out: str, mode: str, gib: float, opts: dict
) -> None:
    world = opts.get("world", WORLD)
    per_node = world // 2
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        CKPTD_AGENT_HOST="127.0.0.1",
    )
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", rank=rank, world_size=world)
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
    node = rank // per_node
    n = int(gib * (1 << 30) / per_node / 4)
    g = torch.Generator().manual_seed(rank)
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": DTensor.from_local(torch.rand(n, generator=g), mesh, [Shard(0)], run_check=False)}
    tier = ckpt.MemoryTier(
        every=1, root=f"{shm}/node{node}", node=node, nodes=2, max_steps=2, timeout_s=600
    )
    cp = ckpt.Checkpointer(job, memory=tier, timeout_s=600)
    if mode == "sweep":
        res["phases"] = _sweep(cp, state, opts)
        _write(out, rank, res)
        cp.close()
        os._exit(0)
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


def _sweep(cp: Any, state: dict[str, Any], opts: dict) -> list[dict[str, Any]]:
    """Baseline and memory-save phases (the module docstring); each phase's step times."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    c = torch.empty(256, 256)
    tiny = torch.zeros(1)
    mms = 1

    def step() -> None:
        for _ in range(mms):
            torch.mm(a, a, out=c)
        state["w"].to_local()[:1024].mul_(0.999)
        dist.all_reduce(tiny)

    # Calibrate on rank 0, twice (the second against whole steps); one count everywhere,
    # so the ranks stay in step.
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        per = (time.perf_counter() - t0) / 10 / mms
        count = torch.tensor([max(1, int(opts["step_ms"] / 1000 / per))])
        dist.broadcast(count, 0)
        mms = int(count.item())
    for _ in range(10):  # warm up
        step()
    phases: list[dict[str, Any]] = []
    n = 0
    for rep in range(opts["reps"]):
        for k in opts["every"]:
            for kind in ("base", "memory"):
                length = max(opts["base_steps"], 2 * k) if kind == "memory" else opts["base_steps"]
                dist.barrier()
                t_phase = time.perf_counter()
                times, skipped, saves = [], 0, 0
                for i in range(length):
                    n += 1
                    t = time.perf_counter()
                    step()
                    if kind == "memory" and i % k == 0:
                        p = cp.save_memory(state, n)
                        saves += 1
                        skipped += int(p.skipped)
                    times.append(time.perf_counter() - t)
                t = time.perf_counter()
                cp._memory.wait()  # a save still placing counts against this phase
                spill = time.perf_counter() - t
                dist.barrier()
                phases.append(
                    {
                        "rep": rep,
                        "k": k,
                        "kind": kind,
                        "steps": length,
                        "saves": saves,
                        "skipped": skipped,
                        "step_s": times,
                        "spill_s": spill,
                        "wall_s": time.perf_counter() - t_phase,
                    }
                )
    return phases


def _write(out: str, rank: int, res: dict[str, Any]) -> None:
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)


def launch(
    job: str, shm: str, out: Path, mode: str, gib: float, world: int, opts: dict | None = None
) -> tuple[float, list[dict]]:
    opts = dict(opts or {}, world=world)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    t0 = time.time()
    procs = [
        ctx.Process(target=_rank, args=(r, port, job, shm, str(out), mode, gib, opts))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
        if p.exitcode != 0:
            for log in sorted(Path(shm).glob("node*/agent.log")):
                print(f"--- {log}:\n{log.read_text()[-2000:]}")
            raise SystemExit(f"{mode}: a rank failed (exit {p.exitcode})")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
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


def machine_load() -> tuple[str, list[str]]:
    """The load average, and the processes (not this benchmark's) using the most CPU."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    mine = {os.getpid()}
    try:
        out = subprocess.run(  # noqa: S603 - fixed arguments
            ["ps", "-eo", "pid,ppid,pcpu,etime,args", "--sort=-pcpu"],  # noqa: S607
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError):
        out = []
    top = []
    for line in out:
        parts = line.split(None, 4)
        if len(parts) < 5 or int(parts[1]) in mine or int(parts[0]) in mine:
            continue
        if "ckptd-bench-" in parts[4]:
            continue  # this benchmark's own agents
        if float(parts[2]) < 5:
            break
        top.append(f"{parts[2]}% {parts[4][:110]}")
        if len(top) == 6:
            break
    return " ".join(load), top


def meminfo() -> dict[str, int]:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        info[key] = int(rest.split()[0]) << 10
    return info


def need_gib(gib_per_node: float, ranks: int) -> float:
    """What a run holds at its peak (the training launch): per node the state, one
    staging image (memory and persistent saves share it unless both are in flight), and
    in shared memory two steps (max_steps=2: the newest committed one and the one being
    written) of the node's own shard and its peer's; plus ~0.4 GiB a process (python,
    torch, gloo)."""
    return 2 * gib_per_node * (1 + 1 + 2 * 2) + 0.4 * (ranks + 3)


class MemoryPeak:
    """The machine's peak memory in use (MemTotal - MemAvailable) and in shared memory
    (Shmem: the agents' tmpfs files), sampled every 0.2 s while the benchmark runs. The
    machine is shared: when less than `floor` bytes stay available, the benchmark stops
    (its ranks killed, its agents killed and their shared memory removed) rather than
    push the machine into the OOM killer."""

    def __init__(self, shm: str, floor: int) -> None:
        self.used = self.shmem = 0
        self.shm, self.floor = shm, floor
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            info = meminfo()
            self.used = max(self.used, info["MemTotal"] - info["MemAvailable"])
            self.shmem = max(self.shmem, info.get("Shmem", 0))
            if info["MemAvailable"] < self.floor:
                print(
                    f"STOPPED: {info['MemAvailable'] / 2**30:.1f} GiB available, under the "
                    f"{self.floor / 2**30:.1f} GiB floor ({self.used / 2**30:.1f} GiB in use, "
                    f"{self.shmem / 2**30:.1f} GiB shared memory at the peak); killing this "
                    "benchmark's processes",
                    flush=True,
                )
                say_load("at the stop")
                for p in mp.active_children():
                    p.kill()
                for node in (0, 1):
                    wipe(self.shm, node)
                shutil.rmtree(self.shm, ignore_errors=True)
                os._exit(3)

    def say(self) -> None:
        self._stop.set()
        self._t.join()
        print(
            f"  machine memory peak: {self.used / 2**30:.1f} GiB in use (all processes, "
            f"not page cache), {self.shmem / 2**30:.1f} GiB of it shared memory"
        )


def say_load(when: str) -> None:
    load, top = machine_load()
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())} UTC] load average {load} ({when})")
    for t in top:
        print(f"    {t}")


def recovery(args: argparse.Namespace, work: Path, shm: str) -> None:
    world = 2 * args.ranks_per_node
    job = str(work / "job")
    floor = [
        launch(job, shm, work / "out", "floor", args.gib_per_node, world)[0]
        for _ in range(args.reps)
    ]
    _, train = launch(job, shm, work / "out", "train", args.gib_per_node, world)
    rows: dict[str, dict[str, list[Any]]] = {}
    for tier, lost in (("memory", ()), ("peer", (1,)), ("storage", (0, 1))):
        for _ in range(args.reps):
            for node in lost:
                wipe(shm, node)
            wall, res = launch(job, shm, work / "out", "recover", args.gib_per_node, world)
            r = rows.setdefault(tier, {"wall": [], "resume": [], "tiers": [], "steps": []})
            r["wall"].append(wall)
            r["resume"].append(max(x["resume_s"] for x in res))
            r["tiers"].append(sorted({x["tier"] for x in res}))
            r["steps"].append(sorted({x["step"] for x in res}))
    gib = args.gib_per_node
    print(
        f"state {gib:.2f} GiB per node (2 nodes, {world} ranks), {args.reps} reps, "
        "median (min-max) s"
    )
    print(f"  start-up floor ({world} processes: python, torch, gloo group)  {med(floor)}")
    for tier, r in rows.items():
        print(
            f"  recover from {tier:8s} start->first step {med(r['wall'])}   resume {med(r['resume'])}"
            f"   loaded from {r['tiers'][0]} step {r['steps'][0]}"
        )
    say_saves(train)


def say_saves(train: list[dict[str, Any]]) -> None:
    for kind in ("memory", "persistent"):
        saves = [s for x in train for s in x["saves"] if s["kind"] == kind]
        print(
            f"  {kind:10s} save: stall {med([s['stall_s'] for s in saves])}   "
            f"until placed/committed {med([s['total_s'] for s in saves])}   ({len(saves)} rank-saves)"
        )


def saves_only(args: argparse.Namespace, work: Path, shm: str) -> None:
    """The training launch alone, --reps times, each with a fresh job and fresh agents."""
    world = 2 * args.ranks_per_node
    train: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for node in (0, 1):
            wipe(shm, node)
        train += launch(
            str(work / f"job{rep}"), shm, work / "out", "train", args.gib_per_node, world
        )[1]
        shutil.rmtree(work / f"job{rep}", ignore_errors=True)
    print(
        f"saves: {args.gib_per_node:.2f} GiB per node (2 nodes, {world} ranks), {args.reps} launches"
    )
    say_saves(train)


def seal_cost(args: argparse.Namespace, shm: str) -> None:
    """What the agent's seal costs for one rank's shard (half a node's state), with and
    without hashing its blocks again (ckptd.agent.holdings.seal no longer does): wall and
    CPU seconds, in this process, on a shard written into shared memory."""
    import numpy as np

    from ckptd.agent.holdings import Budget, Holdings
    from ckptd.format import layout
    from ckptd.format.writer import ShardWriter, WriteItem, hash_items, plan_offsets

    hold = Holdings(f"{shm}/seal", Budget())
    nbytes = int(args.gib_per_node * (1 << 30) / 2)
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    items = [WriteItem("w", "uint8", [nbytes], [0], [nbytes], data)]
    offsets, size = plan_offsets([nbytes], 4096)
    digests = hash_items(items)
    hold.prepare(1, [layout.shard_name(0), layout.index_name(0)], size)
    w = ShardWriter(hold.storage, job="j", step=1, rank=0, world_size=1, generation=0, size=size)
    w.write(items, offsets, digests=digests)
    shard = w.finish(items, offsets, digests, verify="size")
    del data, items
    rows: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    for _ in range(args.reps):
        for blocks in (True, False):
            t, c = time.perf_counter(), time.process_time()
            hold._verify(1, shard, blocks=blocks)
            rows[blocks][0].append(time.perf_counter() - t)
            rows[blocks][1].append(time.process_time() - c)
    print(
        f"seal of one rank's shard ({nbytes / 2**30:.2f} GiB), {args.reps} reps, median (min-max) s"
    )
    for blocks, (wall, cpu) in rows.items():
        what = "index + size + every block (before)" if blocks else "index + size (now)"
        print(f"  {what:36s} wall {med(wall)}   cpu {med(cpu)}")


def sweep(args: argparse.Namespace, work: Path, shm: str) -> None:
    opts = {
        "world": 2,
        "reps": args.reps,
        "every": [int(k) for k in args.every.split(",")],
        "step_ms": args.step_ms,
        "base_steps": args.base_steps,
    }
    gib = args.sweep_gib_per_node
    _, res = launch(str(work / "sweep-job"), shm, work / "out", "sweep", gib, 2, opts)
    phases = res[0]["phases"]  # the ranks are in step: rank 0's view
    # Each memory phase against the mean of the baseline phases next to it (drift).
    bases = [(i, p) for i, p in enumerate(phases) if p["kind"] == "base"]

    def mean_step(p: dict[str, Any]) -> float:
        return (sum(p["step_s"]) + p["spill_s"]) / p["steps"]

    base_all = [mean_step(p) for _, p in bases]
    print(
        f"sweep: {gib:.3f} GiB per node (2 nodes of 1 rank), step {args.step_ms:.0f} ms "
        f"(matmul + all_reduce; measured {statistics.median(base_all) * 1000:.0f} ms, "
        f"{min(base_all) * 1000:.0f}-{max(base_all) * 1000:.0f}), {args.reps} reps"
    )
    print("  every k | slowdown % median (min-max) | cost per save s | saves skipped")
    best = None
    costs_all = []
    for k in opts["every"]:
        slow, cost, skipped = [], [], 0
        for i, p in enumerate(phases):
            if p["kind"] != "memory" or p["k"] != k:
                continue
            near = [mean_step(b) for j, b in bases if abs(j - i) <= 1]
            base = statistics.mean(near)
            m = mean_step(p)
            slow.append((m / base - 1) * 100)
            cost.append((m - base) * p["steps"] / max(1, p["saves"] - p["skipped"]))
            skipped += p["skipped"]
        costs_all += cost
        print(f"  {k:7d} | {med(slow)} | {med(cost)} | {skipped}")
        if best is None and statistics.median(slow) <= 2.0:
            best = k
    step_s = statistics.median(base_all)
    c = statistics.median(costs_all)
    print(
        f"  smallest interval measured under 2%: {best if best is not None else 'none'}; "
        f"from the cost per save ({c:.2f} s, median of all phases) at this step: "
        f"every {max(1, int(c / (0.02 * step_s) + 0.999))} steps"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib-per-node", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="bench/results/tmp-data")
    ap.add_argument("--no-recovery", action="store_true", help="only the sweep")
    ap.add_argument("--saves-only", action="store_true", help="only the training launch's saves")
    ap.add_argument("--seal-only", action="store_true", help="only the agent's seal, timed")
    ap.add_argument("--ranks-per-node", type=int, default=WORLD // 2)
    ap.add_argument(
        "--floor-gib", type=float, default=2.0, help="stop when less memory stays available"
    )
    ap.add_argument("--sweep", action="store_true", help="also the every-k sweep")
    ap.add_argument("--sweep-gib-per-node", type=float, default=0.0625)
    ap.add_argument("--every", default="5,10,25,50,100")
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--base-steps", type=int, default=40)
    args = ap.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="memtier-", dir=args.dir))
    need = need_gib(args.gib_per_node, 2 * args.ranks_per_node)
    avail = meminfo()["MemAvailable"] / 2**30
    print(f"estimated peak {need:.1f} GiB; {avail:.1f} GiB available now")
    if (
        not (args.saves_only or args.seal_only or args.no_recovery)
        and need + args.floor_gib > avail
    ):
        raise SystemExit(
            f"--gib-per-node {args.gib_per_node} needs about {need:.1f} GiB and "
            f"{avail:.1f} GiB are available (keeping {args.floor_gib} GiB free): not run"
        )
    shm = tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm")
    peak = MemoryPeak(shm, int(args.floor_gib * 2**30))
    try:
        if args.seal_only:
            say_load("before seal")
            seal_cost(args, shm)
            say_load("after seal")
            return
        if args.saves_only:
            say_load("before saves")
            saves_only(args, work, shm)
            say_load("after saves")
            return
        if not args.no_recovery:
            say_load("before recovery")
            recovery(args, work, shm)
            say_load("after recovery")
        for node in (0, 1):
            wipe(shm, node)
        if args.sweep:
            say_load("before sweep")
            sweep(args, work, shm)
            say_load("after sweep")
    finally:
        peak.say()
        for node in (0, 1):
            wipe(shm, node)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
