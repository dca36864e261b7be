"""Two-rank save / load throughput: ckpt.Checkpointer against PyTorch DCP, same torchrun.

`python bench/distributed_save.py` launches `torch.distributed.run --standalone
--nproc-per-node 2` on this same file (gloo, CPU). Every rank holds its half of a synthetic
LLM-like state (bf16 weights + fp32 Adam exp_avg / exp_avg_sq, --size-gib in TOTAL over
both ranks, shapes from bench/_common.py):

  --layout dtensor   (default) every tensor a DTensor, Shard(0) over a 1-D mesh of the 2
                     ranks (the FSDP2 case): one global state, each rank saves its rows
  --layout disjoint  each rank owns whole tensors (greedy split by size); ckpt saves them
                     under ckpt.PerRank, DCP as plain per-rank keys

Per repetition, methods interleaved (the order rotates each repetition, so a slow period of
the disk does not always hit the same method):
  saves   ckpt save verify="full", ckpt save verify="size", DCP save (FileSystemWriter)
  loads   ckpt load, DCP load, each into preallocated tensors (zeroed first, untimed),
          after rank 0 dropped the page cache (sync; echo 3 > /proc/sys/vm/drop_caches)
Each measurement is barrier -> operation on both ranks -> barrier, timed on rank 0, so it
is the time of the slower rank. GB/s = bytes of the whole state (both ranks) / that time;
GB = 1e9 bytes. Every save is durable (ckpt fsyncs; DCP's FileSystemWriter has sync_files
on). Every load is checked against the source tensors afterwards (untimed). Zero-config
ckpt: rank 0 hosts the coordinator (one per Checkpointer; the two verify modes save to two
job directories). Rank 0 prints medians and ckpt/DCP ratios and writes
bench/results/distributed_save-<timestamp>.json.

    .venv/bin/python bench/distributed_save.py [--size-gib 1.0] [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C
import torch

METHODS_SAVE = ("ckpt save (verify=full)", "ckpt save (verify=size)", "DCP save")
METHODS_LOAD = ("ckpt load", "DCP load")
RATIOS = (
    ("ckpt save (verify=full)", "DCP save"),
    ("ckpt save (verify=size)", "DCP save"),
    ("ckpt load", "DCP load"),
)


# -- parent: launch torchrun -------------------------------------------------------------------
def launch(argv: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(Path(__file__).resolve()),
        "--worker",
        *argv,
    ]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode


# -- worker: the state -------------------------------------------------------------------------
def local_state(
    size_gib: float, layout: str, rank: int, world: int, seed: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's part of the state (random values), and a description of the whole."""
    shapes, hidden = C.shapes_for_size(size_gib)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if layout == "dtensor":
        mine = {n: (s[0] // world, *s[1:]) for n, s in shapes.items()}
        for n, s in shapes.items():
            assert s[0] % world == 0, f"{n} {s} does not split evenly over {world} ranks"
    else:
        # Greedy: largest tensors first, each to the rank with the fewest bytes so far.
        load = [0] * world
        owner: dict[str, int] = {}
        for n, s in sorted(shapes.items(), key=lambda kv: -_numel(kv[1])):
            r = min(range(world), key=lambda i: (load[i], i))
            owner[n] = r
            load[r] += 10 * _numel(s)
        mine = {n: s for n, s in shapes.items() if owner[n] == rank}
    model = {n: torch.randn(s, generator=g, dtype=torch.bfloat16) for n, s in mine.items()}
    optim = {
        n: {
            "exp_avg": torch.randn(s, generator=g) * 1e-3,
            "exp_avg_sq": torch.randn(s, generator=g).square_().add_(1e-8),
        }
        for n, s in mine.items()
    }
    total = 10 * sum(_numel(s) for s in shapes.values())
    desc = {
        "hidden": hidden,
        "layers": 16,
        "vocab": 32000,
        "parameters": len(shapes),
        "tensors": 3 * len(shapes),
        "bytes_total": total,
        "layout": layout,
        "dtypes": {"model": "bfloat16", "optim": "float32"},
    }
    return {"model": model, "optim": optim}, desc


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for x in s:
        n *= x
    return n


def as_dtensors(tree: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(tree, torch.Tensor):
        return DTensor.from_local(tree, mesh, [Shard(0)], run_check=False)
    return {k: as_dtensors(v, mesh) for k, v in tree.items()}


def empty_like_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return {k: empty_like_tree(v) for k, v in tree.items()}


def local_tensors(tree: Any) -> list[torch.Tensor]:
    """The local tensors of a (DTensor or plain) state, in order."""
    out = []
    for _, t in C.flat_tensors(tree):
        out.append(t.to_local() if type(t).__name__ == "DTensor" else t)
    return out


# -- worker: the benchmark ---------------------------------------------------------------------
class Worker:
    def __init__(self, args: argparse.Namespace):
        import torch.distributed as dist

        import ckpt

        self.args = args
        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.work = Path(args.work)
        local, self.desc = local_state(args.size_gib, args.layout, self.rank, self.world, args.seed)
        dest_local = empty_like_tree(local)
        self.local_src = local_tensors(local)
        self.local_dst = local_tensors(dest_local)
        self.local_bytes = sum(t.nbytes for t in self.local_src)
        if args.layout == "dtensor":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (self.world,))
            self.src = as_dtensors(local, mesh)
            self.dst = as_dtensors(dest_local, mesh)
            self.ckpt_src: Any = self.src
            self.ckpt_dst: Any = self.dst
        else:
            self.src, self.dst = local, dest_local
            self.ckpt_src = {"state": ckpt.PerRank(self.src)}
            self.ckpt_dst = {"state": ckpt.PerRank(self.dst)}
        sizes = [0] * self.world
        dist.all_gather_object(sizes, self.local_bytes)
        self.nbytes = sum(sizes)
        self.ck_full = ckpt.Checkpointer(self.work / "ckpt-full", verify="full")
        self.ck_size = ckpt.Checkpointer(self.work / "ckpt-size", verify="size")
        self.times: dict[str, list[float]] = {m: [] for m in METHODS_SAVE + METHODS_LOAD}
        self.details: dict[str, list[Any]] = {m: [] for m in METHODS_SAVE + METHODS_LOAD}
        self.notes: dict[str, Any] = {"cache_drop": None, "loadavg_start": os.getloadavg()}
        self.errors: dict[str, list[str]] = {}

    # -- helpers -------------------------------------------------------------------------
    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.barrier()
        t0 = time.perf_counter()
        out = fn()
        self.barrier()
        return time.perf_counter() - t0, out

    def quiesce(self, cold: bool) -> None:
        """Before a measurement: flush dirty pages; for a load also drop the page cache."""
        self.barrier()
        if self.rank == 0:
            if cold:
                self.notes["cache_drop"] = C.drop_caches(self.work)
            else:
                os.sync()
        self.barrier()

    def zero_dst(self) -> None:
        for t in self.local_dst:
            t.zero_()

    def check_dst(self, what: str) -> None:
        bad = [
            i
            for i, (a, b) in enumerate(zip(self.local_src, self.local_dst, strict=True))
            if not torch.equal(a, b)
        ]
        if bad:
            raise AssertionError(f"{what}: rank {self.rank}: {len(bad)} tensors differ after load")

    # -- the methods ---------------------------------------------------------------------
    def ckpt_save(self, ck: Any, step: int) -> Any:
        """A durable save: until the step is committed (waits for a background save)."""
        t0 = time.perf_counter()
        r = ck.save(self.ckpt_src, step=step)
        returned_s = time.perf_counter() - t0
        out: dict[str, Any] = {"returned_s": returned_s}
        if hasattr(r, "wait"):  # save() returned a PendingSave: the save persists in the background
            t = r.timings
            out.update(
                {
                    "blocking_s": t.blocking_s,
                    "staging_s": t.staging_s,
                }
            )
            r = r.wait()
            out.update({"persist_s": t.persist_s, "commit_s": t.commit_s})
        out.update(
            {
                "committed_s": time.perf_counter() - t0,
                "seconds": r.seconds,
                "write_s": r.write_s,
                "verify_s": r.verify_s,
                "bytes": r.bytes,
            }
        )
        return out

    def ckpt_load(self, step: int) -> Any:
        r = self.ck_full.load(self.ckpt_dst, step=step)
        return {"seconds": r.seconds, "bytes": r.bytes}

    def dcp_save(self, path: Path) -> Any:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(path), thread_count=self.args.dcp_threads)
        dcp.save(self.src, storage_writer=writer)
        return None

    def dcp_load(self, path: Path) -> Any:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.dst, storage_reader=dcp.FileSystemReader(str(path)))
        return None

    def measure(
        self, name: str, rep: int, fn: Callable[[], Any], after: Callable[[], None]
    ) -> None:
        try:
            s, detail = self.timed(fn)
            after()
            ok = all(self.gather(True))
        except Exception as e:
            tb = traceback.format_exc()
            self.errors.setdefault(name, []).append(tb)
            print(
                f"[rank {self.rank}] rep {rep + 1} {name}: ERROR {type(e).__name__}: {e}\n{tb}",
                flush=True,
            )
            raise
        details = self.gather(detail)
        if ok:
            self.times[name].append(s)
            self.details[name].append(details)
        if self.rank == 0:
            print(
                f"rep {rep + 1}/{self.args.reps}  {name:<26} {s:7.3f} s "
                f"{self.nbytes / s / C.GB:6.2f} GB/s",
                flush=True,
            )

    def warmup(self) -> None:
        """One untimed save by each method (imports, ckpt's staging buffers, first files)."""
        for i in range(self.args.warmup):
            step = 1_000_000 + i
            self.ckpt_save(self.ck_full, step)
            self.ckpt_save(self.ck_size, step)
            self.dcp_save(self.work / "dcp-warmup")
            self.barrier()
            if self.rank == 0:
                for p in (
                    self.work / "dcp-warmup",
                    self.work / "ckpt-full" / f"step-{step:012d}",
                    self.work / "ckpt-size" / f"step-{step:012d}",
                ):
                    shutil.rmtree(p, ignore_errors=True)
            self.barrier()

    def run(self) -> None:
        args = self.args
        self.warmup()
        for rep in range(args.reps):
            step = rep + 1
            dcp_dir = self.work / f"dcp-{step}"
            saves: dict[str, Callable[[], Any]] = {
                "ckpt save (verify=full)": functools.partial(self.ckpt_save, self.ck_full, step),
                "ckpt save (verify=size)": functools.partial(self.ckpt_save, self.ck_size, step),
                "DCP save": functools.partial(self.dcp_save, dcp_dir),
            }
            loads: dict[str, Callable[[], Any]] = {
                "ckpt load": functools.partial(self.ckpt_load, step),
                "DCP load": functools.partial(self.dcp_load, dcp_dir),
            }
            order_s = _rotate(list(saves), rep)
            order_l = _rotate(list(loads), rep)
            for name in order_s:
                self.quiesce(cold=False)
                self.measure(name, rep, saves[name], lambda: None)
                gc.collect()
            for name in order_l:
                self.zero_dst()
                self.quiesce(cold=True)
                self.measure(name, rep, loads[name], functools.partial(self.check_dst, name))
                gc.collect()
            # Free the disk for the next repetition (untimed).
            self.barrier()
            if self.rank == 0:
                for p in (
                    dcp_dir,
                    self.work / "ckpt-full" / f"step-{step:012d}",
                    self.work / "ckpt-size" / f"step-{step:012d}",
                ):
                    shutil.rmtree(p, ignore_errors=True)
            self.barrier()

    def close(self) -> None:
        self.ck_full.close()
        self.ck_size.close()

    # -- report (rank 0) -------------------------------------------------------------------
    def report(self) -> None:
        args = self.args
        self.notes["loadavg_end"] = os.getloadavg()
        stats = {
            name: C.summarize(ts, self.nbytes) | {"n": len(ts)}
            for name, ts in self.times.items()
            if ts
        }
        print(
            f"\n2 ranks (torchrun, gloo, CPU), {args.layout} layout, "
            f"{self.nbytes / C.GB:.3f} GB total ({self.desc['tensors']} tensors, hidden "
            f"{self.desc['hidden']}), medians of {args.reps} reps; GB = 1e9 bytes; "
            f"DCP FileSystemWriter thread_count={args.dcp_threads}"
        )
        hdr = f"{'method':<26} {'GB/s':>7} {'min':>7} {'max':>7} {'median s':>9}"
        print(
            "load average at start / end (other processes compete for the 2 cores and the disk): "
            f"{self.notes['loadavg_start'][0]:.2f} / {self.notes['loadavg_end'][0]:.2f}"
        )
        print(hdr)
        print("-" * len(hdr))
        for name in METHODS_SAVE + METHODS_LOAD:
            if name not in stats:
                print(f"{name:<26} {'ERROR':>7}")
                continue
            s = stats[name]
            print(
                f"{name:<26} {s['median_gbps']:>7.2f} {s['min_gbps']:>7.2f} "
                f"{s['max_gbps']:>7.2f} {s['median_s']:>9.3f}"
            )
        breakdown = {}
        for name in METHODS_SAVE[:2]:
            reps = [d for d in self.details[name] if d and all(x for x in d)]
            if not reps:
                continue
            b = {
                k: statistics.median(max(x[k] for x in d) for d in reps)
                for k in ("returned_s", "write_s", "verify_s")
                if all(k in x for d in reps for x in d)
            }
            breakdown[name] = b
            print(
                f"  {name}: save() returned after {b.get('returned_s', float('nan')):.3f} s; "
                f"write+hash+fsync {b.get('write_s', float('nan')):.3f} s, "
                f"verify {b.get('verify_s', float('nan')):.3f} s (medians of the slower rank)"
            )
        ratios = {}
        print("\nratios of medians (ckpt / DCP; > 1 means ckpt is faster)")
        for a, b in RATIOS:
            if a in stats and b in stats:
                r = stats[a]["median_gbps"] / stats[b]["median_gbps"]
                ratios[f"{a} / {b}"] = r
                print(f"  {a:<26} / {b:<10} x{r:.2f}")
        data = {
            "benchmark": "distributed_save",
            "machine": C.machine_info(self.work),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "world_size": self.world,
            "state": self.desc,
            "bytes": self.nbytes,
            "notes": self.notes,
            "per_rep_seconds": self.times,
            "per_rep_rank_details": self.details,
            "stats": stats,
            "ratios": ratios,
            "ckpt_save_breakdown_s": breakdown,
            "errors": self.errors,
        }
        print(f"\nresults: {C.write_results('distributed_save', data)}", flush=True)


