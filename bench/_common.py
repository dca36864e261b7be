"""Helpers shared by the ckptd benchmarks: the synthetic state, cold caches, fsync,
aligned buffers, statistics, machine description and the JSON result file.

GB = 1e9 bytes everywhere.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import queue
import resource
import shutil
import statistics
import subprocess
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptd.storage.local import map_populated, thp_mode

GB = 1e9
MiB = 1 << 20
ALIGN = 4096
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"


# -- the state ---------------------------------------------------------------------------
def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def transformer_shapes(hidden: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a llama-like decoder."""
    ffn = _round_up(hidden * 8 // 3, 64)
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (hidden,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}attn.{proj}.weight"] = (hidden, hidden)
        shapes[p + "mlp_norm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, hidden)
        shapes[p + "mlp.up_proj.weight"] = (ffn, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, ffn)
    shapes["norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def shapes_for_size(size_gib: float, layers: int = 16, vocab: int = 32000):
    """The hidden size (a multiple of 64) whose state comes closest to size_gib.

    Each parameter costs 10 bytes: a bf16 weight and two fp32 Adam moments.
    """
    target = size_gib * (1 << 30)

    def nbytes(h: int) -> int:
        return 10 * sum(int(np.prod(s)) for s in transformer_shapes(h, layers, vocab).values())

    best = min(range(64, 16384 + 1, 64), key=lambda h: abs(nbytes(h) - target))
    return transformer_shapes(best, layers, vocab), best


def make_state(size_gib: float, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """{"model": {name: bf16}, "optim": {name: {"exp_avg": fp32, "exp_avg_sq": fp32}}},
    random values (never a zero page), and a description of it."""
    shapes, hidden = shapes_for_size(size_gib)
    g = torch.Generator().manual_seed(seed)
    model = {n: torch.randn(s, generator=g, dtype=torch.bfloat16) for n, s in shapes.items()}
    optim = {
        n: {
            "exp_avg": torch.randn(s, generator=g) * 1e-3,
            "exp_avg_sq": torch.randn(s, generator=g).square_().add_(1e-8),
        }
        for n, s in shapes.items()
    }
    state = {"model": model, "optim": optim}
    flat = flat_tensors(state)
    desc = {
        "hidden": hidden,
        "layers": 16,
        "vocab": 32000,
        "tensors": len(flat),
        "bytes": sum(t.nbytes for _, t in flat),
        "largest_tensor_bytes": max(t.nbytes for _, t in flat),
        "dtypes": {"model": "bfloat16", "optim": "float32"},
    }
    return state, desc


def flat_tensors(tree: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor of a nested dict, in insertion order, '/'-joined."""
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)]
    out: list[tuple[str, torch.Tensor]] = []
    for k, v in tree.items():
        out += flat_tensors(v, f"{prefix}/{k}" if prefix else str(k))
    return out


def u8(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a 1-D uint8 numpy view."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


# -- memory and files -------------------------------------------------------------------
def aligned_buffer(n: int, fill: int | None = 0x5A) -> np.ndarray:
    """A page-aligned uint8 buffer, faulted in, in huge pages where the kernel gives them,
    as ckptd's own O_DIRECT buffers are (ckptd.storage.local.map_populated): a device
    request carries at most max_segments runs of physically contiguous memory, so a
    floor's reads and writes into scattered 4 KiB pages would go in smaller requests than
    they could, and the floor would not be the best configuration."""
    _, buf = map_populated(max(ALIGN, _round_up(n, ALIGN)))
    buf = buf[:n]
    if fill is not None:
        buf.fill(fill)
    return buf


def read_files(
    paths: list[Path],
    threads: int,
    window: int,
    bufs: queue.SimpleQueue[np.ndarray],
    direct: bool = True,
) -> None:
    """Positional reads of every file, `window` bytes each, on `threads` threads, into
    aligned buffers lent by `bufs` (at least `threads` of them, each of `window` bytes or
    more): the read floor of a load of the same files."""
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    fds = [os.open(p, os.O_RDONLY | flag) for p in paths]
    try:
        tasks = [
            (fd, off, min(window, size - off))
            for fd, size in zip(fds, (p.stat().st_size for p in paths), strict=True)
            for off in range(0, size, window)
        ]

        def read(task: tuple[int, int, int]) -> None:
            fd, off, n = task
            buf = bufs.get()
            try:
                if os.preadv(fd, [buf[: _round_up(n, ALIGN)]], off) < n:
                    raise OSError(f"short read at {off}")
            finally:
                bufs.put(buf)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, tasks))
    finally:
        for fd in fds:
            os.close(fd)


def best_cold_read(
    paths: list[Path],
    sweep: list[tuple[int, int]],
    bufs: queue.SimpleQueue[np.ndarray],
    under: str | os.PathLike[str],
    direct: bool = True,
) -> tuple[float, dict[str, float]]:
    """The read floor of `paths`: each (threads, window) of `sweep` reads them all cold
    (read_files, page cache under `under` dropped first); the fastest time in seconds, and
    every configuration's."""
    if not paths:
        raise AssertionError(f"no files to read under {under}: a floor of nothing")
    got: dict[str, float] = {}
    for threads, window in sweep:
        drop_caches(under)
        t0 = time.perf_counter()
        read_files(paths, threads, window, bufs, direct)
        got[f"{threads} thr x {window // MiB} MiB"] = time.perf_counter() - t0
    return min(got.values()), got


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync a file (and its directory) or every file and directory under a directory."""
    p = Path(path)
    if p.is_file():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(p.parent)
        return
    for root, _dirs, files in os.walk(p):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)
    fsync_dir(p.parent)


def remove(path: str | os.PathLike[str]) -> None:
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


@contextlib.contextmanager
def work_dir(parent: Path, prefix: str = "run") -> Iterator[Path]:
    """`parent/prefix-PID`, made for one run and removed after it; `parent` too when this
    run made it and nothing else is left in it (another run's work dir, a user's file)."""
    made = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    work = parent / f"{prefix}-{os.getpid()}"
    work.mkdir()
    try:
        yield work
    finally:
        remove(work)
        if made:
            with contextlib.suppress(OSError):  # not empty: left as it is
                parent.rmdir()


def drop_caches(under: str | os.PathLike[str]) -> str:
    """Make the next read of files under `under` come from the device.

    sync + echo 3 > /proc/sys/vm/drop_caches where allowed, else posix_fadvise(DONTNEED)
    on every file under `under` (after an fsync, so the pages are clean and droppable).
    Returns the method used.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for root, _dirs, files in os.walk(under):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


# -- statistics and output -------------------------------------------------------------
def summarize(seconds: list[float], nbytes: int) -> dict[str, float]:
    rates = [nbytes / s / GB for s in seconds]
    return {
        "median_gbps": statistics.median(rates),
        "min_gbps": min(rates),
        "max_gbps": max(rates),
        "median_s": statistics.median(seconds),
    }


def _meminfo_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _mount_of(path: Path) -> dict[str, str]:
    best: dict[str, str] = {}
    real = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                best.get("mount", "")
            ):
                best = {"device": dev, "mount": mnt, "fstype": fstype, "options": opts}
    return best


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def torch_thp_alloc() -> bool:
    """Whether torch's CPU allocator asks for huge pages in this process (it reads
    THP_MEM_ALLOC_ENABLE at its first allocation)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "") == "1"


def machine_info(work_dir: Path) -> dict[str, Any]:
    import blake3

    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "ram_bytes": _meminfo_total(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # Transparent huge pages: the kernel's mode, and whether torch's CPU allocator asks
        # for them (its THP_MEM_ALLOC_ENABLE): O_DIRECT writes from 2 MiB pages go to the
        # device in fewer, larger requests (docs/configuration.md, Host settings).
        "thp": thp_mode() or "absent",
        "torch_thp_alloc": torch_thp_alloc(),
        "numpy": np.__version__,
        "blake3": getattr(blake3, "__version__", "?"),
        "work_dir": str(work_dir),
        "filesystem": _mount_of(work_dir),
        "git_head": _git("rev-parse", "HEAD"),
        "git_dirty_files": len(_git("status", "--porcelain").splitlines()),
    }


def write_results(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RESULTS_DIR / f"{name}-{stamp}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def ratio_verdicts(rows: list[tuple[str, float, float, float | None]]) -> list[dict[str, Any]]:
    """(name, numerator GB/s, denominator GB/s, target) -> ratio rows with PASS/FAIL."""
    out = []
    for name, num, den, target in rows:
        r = num / den if den == den and den else float("nan")
        if r != r:
            verdict = "n/a"  # a method was filtered out or failed
        else:
            verdict = "info" if target is None else ("PASS" if r >= target else "FAIL")
        out.append(
            {
                "ratio": name,
                "value": r,
                "num_gbps": num,
                "den_gbps": den,
                "target": target,
                "verdict": verdict,
            }
        )
    return out


def print_tables(
    registry: list[tuple[str, str, Any]],
    times: dict[str, list[float]],
    stats: dict[str, dict[str, float]],
    ratios: list[dict[str, Any]],
    errors: dict[str, list[str]],
    reps: int,
) -> None:
    """The per-method table (grouped as registered), the ratios, and the first errors."""
    width = max(len(n) for _, n, _ in registry) + 2
    print(f"{'method':<{width}} {'med GB/s':>9} {'min-max GB/s':>14} {'med s':>8}  ok")
    group = None
    for g, n, _ in registry:
        if g != group:
            print(f"-- {g}")
            group = g
        s = stats.get(n)
        ok = f"{len(times.get(n, []))}/{reps}"
        if s is None:
            print(f"{n:<{width}} {'ERROR':>9} {'':>14} {'':>8}  {ok}")
            continue
        spread = f"{s['min_gbps']:.2f}-{s['max_gbps']:.2f}"
        print(f"{n:<{width}} {s['median_gbps']:9.2f} {spread:>14} {s['median_s']:8.3f}  {ok}")
    print("\nratios (of medians; target in brackets)")
    rw = max((len(r["ratio"]) for r in ratios), default=0) + 2
    for r in ratios:
        tgt = "" if r["target"] is None else f">= {r['target']}"
        print(f"  {r['ratio']:<{rw}} {r['value']:6.2f}  [{tgt:>7}] {r['verdict']}")
    for n, errs in errors.items():
        print(f"ERRORS in {n}: {errs[0].strip().splitlines()[-1]}")


# -- one benchmark run: methods interleaved in every repetition --------------------------
Registry = list[tuple[str, str, Any]]  # (group, method name, fn(bench) -> seconds)


def select(registry: Registry, only: str) -> None:
    """Keep the methods whose name contains one of the |-separated substrings of `only`."""
    keep = [s.strip() for s in only.split("|") if s.strip()]
    if keep:
        registry[:] = [m for m in registry if any(s in m[1] for s in keep)]


def loadavg_at_start() -> tuple[float, float, float]:
    """The load average now, with a warning when other work competes for the CPUs."""
    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: load average {load[0]:.1f} at start: other processes compete for "
            "the CPUs and the disk; expect noisy numbers",
            flush=True,
        )
    return load


def run_reps(
    registry: Registry,
    bench: Any,
    reps: int,
    *,
    rotate: bool = False,
    after_rep: Any = None,
) -> tuple[dict[str, list[float]], dict[str, list[str]]]:
    """Every method once per repetition, in registry order (with `rotate`, each repetition
    starts one method later, so no method always follows the same one); a failing method
    is recorded (its first traceback printed) and the run goes on."""
    times: dict[str, list[float]] = {n: [] for _, n, _ in registry}
    errors: dict[str, list[str]] = {}
    width = max((len(n) for _, n, _ in registry), default=0)
    for rep in range(reps):
        k = rep % len(registry) if rotate and registry else 0
        for _g, name, fn in registry[k:] + registry[:k]:
            try:
                s = fn(bench)
                times[name].append(s)
                print(
                    f"rep {rep + 1}/{reps}  {name:<{width}} {s:7.3f} s "
                    f"{bench.nbytes / s / GB:6.2f} GB/s",
                    flush=True,
                )
            except Exception as e:
                tb = traceback.format_exc()
                first = name not in errors
                errors.setdefault(name, []).append(tb)
                detail = f"\n{tb}" if first else f" {type(e).__name__}: {e}"
                print(f"rep {rep + 1}/{reps}  {name}: ERROR{detail}", flush=True)
            gc.collect()
        if after_rep is not None:
            after_rep()
    return times, errors


def report_run(
    name: str,
    bench: Any,
    registry: Registry,
    times: dict[str, list[float]],
    errors: dict[str, list[str]],
    args: Any,
    ratios: Any,
    note: str = "",
) -> None:
    """Print the tables of a run and write its JSON result (bench/results/NAME-*.json)."""
    import ckptd.knobs

    stats = {n: summarize(ts, bench.nbytes) for n, ts in times.items() if ts}
    print(
        f"\nstate: {bench.desc['tensors']} tensors, {bench.nbytes / GB:.3f} GB; GB = 1e9 bytes; "
        f"{args.reps} reps, methods interleaved{note}"
    )
    rs = ratios({n: s["median_gbps"] for n, s in stats.items()})
    print_tables(registry, times, stats, rs, errors, args.reps)
    result = {
        "bench": name,
        "units": "GB = 1e9 bytes; seconds wall clock",
        "args": vars(args),
        "machine": machine_info(bench.work),
        "state": bench.desc | {"raw_file_bytes": bench.size},
        "ckpt_knob_defaults": vars(ckptd.knobs.get()),
        "notes": bench.notes,
        "order": [n for _, n, _ in registry],
        "per_rep_seconds": times,
        "stats": stats,
        "ratios": rs,
        "errors": errors,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(f"\nresults: {write_results(name, result)}")
