"""Start-up time of a Checkpointer whose parent holds many sibling jobs (issue 14, part 3).

A parent directory holds --siblings committed jobs of --steps steps each (one job saved
with a tiny state, then copied; the copies are valid committed jobs), and the measured job
`<parent>/job` beside them. Each repetition runs in a fresh process (so nothing is cached
in the process) against a job that does not exist yet (so the embedded coordinator starts
with a new catalog, the case that rebuilds from storage) and times:

  construct      ckpt.Checkpointer(job)  (the embedded coordinator's start, recovery included)
  construct+save the same, then the first blocking save of a 16-float state

The same is run with an empty parent ("no siblings") for reference. Directory metadata is
warm in the page cache after the first repetition (a fresh start on a busy shared
filesystem pays more per stat). Median and min-max of --reps repetitions; the code
measured is whatever `ckpt` the environment imports (PYTHONPATH), so the same script
measures before and after:

    PYTHONPATH=/work/base14:/work/base14/clients/python .venv/bin/python bench/startup_siblings.py
    .venv/bin/python bench/startup_siblings.py [--siblings 200] [--steps 50] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH_DIR, write_results

_CHILD = """
import json, sys, time
import torch, ckpt
job, save = sys.argv[1], sys.argv[2] == "1"
t0 = time.perf_counter()
cp = ckpt.Checkpointer(job)
t1 = time.perf_counter()
if save:
    cp.save({"w": torch.arange(16.0)}, 1, blocking=True)
t2 = time.perf_counter()
cp.close()
print(json.dumps({"construct_s": t1 - t0, "total_s": t2 - t0, "ckpt": ckpt.__file__}))
"""


def build(parent: Path, siblings: int, steps: int) -> float:
    """The siblings: one job of `steps` committed steps, copied `siblings` times."""
    t0 = time.perf_counter()
    template = parent.parent / "template"
    code = (
        "import sys, torch, ckpt\n"
        "with ckpt.Checkpointer(sys.argv[1]) as cp:\n"
        f"    for s in range(1, {steps} + 1):\n"
        "        cp.save({'w': torch.full((4,), float(s))}, s, blocking=True)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(template)], check=True)
    parent.mkdir(parents=True, exist_ok=True)
    for i in range(siblings):
        shutil.copytree(
            template, parent / f"sibling-{i:04d}", ignore=shutil.ignore_patterns(".ckptd")
        )
    shutil.rmtree(template)
    os.sync()
    return time.perf_counter() - t0


def measure(parent: Path, save: bool) -> dict[str, float]:
    job = parent / "job"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(job), "1" if save else "0"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    shutil.rmtree(job, ignore_errors=True)
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--siblings", type=int, default=200)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=str(BENCH_DIR / "results" / "tmp-data"))
    args = ap.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="startup-siblings-", dir=args.dir))
    try:
        crowded, empty = work / "crowded", work / "empty"
        empty.mkdir()
        build_s = build(crowded, args.siblings, args.steps)
        print(
            f"built {args.siblings} sibling jobs x {args.steps} steps in {build_s:.1f} s",
            flush=True,
        )
        rows: dict[str, list[float]] = {}
        code = ""
        for _ in range(args.reps):  # interleaved: a slow moment hits every case alike
            for label, parent in (("no siblings", empty), (f"{args.siblings} siblings", crowded)):
                for save in (False, True):
                    r = measure(parent, save)
                    code = os.path.dirname(os.path.dirname(r["ckpt"]))
                    key = f"{label}: construct" + ("+save" if save else "")
                    rows.setdefault(key, []).append(r["total_s"] if save else r["construct_s"])
        print(f"\nckpt from {code}; {args.reps} fresh processes per row\n")
        print(f"{'case':<34} {'median s':>9} {'min s':>8} {'max s':>8}")
        stats = {}
        for key, xs in rows.items():
            stats[key] = {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}
            print(f"{key:<34} {stats[key]['median_s']:>9.3f} {min(xs):>8.3f} {max(xs):>8.3f}")
        path = write_results(
            "startup_siblings",
            {"args": vars(args), "code": code, "seconds": rows, "stats": stats},
        )
        print(f"\nresults: {path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
