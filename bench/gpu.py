"""The GPU path of ckpt on one CUDA device, in one run of under 5 minutes (H100/H200 class).

Measures, with CUDA tensors end to end (pinned staging, side streams, CUDA tensors
through saves, loads and DCP), each figure against its floor or peer from the same run:
  staging   device-to-host bandwidth of Checkpointer.save's blocking copy (its
            timings.staging_s) against a plain non_blocking copy_ of the same tensors
            into preallocated pinned memory (goal >= 0.8x)
  stall     the training stall (what save() blocks) of Checkpointer.save for a CUDA state
            of --size-gib (default 10) against DCP async_save's (FileSystemWriter,
            thread executor; the faster of a fresh writer per save and one kept with
            cache_staged_state_dict=True) in the same run (goal: below it)
  training  the median step time of a CUDA training loop alone, and while a Checkpointer
            save persists (the slowdown; goal <= 1.1x)
  first     the stall of the first Checkpointer.save after resume and TRAIN_S seconds of
            training steps (resume maps and pins the staging buffer meanwhile) against a
            later save's (goal <= 1.5x)
  load      ckpt.load and Checkpointer.resume into CUDA tensors (read, verify,
            host-to-device) against the cold read of the very shard files they read
            (O_DIRECT, page cache dropped, the best of READ_SWEEP; goal >= 0.85x), and
            against a plain pinned host-to-device copy_ of the same bytes (info); the
            verified blocks go to the device through a small pinned ring, and a second
            ckpt.load copies them from pageable buffers instead (info: which is faster),
            a third reads with 8 pooled reads in flight, not 4 (info: knobs.pooled_reads)
  DCP       dcp.save / dcp.load of the CUDA state through ckpt.integrations.dcp's
            StorageWriter/Reader (GB/s, checked)
Every load is checked against the saved tensors (torch.equal on the device); a mismatch
is a failure. Warm-up runs (DCP's first saves plan and pin) are excluded; the first
Checkpointer.save is its own figure. Prints the table, writes bench/results/gpu-<ts>.json,
and exits 1 if a check failed or a goal was missed; 2 without a CUDA device.

    .venv/bin/python bench/gpu.py [--size-gib 10] [--reps 2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import _common as C
import torch

NO_CUDA = 2
BUDGET_S = 270.0  # stop starting repetitions past this (the run must stay under 5 min)
TRAIN_S = 5.0  # training steps between resume and the first save (a real loop runs longer)
# (threads, window) of the read floor: 4 x 32 MiB is how a load into CUDA tensors reads
# (the reader's pooled windows, at most 4 in flight), 8 x 64 MiB more in flight. The notes
# keep each one's time, so a run shows whether the load's own configuration is what holds
# it below its floor. (A third configuration would take the run past 5 minutes.)
READ_SWEEP = [(4, 32 * C.MiB), (8, 64 * C.MiB)]


def cuda_state(size_gib: float, seed: int = 0) -> dict[str, Any]:
    """save_restore's llama-like state (bf16 weights, fp32 Adam moments), made on the GPU."""
    shapes, _ = C.shapes_for_size(size_gib)
    g = torch.Generator(device="cuda").manual_seed(seed)
    model = {
        n: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16)
        for n, s in shapes.items()
    }
    optim = {
        n: {
            "exp_avg": torch.randn(s, generator=g, device="cuda"),
            "exp_avg_sq": torch.randn(s, generator=g, device="cuda").square_(),
        }
        for n, s in shapes.items()
    }
    return {"model": model, "optim": optim}


def like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, 7)  # poisoned: a load must overwrite every byte
    return {k: like(v) for k, v in state.items()}


def check_equal(got: Any, want: Any, what: str) -> None:
    for (k, a), (_, b) in zip(C.flat_tensors(got), C.flat_tensors(want), strict=True):
        if a.device.type != "cuda":
            raise AssertionError(f"{what}: {k} came back on {a.device}, not the GPU")
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: {k} differs from the saved tensor")


