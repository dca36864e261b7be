"""Saves of many small tensors: what a tensor costs, Python's collector included, against DCP.

A state of `--tensors` float32 tensors of `--numel` elements each (default 3,000 of 256
bytes: a rank's share of a large model's many small parameters and optimizer states, with
next to no bytes, so that what is measured is the work a tensor costs). Each method runs in
a fresh process (the collector's work depends on everything the process holds), the
methods interleaved in every repetition:

- ckpt: a kept `ckpt.Checkpointer` (`keep_last=2`, the default verify="full"), `--saves`
  saves after 3 that warm it, each waited for. Reported: a save's median seconds, its stall
  (`SaveResult.blocking_s`), the seconds Python's collections ran a save (any thread: a
  collection holds the GIL, so the training thread waits for it wherever it runs), and the
  full collections (generation 2) a save.
- ckpt with `gc.freeze()` after those 3 saves (docs/configuration.md): what the collector
  costs a training script that froze its setup.
- DCP: `torch.distributed.checkpoint.save` of the same state to a new directory each
  time (FileSystemWriter, files fsynced), the last 2 kept, the same count of saves.

Then, in the ckpt and DCP processes, `--loads` loads of the last step into a fresh state
of the same shapes (what a restarted job does; the files are as warm for both): ckpt's
`ckpt.load` (every block verified) and `Checkpointer.resume`, DCP's `dcp.load`.

The ratios with a target are DCP's save time over ckpt's and DCP's load time over ckpt's
load and resume times (each >= 1.0: ckpt, which hashes, verifies and commits every save
and checks every block it loads, is at least as fast as DCP, which only writes and
reads). The others are for information: how much of a ckpt save its collections are,
and what `gc.freeze()` gives.

    .venv/bin/python bench/many_tensors.py [--tensors 3000] [--numel 64] [--saves 20]
        [--loads 7] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

METHODS = ("ckpt", "ckpt, gc.freeze() after 3 saves", "DCP")
WARM = 3
LOAD_FIELDS = ("load_s", "resume_s")  # NaN where a method does not measure one


def _state(tensors: int, numel: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.w": torch.randn(numel, generator=g) for i in range(tensors)}}


def _timed_loads(state: dict[str, Any], n: int, load: Any) -> list[float]:
    """`n` timings of load(dest) into a fresh state shaped like `state`, each checked."""
    import torch

    seconds = []
    for _ in range(n):
        dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        t = time.perf_counter()
        load(dest)
        seconds.append(time.perf_counter() - t)
        if not all(torch.equal(dest["model"][k], v) for k, v in state["model"].items()):
            raise AssertionError("a load gave back different tensors than were saved")
    return seconds


class _Collections:
    """The seconds collections ran and the full collections, while registered."""

    def __init__(self) -> None:
        self.s, self.full, self._t = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            self.full += info["generation"] == 2
        else:
            self.s += time.perf_counter() - self._t


def _child(method: str, args: argparse.Namespace, work: str) -> dict[str, float]:
    """One method's saves in this (fresh) process: medians, and collections a save."""
    state = _state(args.tensors, args.numel)
    seconds: list[float] = []
    stalls: list[float] = []
    loads: dict[str, list[float]] = {}
    clock = _Collections()
    if method == "DCP":
        import torch.distributed.checkpoint as dcp

        for s in range(WARM + args.saves):
            if s == WARM:
                gc.callbacks.append(clock)
            t = time.perf_counter()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{work}/step{s}", sync_files=True))
            if s >= WARM:
                seconds.append(time.perf_counter() - t)
            shutil.rmtree(f"{work}/step{s - 2}", ignore_errors=True)  # keep the last 2
        gc.callbacks.remove(clock)
        stalls = seconds  # DCP's save blocks throughout
        last = f"{work}/step{WARM + args.saves - 1}"
        loads["load_s"] = _timed_loads(
            state, args.loads, lambda d: dcp.load(d, storage_reader=dcp.FileSystemReader(last))
        )
    else:
        import ckpt

        with ckpt.Checkpointer(f"{work}/job", keep_last=2) as cp:
            for s in range(WARM):
                cp.save(state, step=s).wait()
            if "freeze" in method:
                gc.collect()
                gc.freeze()
            gc.callbacks.append(clock)
            for s in range(WARM, WARM + args.saves):
                t = time.perf_counter()
                result = cp.save(state, step=s).wait()
                seconds.append(time.perf_counter() - t)
                stalls.append(result.blocking_s if result is not None else float("nan"))
            gc.callbacks.remove(clock)
            if "freeze" not in method:
                last = WARM + args.saves - 1
                loads["load_s"] = _timed_loads(
                    state, args.loads, lambda d: ckpt.load(d, f"{work}/job", step=last)
                )
                loads["resume_s"] = _timed_loads(state, args.loads, cp.resume)
    nan = float("nan")
    return {
        "save_s": statistics.median(seconds),
        "stall_s": statistics.median(stalls),
        "collections_s_a_save": clock.s / len(seconds),
        "full_collections_a_save": clock.full / len(seconds),
        **{f: statistics.median(loads[f]) if f in loads else nan for f in LOAD_FIELDS},
    }


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e3:.0f}"