def _rotate(xs: list[str], k: int) -> list[str]:
    k %= len(xs)
    return xs[k:] + xs[:k]


def worker_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    warnings.filterwarnings("ignore", module="torch.distributed")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    rank = dist.get_rank()
    if rank == 0:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    w = Worker(args)
    if rank == 0:
        print(
            f"state: {w.nbytes / C.GB:.3f} GB over {w.world} ranks ({w.desc['layout']}, "
            f"{w.local_bytes / C.GB:.3f} GB on rank 0), built in {time.perf_counter() - t0:.1f} s; "
            f"work dir {args.work}",
            flush=True,
        )
    rc = 0
    try:
        w.run()
        if rank == 0:
            w.report()
    except Exception:
        rc = 1
        traceback.print_exc()
    finally:
        try:
            w.close()
        finally:
            if rc == 0:
                dist.barrier()
            dist.destroy_process_group()
            if rank == 0 and not args.keep:
                shutil.rmtree(args.work, ignore_errors=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=1.0, help="TOTAL state size (default 1)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of saves first")
    p.add_argument("--layout", choices=("dtensor", "disjoint"), default="dtensor")
    p.add_argument("--dcp-threads", type=int, default=1, help="FileSystemWriter thread_count")
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-dist", help="work directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker:
        args.dir.mkdir(parents=True, exist_ok=True)
        work = args.dir.resolve() / f"run-{os.getpid()}"
        return launch([a for a in argv if a != "--worker"] + ["--work", str(work)])
    return worker_main(args)


if __name__ == "__main__":
    sys.exit(main())