def _next(pos: int) -> int:
    return -(-pos // 64) * 64  # each tensor's slice 64-byte aligned (any dtype's view)


def host_bytes(flat: list[tuple[str, torch.Tensor]]) -> int:
    pos = 0
    for _, t in flat:
        pos = _next(pos + t.numel() * t.element_size())
    return pos


def completion(fut: Any) -> Any:
    """The future that is done when an async_save is durable (a Future, or torch's newer
    AsyncSaveResponse)."""
    return getattr(fut, "upload_completion", fut)


def pinned_copy(flat: list[tuple[str, torch.Tensor]], host: torch.Tensor) -> float:
    """non_blocking copy_ of every tensor into its slice of a pinned buffer; seconds."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pos = 0
    for _, t in flat:
        n = t.numel() * t.element_size()
        host[pos : pos + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        pos = _next(pos + n)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def h2d_copy(flat: list[tuple[str, torch.Tensor]], host: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pos = 0
    for _, t in flat:
        n = t.numel() * t.element_size()
        t.copy_(host[pos : pos + n].view(t.dtype).view(t.shape), non_blocking=True)
        pos = _next(pos + n)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class Trainer:
    """A small CUDA training step: an MLP in bf16, forward, backward, AdamW."""

    def __init__(self, dim: int = 4096, layers: int = 8, batch: int = 4096):
        torch.manual_seed(0)
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*blocks).cuda().to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)

    def step(self) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = self.model(self.x).float().square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def steps_while(trainer: Trainer, busy: Any, min_steps: int = 5) -> list[float]:
    """Step times while busy() is true (at least min_steps)."""
    out = []
    while busy() or len(out) < min_steps:
        out.append(trainer.step())
        if len(out) > 10_000:
            break
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import ckpt
    from ckpt.integrations.dcp import StorageReader, StorageWriter
    from ckptd import knobs
    from ckptd.format.layout import step_dir

    t_start = time.perf_counter()
    work = args.dir / f"run-{os.getpid()}"
    work.mkdir(parents=True)
    fig: dict[str, list[float]] = {}
    notes: dict[str, Any] = {}

    def add(name: str, v: float) -> None:
        fig.setdefault(name, []).append(v)
        print(f"  {name:<52} {v:10.3f}", flush=True)

    try:
        state = cuda_state(args.size_gib)
        flat = C.flat_tensors(state)
        nbytes = sum(t.numel() * t.element_size() for _, t in flat)
        gb = nbytes / C.GB
        notes["state_bytes"] = nbytes
        notes["device"] = torch.cuda.get_device_name()
        print(f"state: {len(flat)} CUDA tensors, {gb:.2f} GB on {notes['device']}", flush=True)
        host = torch.empty(host_bytes(flat), dtype=torch.uint8, pin_memory=True)
        pinned_copy(flat, host)  # warm-up
        trainer = Trainer()
        for _ in range(3):
            trainer.step()
        alone = [trainer.step() for _ in range(20)]
        notes["train_step_alone_s"] = statistics.median(alone)

        bufs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(max(t for t, _ in READ_SWEEP)):
            bufs.put(C.aligned_buffer(max(w for _, w in READ_SWEEP)))

        def cold_load(step: int, what: str = "", **overrides: Any) -> Any:
            """ckpt.load of `step` into fresh CUDA tensors, page cache dropped, under the
            knobs' `overrides`: timed as the figure `what` names, checked; the tensors."""
            dst = like(state)
            C.drop_caches(work)
            with knobs.override(**overrides):
                t0 = time.perf_counter()
                ckpt.load(dst, work / "ckpt", step=step)
                torch.cuda.synchronize()
            add(f"ckpt.load into CUDA tensors{what} GB/s", gb / (time.perf_counter() - t0))
            check_equal(dst, state, f"ckpt.load{what}")
            return dst

        cp = ckpt.Checkpointer(work / "ckpt", verify="full", keep_last=2)
        cp.resume(state, allow_fresh_start=True)  # maps + registers the staging image
        t0 = time.perf_counter()
        steps_while(trainer, lambda: time.perf_counter() - t0 < TRAIN_S)
        first = cp.save(state, 1)
        add("Checkpointer.save stall, first save s", first.blocking_s)
        first.wait()
        step = 1
        dcp_step = 0

        # DCP in two configurations: a fresh FileSystemWriter per save (it stages into new
        # pageable memory each time, its default), and its faster one, a writer kept across
        # saves that stages into pinned memory it allocates once (cache_staged_state_dict;
        # async_save uses the writer as its stager). The goal is against the faster.
        cached_writer = dcp.FileSystemWriter(
            work / "dcp-cached-0", thread_count=2, cache_staged_state_dict=True
        )

        def dcp_async(i: int, cached: bool = False) -> tuple[float, Any, Path]:
            path = work / (f"dcp-cached-{i}" if cached else f"dcp-{i}")
            writer = cached_writer if cached else dcp.FileSystemWriter(path, thread_count=2)
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)
            return time.perf_counter() - t0, completion(fut), path

        for cached in (False, True):  # warm-up (the cached writer pins its buffers here)
            blocking, fut, path = dcp_async(0, cached)
            fut.result()
            shutil.rmtree(path)
        for rep in range(args.reps):
            if time.perf_counter() - t_start > BUDGET_S:
                notes.setdefault("skipped", []).append(f"rep {rep + 1}: over the time budget")
                break
            print(f"rep {rep + 1}/{args.reps}", flush=True)
            add("pinned copy_ D2H GB/s", gb / pinned_copy(flat, host))
            step += 1
            pending = cp.save(state, step)
            add("Checkpointer.save staging D2H GB/s", gb / pending.timings.staging_s)
            add("Checkpointer.save stall s", pending.blocking_s)
            during = steps_while(trainer, lambda p=pending: not p.done())
            pending.wait()
            add("train step while Checkpointer save persists s", statistics.median(during))
            add(
                "Checkpointer.save total s",
                pending.blocking_s + pending.timings.persist_s + pending.timings.commit_s,
            )
            blocking, fut, path = dcp_async(rep + 1)
            add("DCP async_save stall s", blocking)
            during = steps_while(trainer, lambda f=fut: not f.done())
            fut.result()
            add("train step while DCP async_save persists s", statistics.median(during))
            shutil.rmtree(path)
            blocking, fut, path = dcp_async(rep + 1, cached=True)
            add("DCP async_save stall, cached pinned staging s", blocking)
            fut.result()
            shutil.rmtree(path)
            add("train step alone s", statistics.median([trainer.step() for _ in range(10)]))

            shards = sorted((work / "ckpt" / step_dir(step) / "shards").glob("*.bin"))
            floor_s, sweep = C.best_cold_read(shards, READ_SWEEP, bufs, work)
            notes.setdefault("floor_sweeps", []).append(sweep)
            add("cold read of the step's shard files GB/s", gb / floor_s)
            dst = cold_load(step)
            add("pinned copy_ H2D GB/s", gb / h2d_copy(C.flat_tensors(dst), host))
            # The other way to stream verified blocks to the device: each copied straight
            # from the reader's pageable buffer (no pinned ring).
            cold_load(step, ", no pinned ring", device_load_ring=0)
            # CUDA targets take every window through the pooled read buffers, 4 reads in
            # flight by default (knobs.pooled_reads); this machine's cold read of the same
            # files was best at 8 x 64 MiB (bench/README.md, gpu.py run 3).
            cold_load(step, ", 8 pooled reads", pooled_reads=8)
            dst = like(state)
            C.drop_caches(work)
            t0 = time.perf_counter()
            if cp.resume(dst) != step:  # the same Checkpointer: a second one would fence it
                raise AssertionError("resume did not load the newest step")
            torch.cuda.synchronize()
            add("Checkpointer.resume into CUDA tensors GB/s", gb / (time.perf_counter() - t0))
            check_equal(dst, state, "Checkpointer.resume")
            del dst

            dcp_step += 1
            job = work / "dcp-ckptd"
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=StorageWriter(job, step=dcp_step), no_dist=True)
            add("DCP through ckptd save (CUDA) GB/s", gb / (time.perf_counter() - t0))
            dst = like(state)
            C.drop_caches(work)
            t0 = time.perf_counter()
            dcp.load(dst, storage_reader=StorageReader(job, step=dcp_step), no_dist=True)
            torch.cuda.synchronize()
            add("DCP through ckptd load (CUDA) GB/s", gb / (time.perf_counter() - t0))
            check_equal(dst, state, "DCP through ckptd load")
            del dst
            shutil.rmtree(job / f"step-{dcp_step:012d}", ignore_errors=True)
        cp.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    notes["seconds"] = time.perf_counter() - t_start
    return {"figures": fig, "notes": notes}