def _spread(seconds: list[float]) -> str:
    if any(math.isnan(s) for s in seconds):
        return "-"
    return f"{min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f}"


def _run(method: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        cmd = [sys.executable, __file__, "--child", method, "--work", work]
        cmd += ["--tensors", str(args.tensors), "--numel", str(args.numel)]
        cmd += ["--saves", str(args.saves), "--loads", str(args.loads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=3000)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--loads", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work-dir", default=os.environ.get("TMPDIR"))
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args, args.work)))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common

    load = _common.loadavg_at_start()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for rep in range(args.reps):
        for k in range(len(METHODS)):  # each repetition starts one method later
            method = METHODS[(rep + k) % len(METHODS)]
            r = _run(method, args)
            runs[method].append(r)
            print(
                f"rep {rep + 1}/{args.reps}  {method:<34} save {r['save_s'] * 1e3:6.0f} ms  "
                f"stall {r['stall_s'] * 1e3:5.0f} ms  collections {r['collections_s_a_save'] * 1e3:4.0f} "
                f"ms a save, {r['full_collections_a_save']:.2f} full  "
                f"load {_ms(r['load_s'])} ms  resume {_ms(r['resume_s'])} ms",
                flush=True,
            )
    fields = ("save_s", "stall_s", "collections_s_a_save", "full_collections_a_save")
    fields += LOAD_FIELDS
    med = {m: {f: statistics.median(r[f] for r in runs[m]) for f in fields} for m in METHODS}
    print(
        f"\n{args.tensors} tensors of {args.numel * 4} bytes, {args.saves} saves and "
        f"{args.loads} loads a run, medians of {args.reps} runs"
    )
    print(
        f"{'method':<34} {'save ms':>8} {'(min-max)':>12} {'stall ms':>9} {'GC ms':>6} {'full GC':>8}"
        f" {'load ms':>8} {'(min-max)':>12} {'resume ms':>10}"
    )
    for m in METHODS:
        saves = [r["save_s"] * 1e3 for r in runs[m]]
        print(
            f"{m:<34} {med[m]['save_s'] * 1e3:8.0f} {f'{min(saves):.0f}-{max(saves):.0f}':>12} "
            f"{med[m]['stall_s'] * 1e3:9.0f} {med[m]['collections_s_a_save'] * 1e3:6.0f} "
            f"{med[m]['full_collections_a_save']:8.2f} {_ms(med[m]['load_s']):>8} "
            f"{_spread([r['load_s'] for r in runs[m]]):>12} {_ms(med[m]['resume_s']):>10}"
        )
    ckpt_s, dcp_s = med["ckpt"]["save_s"], med["DCP"]["save_s"]
    frozen_s = med["ckpt, gc.freeze() after 3 saves"]["save_s"]
    # (name, numerator s, denominator s, target): the verdicts are _common's, as in every
    # bench (a ratio of the medians; >= target passes).
    ratios = _common.ratio_verdicts(
        [
            ("DCP save time / ckpt save time", dcp_s, ckpt_s, 1.0),
            ("DCP load time / ckpt.load time", med["DCP"]["load_s"], med["ckpt"]["load_s"], 1.0),
            (
                "DCP load time / Checkpointer.resume time",
                med["DCP"]["load_s"],
                med["ckpt"]["resume_s"],
                1.0,
            ),
            (
                "ckpt: its collections / its save time",
                med["ckpt"]["collections_s_a_save"],
                ckpt_s,
                None,
            ),
            ("ckpt save time / the same with gc.freeze()", ckpt_s, frozen_s, None),
        ]
    )
    print("\nratios (of medians; target in brackets)")
    for r in ratios:
        tgt = "" if r["target"] is None else f">= {r['target']}"
        print(f"  {r['ratio']:<44} {r['value']:6.2f}  [{tgt:>7}] {r['verdict']}")
    path = _common.write_results(
        "many_tensors",
        {
            "machine": _common.machine_info(Path(args.work_dir or tempfile.gettempdir())),
            "args": vars(args),
            "loadavg_start": load,
            "runs": runs,
            "medians": med,
            "ratios": [{k: r[k] for k in ("ratio", "value", "target", "verdict")} for r in ratios],
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
