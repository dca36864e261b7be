"""What health stats cost on a save's background path, and why they are computed as they are.

The stats (NaN/Inf counts, sum of squares, max |x| per floating-point chunk:
ckptd/format/tensorstats.py) ride the pass that hashes every block of the staging copy.
One run, methods interleaved in every repetition (each repetition starting one method
later), on the bench state (bf16 weights, fp32 Adam moments: bench/_common.make_state),
staged once into the host image as a save stages it:

  hash    the background hash pass (writer.hash_items, io_threads threads), stats off
          (CKPT_HEALTH_STATS=0) and on: the cost where it is paid
  stats   the stats alone, one thread, in numpy as ckptd computes them, and the same
          stats with torch's reductions on the staging copy (isnan/isinf sums,
          vector_norm in float64, abs().amax(), with torch's default intra-op threads),
          the obvious alternative
  save    Checkpointer.save's background part (hash, plan, write, fsync, verify="full",
          commit: PendingSave.wait() after the blocking part returned), stats off and on

Ratios (of medians, GB/s): hash pass with stats / without (target >= 0.8), save background
with stats / without (target >= 0.95), and, for information, numpy stats / torch stats.
GB = 1e9 bytes. Results go to bench/results/health_stats-<timestamp>.json.

    .venv/bin/python bench/health_stats.py [--size-gib 1] [--reps 3] [--only hash]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as C
import torch

import ckpt
from ckpt._flatten import flatten
from ckpt._staging import HostImage, stage
from ckptd import knobs
from ckptd.format import tensorstats
from ckptd.format.writer import WriteItem, hash_items


@dataclass
class Bench:
    work: Path
    state: dict[str, Any]
    desc: dict[str, Any]
    items: list[WriteItem] = field(default_factory=list)
    nbytes: int = 0
    size: int = 0
    notes: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    image: HostImage = field(default_factory=HostImage)
    cps: dict[bool, ckpt.Checkpointer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _node, leaves = flatten(self.state)
        buf, self.items, _ = stage(leaves, self.image, alignment=knobs.get().alignment)
        self.size = buf.nbytes
        self.nbytes = sum(it.data.nbytes for it in self.items)


Method = Callable[[Bench], float]
REGISTRY: list[tuple[str, str, Method]] = []


def method(group: str, name: str) -> Callable[[Method], Method]:
    def register(fn: Method) -> Method:
        REGISTRY.append((group, name, fn))
        return fn

    return register


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@method("hash", "hash pass, stats off")
def hash_off(b: Bench) -> float:
    with knobs.override(health_stats=False):
        return _timed(lambda: hash_items(b.items))


@method("hash", "hash pass + stats")
def hash_on(b: Bench) -> float:
    s = _timed(lambda: hash_items(b.items))
    assert all(it.stats is not None for it in b.items)
    return s


def _numpy_stats(b: Bench) -> None:
    block = knobs.get().block_size
    for it in b.items:
        tensorstats.combine(
            tensorstats.block_stats(it.data[o : o + block], it.dtype)
            for o in range(0, it.data.nbytes, block)
        )


def _torch_stats(b: Bench) -> None:
    for it in b.items:
        t = torch.from_numpy(it.data).view(getattr(torch, it.dtype))
        int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        float(torch.linalg.vector_norm(t, dtype=torch.float64)), float(t.abs().amax())


@method("stats", "stats alone: numpy, 1 thread (ckptd)")
def numpy_stats(b: Bench) -> float:
    return _timed(lambda: _numpy_stats(b))


@method("stats", "stats alone: torch reductions")
def torch_stats(b: Bench) -> float:
    return _timed(lambda: _torch_stats(b))


def _save(b: Bench, on: bool) -> float:
    b.step += 1
    with knobs.override(health_stats=on):
        cp = b.cps.get(on)
        if cp is None:
            cp = b.cps[on] = ckpt.Checkpointer(str(b.work / f"job-{int(on)}"), keep_last=1)
        C.drop_caches(b.work)
        pending = cp.save(b.state, b.step)  # returns after the blocking part
        s = _timed(pending.wait)
    return s


@method("save", "Checkpointer.save background, stats off")
def save_off(b: Bench) -> float:
    return _save(b, False)


@method("save", "Checkpointer.save background + stats")
def save_on(b: Bench) -> float:
    return _save(b, True)


def ratios(med: dict[str, float]) -> list[dict[str, Any]]:
    nan = float("nan")
    return C.ratio_verdicts(
        [
            (
                "hash pass + stats / hash pass alone",
                med.get("hash pass + stats", nan),
                med.get("hash pass, stats off", nan),
                0.8,
            ),
            (
                "save background + stats / without",
                med.get("Checkpointer.save background + stats", nan),
                med.get("Checkpointer.save background, stats off", nan),
                0.95,
            ),
            (
                "numpy stats / torch reductions (info)",
                med.get("stats alone: numpy, 1 thread (ckptd)", nan),
                med.get("stats alone: torch reductions", nan),
                None,
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--dir", type=Path, default=C.RESULTS_DIR / "tmp-data", help="work directory")
    p.add_argument(
        "--only", default="", help="run only methods whose name contains one of these |-separated"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    C.select(REGISTRY, args.only)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = args.dir / f"health-{os.getpid()}"
    work.mkdir()
    load0 = C.loadavg_at_start()
    state, desc = C.make_state(args.size_gib, args.seed)
    b = Bench(work, state, desc)
    try:
        print(f"state: {desc['tensors']} tensors, {b.nbytes / C.GB:.3f} GB; work dir {work}")
        times, errors = C.run_reps(REGISTRY, b, args.reps, rotate=True)
        b.notes["loadavg_start"], b.notes["loadavg_end"] = load0, os.getloadavg()
        b.notes["io_threads"] = knobs.get().io_threads
        b.notes["torch_threads"] = torch.get_num_threads()
        C.report_run("health_stats", b, REGISTRY, times, errors, args, ratios)
    finally:
        for cp in b.cps.values():
            cp.close()
        b.image.release()
        C.remove(work)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