def verdicts(fig: dict[str, list[float]]) -> list[dict[str, Any]]:
    med = {k: statistics.median(v) for k, v in fig.items() if v}
    nan = float("nan")

    def m(k: str) -> float:
        return med.get(k, nan)

    rows = [
        ("staging D2H / pinned copy_", m("Checkpointer.save staging D2H GB/s"),
         m("pinned copy_ D2H GB/s"), 0.8),
        # a stall below DCP's best: the faster DCP configuration's stall / ckpt stall > 1
        ("best DCP async_save stall / Checkpointer.save stall", min(
            m("DCP async_save stall s"), m("DCP async_save stall, cached pinned staging s")),
         m("Checkpointer.save stall s"), 1.0),
        ("  DCP async_save stall, fresh writer (info)", m("DCP async_save stall s"),
         m("Checkpointer.save stall s"), None),
        ("  DCP async_save stall, cached pinned staging (info)",
         m("DCP async_save stall, cached pinned staging s"), m("Checkpointer.save stall s"), None),
        # slowdown <= 1.1x: alone / during >= 1 / 1.1
        ("train step alone / while ckpt persists", m("train step alone s"),
         m("train step while Checkpointer save persists s"), 1 / 1.1),
        ("train step alone / while DCP persists (info)", m("train step alone s"),
         m("train step while DCP async_save persists s"), None),
        # the first stall at most 1.5x a later one: later / first >= 1 / 1.5
        ("later Checkpointer.save stall / first", m("Checkpointer.save stall s"),
         m("Checkpointer.save stall, first save s"), 1 / 1.5),
        ("ckpt.load CUDA / cold read of its shard files", m("ckpt.load into CUDA tensors GB/s"),
         m("cold read of the step's shard files GB/s"), 0.85),
        ("Checkpointer.resume CUDA / cold read of its shard files",
         m("Checkpointer.resume into CUDA tensors GB/s"),
         m("cold read of the step's shard files GB/s"), 0.85),
        ("ckpt.load CUDA / pinned H2D copy_ (info)", m("ckpt.load into CUDA tensors GB/s"),
         m("pinned copy_ H2D GB/s"), None),
        ("ckpt.load CUDA, no pinned ring / cold read (info)",
         m("ckpt.load into CUDA tensors, no pinned ring GB/s"),
         m("cold read of the step's shard files GB/s"), None),
        ("ckpt.load CUDA, 8 pooled reads / cold read (info)",
         m("ckpt.load into CUDA tensors, 8 pooled reads GB/s"),
         m("cold read of the step's shard files GB/s"), None),
    ]  # fmt: skip
    return C.ratio_verdicts(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=10.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2 GiB, 1 repetition (a smoke run)")
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-gpu")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "no CUDA device: bench/gpu.py measures the GPU path and needs one "
            "(torch.cuda.is_available() is False); nothing was measured",
            file=sys.stderr,
        )
        return NO_CUDA
    if args.quick:
        args.size_gib, args.reps = min(args.size_gib, 2.0), 1
    warnings.filterwarnings("ignore", module="torch.distributed")
    error = None
    try:
        out = run(args)
    except Exception:
        error = traceback.format_exc()
        print(error, file=sys.stderr)
        out = {"figures": {}, "notes": {}}
    fig = out["figures"]
    print(f"\n{'figure':<52} {'median':>10} {'min-max':>20}")
    for k, v in fig.items():
        print(f"{k:<52} {statistics.median(v):10.3f} {min(v):9.3f}-{max(v):<9.3f}")
    rs = verdicts(fig)
    print("\nratios (of medians; target in brackets)")
    for r in rs:
        tgt = "" if r["target"] is None else f">= {r['target']:.2f}"
        print(f"  {r['ratio']:<50} {r['value']:7.2f}  [{tgt:>8}] {r['verdict']}")
    result = {
        "bench": "gpu",
        "args": vars(args),
        "machine": C.machine_info(args.dir if args.dir.exists() else C.RESULTS_DIR),
        "cuda": {"device": torch.cuda.get_device_name(), "torch_cuda": torch.version.cuda},
        **out,
        "ratios": rs,
        "error": error,
    }
    print(f"\nresults: {C.write_results('gpu', result)}")
    failed = error is not None or any(r["verdict"] == "FAIL" for r in rs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
