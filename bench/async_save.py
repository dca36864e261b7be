"""Async save: how long a checkpoint blocks the training loop, and what it costs it.

One run measures, inside every repetition (methods interleaved, so a slow period of the
disk or a noisy neighbour hits all of them):
  floor   memcpy of the state into preallocated, page-aligned buffers (2 threads)
  DCP     torch.distributed.checkpoint.async_save (FileSystemWriter, 2 threads, no_dist):
          blocking time (until it returns) and total time (until its future is done,
          plus an fsync of the directory entries), with the thread executor (default),
          the process executor (default stager), and, for information, the thread
          executor with the writer's cached (pinned) staging copy
  ckpt    ckpt.Checkpointer(path, keep_last=2).save(): blocking time (until save()
          returns) and total time (until wait() returns); the same save with
          blocking=True (total)
  train   median step time of a small CPU TransformerEncoder training loop
          (torch.set_num_threads(2)): alone, while a ckpt async save persists, while a
          DCP async_save (thread executor) persists; a save shorter than 5 steps is
          followed by the next one (its blocking part is not a step) until 5 steps ran;
          and the training time each save cost: its steps' extra time over the same
          number of steps alone (a faster save slows fewer steps)
With CUDA, the floor, DCP and ckpt saves also run on the state moved to the GPU
(device-to-host; the floor copies into preallocated pinned buffers); otherwise they are
reported as skipped.

Steady state: every Checkpointer, DCP variant and the training loop get a warm-up run,
excluded from the figures (ckpt's first save allocates its staging buffer; DCP's process
executor spawns its daemon); the first-save figures are reported for information. The
report gives medians and min-max over repetitions, then ckpt's ratios with PASS/FAIL.
Results go to bench/results/async_save-<timestamp>.json.

    .venv/bin/python bench/async_save.py [--size-gib 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import resource
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as C
import torch

MIN_OVERLAP_STEPS = 5  # training steps wanted while a save persists
MAX_CHAINED_SAVES = 6  # saves started back to back to get them (small states)
TRAIN_DIM, TRAIN_HEADS, TRAIN_LAYERS, TRAIN_SEQ = 256, 4, 4, 128
DCP_THREADS = 2
CACHED = "DCP async_save, thread, cached stager (info)"
# DCP's cached staging copy is pinned memory, which needs an accelerator.
PINNED_OK = torch.cuda.is_available()


# -- context: one state (CPU or CUDA) and what saves it ------------------------------------
@dataclass
class Ctx:
    device: str  # "cpu" or "cuda"
    work: Path
    state: dict[str, Any]
    flat: list[tuple[str, torch.Tensor]] = field(init=False)
    nbytes: int = field(init=False)
    dst: list[torch.Tensor] = field(init=False)  # preallocated copy destinations
    halves: list[list[int]] = field(init=False)  # indices of flat, balanced for 2 threads
    cp: Any = None  # ckpt.Checkpointer
    step: int = 0
    seq: int = 0
    cached_writer: Any = None  # DCP FileSystemWriter(cache_staged_state_dict=True)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2))

    def __post_init__(self) -> None:
        self.flat = C.flat_tensors(self.state)
        self.nbytes = sum(t.nbytes for _, t in self.flat)
        if self.device == "cuda":
            self.dst = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).fill_(1) for _, t in self.flat
            ]
        else:  # one page-aligned, touched image, each tensor 4 KiB-aligned (as ckpt stages)
            offs, pos = [], 0
            for _, t in self.flat:
                offs.append(pos)
                pos = -(-(pos + t.nbytes) // C.ALIGN) * C.ALIGN
            image = C.aligned_buffer(pos)
            self.dst = [
                torch.frombuffer(image, dtype=t.dtype, count=t.numel(), offset=o).view(t.shape)
                for (_, t), o in zip(self.flat, offs, strict=True)
            ]
        self.halves, load = [[], []], [0, 0]
        for i in sorted(range(len(self.flat)), key=lambda i: -self.flat[i][1].nbytes):
            j = load.index(min(load))
            self.halves[j].append(i)
            load[j] += self.flat[i][1].nbytes

    def fresh(self, name: str) -> Path:
        self.seq += 1
        p = self.work / f"{self.device}-{name}-{self.seq}"
        C.remove(p)
        return p

    def quiesce(self) -> None:
        """Start from an idle disk (and an idle GPU)."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        os.sync()

    def close(self) -> None:
        if self.cp is not None:
            self.cp.close()
            self.cp = None
        self.pool.shutdown()


Result = dict[str, float]  # metric -> seconds (or a count, for n_* metrics)
Method = Callable[[Ctx], Result]


# -- (a) the floor ---------------------------------------------------------------------------
def memcpy(c: Ctx) -> Result:
    if c.device == "cuda":
        c.quiesce()
        t0 = time.perf_counter()
        for d, (_, s) in zip(c.dst, c.flat, strict=True):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        return {"copy": time.perf_counter() - t0}

    def copy(idx: list[int]) -> None:
        for i in idx:
            c.dst[i].copy_(c.flat[i][1])

    c.quiesce()
    t0 = time.perf_counter()
    list(c.pool.map(copy, c.halves))
    return {"copy": time.perf_counter() - t0}


# -- (b) DCP async_save ----------------------------------------------------------------------
def dcp_start(c: Ctx, kind: str) -> tuple[Any, Path, float]:
    """Start a DCP async_save; returns (the upload future, its directory, blocking s)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    path = c.fresh(f"dcp-{kind}")
    kw: dict[str, Any] = {"no_dist": True}
    if kind == "process":
        kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
    if kind == "cached":
        if c.cached_writer is None:
            c.cached_writer = dcp.FileSystemWriter(
                path, thread_count=DCP_THREADS, cache_staged_state_dict=True
            )
        writer = c.cached_writer
        kw["checkpoint_id"] = path  # reuse the writer (and its staging copy) elsewhere
    else:
        writer = dcp.FileSystemWriter(path, thread_count=DCP_THREADS)  # sync_files=True
    t0 = time.perf_counter()
    fut = dcp.async_save(c.state, storage_writer=writer, **kw)
    blocking = time.perf_counter() - t0
    return getattr(fut, "upload_completion", fut), path, blocking


def dcp_finish(fut: Any, path: Path) -> None:
    fut.result()
    C.fsync_tree(path)  # the directory entries too (the files are fsynced by DCP)


def dcp_async(c: Ctx, kind: str) -> Result:
    c.quiesce()
    t0 = time.perf_counter()
    fut, path, blocking = dcp_start(c, kind)
    dcp_finish(fut, path)
    total = time.perf_counter() - t0
    C.remove(path)
    return {"blocking": blocking, "total": total}


# -- (c) ckpt --------------------------------------------------------------------------------
def _check(res: Any, c: Ctx) -> None:
    if res is None or res.step != c.step:
        raise AssertionError(f"ckpt save of step {c.step} returned {res!r}")
    if res.bytes < c.nbytes:
        raise AssertionError(f"ckpt reports {res.bytes} bytes saved, the state has {c.nbytes}")


def ckpt_async(c: Ctx) -> Result:
    c.step += 1
    c.quiesce()
    t0 = time.perf_counter()
    p = c.cp.save(c.state, c.step)
    t1 = time.perf_counter()
    res = p.wait()
    t2 = time.perf_counter()
    _check(res, c)
    return {
        "blocking": t1 - t0,
        "total": t2 - t0,
        "staging": p.staging_s,
        "persist": p.persist_s,
        "commit": p.commit_s,
    }


def ckpt_blocking(c: Ctx) -> Result:
    c.step += 1
    c.quiesce()
    t0 = time.perf_counter()
    res = c.cp.save(c.state, c.step, blocking=True).wait()
    total = time.perf_counter() - t0
    _check(res, c)
    return {"total": total}


# -- (d) training interference -----------------------------------------------------------------
class Trainer:
    def __init__(self, batch: int, seed: int):
        torch.manual_seed(seed)
        layer = torch.nn.TransformerEncoderLayer(
            TRAIN_DIM, TRAIN_HEADS, 4 * TRAIN_DIM, dropout=0.0, batch_first=True
        )
        self.model = torch.nn.TransformerEncoder(layer, TRAIN_LAYERS, enable_nested_tensor=False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, TRAIN_SEQ, TRAIN_DIM)
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        self.opt.step()
        return time.perf_counter() - t0


def train_alone(c: Ctx, tr: Trainer, n: int) -> Result:
    c.quiesce()
    steps = [tr.step() for _ in range(n)]
    return {"step": statistics.median(steps), "n_steps": len(steps)}


def train_during(
    c: Ctx, tr: Trainer, start: Callable[[], tuple[Callable[[], bool], Callable[[], None]]]
) -> Result:
    """Training steps while saves persist, saves chained until MIN_OVERLAP_STEPS steps.

    start() begins a save (its blocking part is not a training step) and returns
    (done, finish). The first save's total time under training is reported too.
    """
    steps: list[float] = []
    first_total = 0.0
    saves = 0
    while len(steps) < MIN_OVERLAP_STEPS and saves < MAX_CHAINED_SAVES:
        c.quiesce()
        t0 = time.perf_counter()
        done, finish = start()
        while not done():
            steps.append(tr.step())
        finish()
        if saves == 0:
            first_total = time.perf_counter() - t0
        saves += 1
    if not steps:
        raise AssertionError("the save finished before a single training step ran")
    return {
        "step": statistics.median(steps),
        "save_total": first_total,
        "n_steps": len(steps),
        "n_saves": saves,
        # What the saves cost the training, less what the same steps take alone (ratios).
        "step_s_per_save": sum(steps) / saves,
        "steps_per_save": len(steps) / saves,
    }


def train_ckpt(c: Ctx, tr: Trainer) -> Result:
    def start() -> tuple[Callable[[], bool], Callable[[], None]]:
        c.step += 1
        p = c.cp.save(c.state, c.step)
        step = c.step

        def finish() -> None:
            res = p.wait()
            if res is None or res.step != step:
                raise AssertionError(f"ckpt save of step {step} returned {res!r}")

        return p.done, finish

    return train_during(c, tr, start)


def train_dcp(c: Ctx, tr: Trainer) -> Result:
    def start() -> tuple[Callable[[], bool], Callable[[], None]]:
        fut, path, _ = dcp_start(c, "thread")

        def finish() -> None:
            dcp_finish(fut, path)
            C.remove(path)

        return fut.done, finish

    return train_during(c, tr, start)


# -- the plan ----------------------------------------------------------------------------------
@dataclass
class Row:
    section: str  # "cpu", "gpu", "train"
    name: str
    fn: Callable[[], Result]
    metrics: tuple[str, ...]


def setup_gloo() -> None:
    """A 1-rank gloo process group (DCP's process executor asks the group for its rank)."""
    import torch.distributed as dist

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def warm_up(ctx: Ctx, tr: Trainer | None, notes: dict[str, Any], errors: dict) -> dict:
    """One untimed run of everything that allocates or spawns on first use."""
    import torch.distributed as dist

    import ckpt

    first: dict[str, Any] = {}
    tag = ctx.device

    def attempt(name: str, fn: Callable[[], Result]) -> None:
        try:
            first[name] = fn()
        except Exception:
            errors.setdefault(f"{tag}: {name} (warm-up)", []).append(traceback.format_exc())
            print(f"warm-up {tag} {name}: ERROR {traceback.format_exc().strip().splitlines()[-1]}")

    if tr is not None:
        first["train steps"] = [tr.step() for _ in range(6)]
    memcpy(ctx)
    try:  # the process executor first: it may need a process group
        first["DCP process"] = dcp_async(ctx, "process")
    except Exception as e:
        if "process group" in str(e).lower() and not dist.is_initialized():
            notes["gloo_process_group"] = f"initialised (1 rank) because: {e}"
            print(f"DCP process executor: {e} -> init a 1-rank gloo group and retry", flush=True)
            setup_gloo()
            attempt("DCP process", lambda: dcp_async(ctx, "process"))
        else:
            errors.setdefault(f"{tag}: DCP process (warm-up)", []).append(traceback.format_exc())
            print(f"warm-up {tag} DCP process: ERROR {type(e).__name__}: {e}", flush=True)
    attempt("DCP thread", lambda: dcp_async(ctx, "thread"))
    if PINNED_OK:
        attempt("DCP thread, cached stager", lambda: dcp_async(ctx, "cached"))
    ctx.cp = ckpt.Checkpointer(ctx.work / f"ckpt-{tag}", keep_last=2)
    attempt("ckpt async", lambda: ckpt_async(ctx))
    gc.collect()
    return first


def build_rows(cpu: Ctx, gpu: Ctx | None, tr: Trainer, args: argparse.Namespace) -> list[Row]:
    def saves(c: Ctx, sec: str) -> list[Row]:
        where = "device-to-host into pinned" if c.device == "cuda" else "into preallocated"
        return [
            Row(sec, f"memcpy {where}, 2 threads" if c.device == "cpu" else f"memcpy {where}",
                lambda: memcpy(c), ("copy",)),
            Row(sec, "DCP async_save, thread executor", lambda: dcp_async(c, "thread"),
                ("blocking", "total")),
            Row(sec, "DCP async_save, process executor", lambda: dcp_async(c, "process"),
                ("blocking", "total")),
            *([Row(sec, CACHED, lambda: dcp_async(c, "cached"), ("blocking", "total"))]
              if PINNED_OK else []),
            Row(sec, "ckpt async save", lambda: ckpt_async(c),
                ("blocking", "total", "staging", "persist", "commit")),
            Row(sec, "ckpt save, blocking=True", lambda: ckpt_blocking(c), ("total",)),
        ]  # fmt: skip

    rows = saves(cpu, "cpu")
    if gpu is not None:
        rows += saves(gpu, "gpu")
    rows += [
        Row("train", "train step, no checkpoint", lambda: train_alone(cpu, tr, args.train_steps),
            ("step",)),
        Row("train", "train step, ckpt async save persisting", lambda: train_ckpt(cpu, tr),
            ("step", "save_total")),
        Row("train", "train step, DCP async_save (thread) persisting", lambda: train_dcp(cpu, tr),
            ("step", "save_total")),
    ]  # fmt: skip
    return rows


# -- statistics, ratios, report ----------------------------------------------------------------
def key(r: Row) -> str:
    return f"{r.section}: {r.name}"


def stats_of(vals: list[float]) -> dict[str, float]:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def ratios(med: dict[str, dict[str, float]], has_gpu: bool) -> list[dict[str, Any]]:
    nan = float("nan")

    def m(k: str, metric: str) -> float:
        return med.get(k, {}).get(metric, nan)

    out: list[tuple[str, float, float, float | None]] = []
    for sec in ("cpu", "gpu") if has_gpu else ("cpu",):
        floor = (
            "memcpy into preallocated, 2 threads"
            if sec == "cpu"
            else ("memcpy device-to-host into pinned")
        )
        blk = m(f"{sec}: ckpt async save", "blocking")
        tot = m(f"{sec}: ckpt async save", "total")
        out += [
            (f"[{sec}] ckpt blocking / memcpy floor", blk, m(f"{sec}: {floor}", "copy"), 1.5),
            (f"[{sec}] ckpt blocking / DCP async_save blocking (thread)", blk,
             m(f"{sec}: DCP async_save, thread executor", "blocking"), 0.33),
            (f"[{sec}] ckpt async total / ckpt blocking=True total", tot,
             m(f"{sec}: ckpt save, blocking=True", "total"), 1.1),
            (f"[{sec}] ckpt blocking / DCP async_save blocking (process)", blk,
             m(f"{sec}: DCP async_save, process executor", "blocking"), None),
            (f"[{sec}] ckpt blocking / DCP blocking (thread, cached stager)", blk,
             m(f"{sec}: {CACHED}", "blocking"), None),
            (f"[{sec}] ckpt async total / DCP async_save total (thread)", tot,
             m(f"{sec}: DCP async_save, thread executor", "total"), None),
        ]  # fmt: skip
    alone = m("train: train step, no checkpoint", "step")
    s_ckpt = m("train: train step, ckpt async save persisting", "step") / alone
    s_dcp = m("train: train step, DCP async_save (thread) persisting", "step") / alone
    # A save that persists faster takes the same cores for a shorter time: its steps slow
    # more while it runs, and fewer of them do. What a save costs the training is the
    # extra time of the steps it overlapped: their time less as many steps alone.
    lost = {
        who: m(k, "step_s_per_save") - m(k, "steps_per_save") * alone
        for who, k in (
            ("ckpt", "train: train step, ckpt async save persisting"),
            ("DCP", "train: train step, DCP async_save (thread) persisting"),
        )
    }
    out += [
        ("train step slowdown, ckpt persisting (vs alone)", s_ckpt, 1.0, None),
        ("train step slowdown, DCP thread persisting (vs alone)", s_dcp, 1.0, None),
        ("ckpt train slowdown / DCP train slowdown", s_ckpt, s_dcp, 1.0),
        ("training time lost a save (s), ckpt persisting", lost["ckpt"], 1.0, None),
        ("training time lost a save (s), DCP thread persisting", lost["DCP"], 1.0, None),
        ("ckpt / DCP training time lost a save", lost["ckpt"], lost["DCP"], None),
    ]
    rows = []
    for name, num, den, target in out:
        r = num / den if den == den and den else nan
        if r != r:
            verdict = "n/a"
        else:
            verdict = "info" if target is None else ("PASS" if r <= target else "FAIL")
        rows.append(
            {
                "ratio": name,
                "value": r,
                "num": num,
                "den": den,
                "target": target,
                "verdict": verdict,
            }
        )
    return rows


def report(
    rows: list[Row],
    times: dict[str, dict[str, list[float]]],
    errors: dict[str, list[str]],
    first: dict[str, Any],
    extra: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    nb = extra["state"]["bytes"]
    stats = {k: {mt: stats_of(v) for mt, v in per.items() if v} for k, per in times.items()}
    med = {k: {mt: s["median"] for mt, s in per.items()} for k, per in stats.items()}
    width = max(len(r.name) for r in rows) + 2
    print(
        f"\nstate: {extra['state']['tensors']} tensors, {nb / C.GB:.3f} GB; GB = 1e9 bytes; "
        f"{args.reps} reps, methods interleaved; times in seconds"
    )
    print(f"{'method':<{width}} {'metric':<11} {'median':>8} {'min-max':>15} {'GB/s':>6}  ok")
    sec = None
    for r in rows:
        if r.section != sec:
            sec = r.section
            title = {"cpu": "CPU state", "gpu": "CUDA state (device-to-host)", "train": (
                f"training ({extra['train']['params'] / 1e6:.1f} M params, batch "
                f"{args.train_batch}, 2 threads), CPU state saved")}[sec]  # fmt: skip
            print(f"-- {title}")
        k = key(r)
        for i, mt in enumerate(r.metrics):
            label = r.name if i == 0 else ""
            s = stats.get(k, {}).get(mt)
            n_ok = len(times[k].get(mt, []))
            if s is None:
                print(f"{label:<{width}} {mt:<11} {'ERROR':>8} {'':>15} {'':>6}  0/{args.reps}")
                continue
            gbps = f"{nb / s['median'] / C.GB:6.2f}" if mt in ("copy", "blocking", "total") else ""
            spread = f"{s['min']:.3f}-{s['max']:.3f}"
            print(
                f"{label:<{width}} {mt:<11} {s['median']:8.3f} {spread:>15} {gbps:>6}  "
                f"{n_ok}/{args.reps}"
            )
        if r.section == "train":
            counts = times[k].get("n_steps", [])
            saves = times[k].get("n_saves", [])
            if counts and saves:
                print(f"{'':<{width}} steps/rep {counts}, saves/rep {saves}")
    for name, why in extra["skipped"].items():
        print(f"-- skipped: {name} ({why})")
    print("\nfirst save (warm-up, not in the figures):")
    for dev, f in first.items():
        for name, v in f.items():
            if name == "train steps":
                print(f"  {dev} training warm-up steps: {[round(x, 3) for x in v]}")
            elif isinstance(v, dict):
                kv = ", ".join(
                    f"{mt} {x:.3f} s" for mt, x in v.items() if mt in ("copy", "blocking", "total")
                )
                print(f"  {dev} {name}: {kv}")
    rs = ratios(med, "gpu" in first)
    print("\nratios (of medians; target in brackets)")
    for r in rs:
        tgt = "" if r["target"] is None else f"<= {r['target']}"
        print(f"  {r['ratio']:<62} {r['value']:6.3f}  [{tgt:>7}] {r['verdict']}")
    for n, errs in errors.items():
        print(f"ERRORS in {n} ({len(errs)}x): {errs[0].strip().splitlines()[-1][:300]}")
    for w in extra["warnings"]:
        print(f"warning: {w}")
    import ckptd.knobs

    result = {
        "bench": "async_save",
        "units": "seconds wall clock; GB = 1e9 bytes",
        "args": vars(args),
        "machine": C.machine_info(extra["work"]),
        "loadavg_start": extra["loadavg_start"],
        "loadavg_end": os.getloadavg(),
        "warnings": extra["warnings"],
        "state": extra["state"],
        "train": extra["train"],
        "gpu": extra.get("gpu"),
        "skipped": extra["skipped"],
        "loadavg_per_rep": extra["loadavg_per_rep"],
        "ckpt_knob_defaults": vars(ckptd.knobs.get()),
        "notes": extra["notes"],
        "order": [key(r) for r in rows],
        "first_save": first,
        "per_rep": times,
        "stats": stats,
        "ratios": rs,
        "errors": errors,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(f"\nresults: {C.write_results('async_save', result)}")


def stop_dcp_daemon() -> None:
    """Stop DCP's checkpoint daemon process (the process executor's), if one runs."""
    try:
        import torch.distributed.checkpoint._async_process_executor as ape
    except ImportError:
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        ape._CHECKPOINT_PROCESS = None
        try:
            proc.__del__()
        except Exception as e:
            print(f"stopping DCP's checkpoint process: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-data", help="work directory")
    p.add_argument("--train-batch", type=int, default=16, help="training batch (default 16)")
    p.add_argument("--train-steps", type=int, default=8, help="steps of the lone training run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    torch.set_num_threads(2)
    load = os.getloadavg()
    warns: list[str] = []
    if load[0] > 1:
        warns.append(
            f"load average {load[0]:.2f} at start (> 1): other processes compete for the "
            "2 CPUs and the disk; expect noisy numbers, above all the training step times"
        )
        print(f"warning: {warns[-1]}", flush=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = args.dir / f"async-{os.getpid()}"
    work.mkdir()
    notes: dict[str, Any] = {
        "dcp_writer": f"FileSystemWriter(thread_count={DCP_THREADS}, sync_files=True), "
        "no_dist=True; no async_stager passed, so the writer (a BlockingAsyncStager, "
        "cache_staged_state_dict=False) stages: a fresh CPU copy per save",
        "dcp_total": "until the upload future is done, plus an fsync of the directory tree",
        "ckpt": "Checkpointer(path, keep_last=2), defaults (verify='full')",
        "train_during": f"saves chained until >= {MIN_OVERLAP_STEPS} steps overlapped a save "
        f"(at most {MAX_CHAINED_SAVES} saves); their blocking parts are not steps",
    }
    t0 = time.perf_counter()
    state, desc = C.make_state(args.size_gib, args.seed)
    print(
        f"state: {desc['tensors']} tensors, {desc['bytes'] / C.GB:.3f} GB (hidden "
        f"{desc['hidden']}), built in {time.perf_counter() - t0:.1f} s; work dir {work}",
        flush=True,
    )
    tr = Trainer(args.train_batch, args.seed)
    extra: dict[str, Any] = {
        "work": work,
        "state": desc,
        "train": {
            "model": f"TransformerEncoder(d_model={TRAIN_DIM}, nhead={TRAIN_HEADS}, "
            f"ffn={4 * TRAIN_DIM}, layers={TRAIN_LAYERS}), AdamW, seq {TRAIN_SEQ}",
            "params": tr.params,
            "batch": args.train_batch,
            "threads": torch.get_num_threads(),
        },
        "notes": notes,
        "warnings": warns,
        "loadavg_start": load,
        "loadavg_per_rep": [],
        "skipped": {},
    }
    if not PINNED_OK:
        extra["skipped"][CACHED] = (
            "cache_staged_state_dict=True stages into pinned memory, which needs CUDA"
        )
    times: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, list[str]] = {}
    first: dict[str, Any] = {}
    cpu: Ctx | None = None
    gpu: Ctx | None = None
    try:
        cpu = Ctx("cpu", work, state)
        first["cpu"] = warm_up(cpu, tr, notes, errors)
        if torch.cuda.is_available():
            gstate = {
                g: {n: (v.cuda() if isinstance(v, torch.Tensor) else {m: x.cuda() for m, x in v.items()})
                    for n, v in tree.items()}
                for g, tree in state.items()
            }  # fmt: skip
            gpu = Ctx("cuda", work, gstate)
            extra["gpu"] = torch.cuda.get_device_name()
            first["gpu"] = warm_up(gpu, None, notes, errors)
        else:
            extra["skipped"]["CUDA state (memcpy, DCP, ckpt saves)"] = (
                "torch.cuda.is_available() is False"
            )
        extra["train"]["warmup_step_s"] = first["cpu"]["train steps"]
        rows = build_rows(cpu, gpu, tr, args)
        times = {key(r): {} for r in rows}
        for rep in range(args.reps):
            extra["loadavg_per_rep"].append(os.getloadavg())
            for r in rows:
                k = key(r)
                try:
                    res = r.fn()
                except Exception as e:
                    tb = traceback.format_exc()
                    first_err = k not in errors
                    errors.setdefault(k, []).append(tb)
                    detail = f"\n{tb}" if first_err else f" {type(e).__name__}: {e}"
                    print(f"rep {rep + 1}/{args.reps}  {k}: ERROR{detail}", flush=True)
                    continue
                finally:
                    gc.collect()
                for mt, v in res.items():
                    times[k].setdefault(mt, []).append(v)
                shown = "  ".join(
                    f"{mt} {v:.3f}" if not mt.startswith("n_") else f"{mt} {int(v)}"
                    for mt, v in res.items()
                )
                print(f"rep {rep + 1}/{args.reps}  {k:<58} {shown}", flush=True)
            for c in (cpu, gpu):
                if c is not None:
                    for child in c.work.iterdir():
                        if child.name.startswith(f"{c.device}-dcp"):
                            C.remove(child)
        alone = times.get("train: train step, no checkpoint", {}).get("step")
        if alone and not 0.1 <= statistics.median(alone) <= 1.0:
            warns.append(
                f"a lone training step takes {statistics.median(alone):.3f} s (wanted a few "
                "hundred ms): the machine is busy, or adjust --train-batch"
            )
        for k, per in times.items():
            if k.startswith("train: train step, ") and "persisting" in k:
                few = [int(n) for n in per.get("n_steps", []) if n < MIN_OVERLAP_STEPS]
                if few:
                    warns.append(
                        f"{k}: only {few} training steps overlapped the saves (wanted >= "
                        f"{MIN_OVERLAP_STEPS}); use a bigger --size-gib"
                    )
        report(rows, times, errors, first, extra, args)
    finally:
        for c in (gpu, cpu):
            if c is not None:
                try:
                    c.close()
                except Exception as e:
                    print(f"closing the {c.device} Checkpointer: {type(e).__name__}: {e}")
        stop_dcp_daemon()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        C.remove(work)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
