"""The story `make demo` tells: a rank dies mid-save, torchrun restarts, training resumes.

1. Train a tiny GPT on 2 CPU ranks under torchrun (examples/train_gpt.py), checkpointing
   asynchronously every few steps through the zero-config coordinator (rank 0 hosts it).
2. In the middle of one background save, rank 1 is killed with SIGKILL (ckptd's crash
   point `rank.mid_write`, armed on the first attempt only).
3. torchrun sees the dead worker and restarts both (--max-restarts 1).
4. The new workers resume from the last committed checkpoint: the interrupted save never
   committed (no manifest) and is skipped, with the reason.
5. Training goes on to the end.
6. `ckptctl verify --all` re-reads and re-hashes every checkpoint of the job.
7. The same training without interruption (same seed) ends with the same loss and the
   same parameters and optimizer state, to the bit.

Checkpoints and logs go to ./demo-ckpts (removed at the start). `story()` is also what
the integration test runs, with a smaller model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TTY = sys.stdout.isatty()


def bold(s: str) -> str:
    return f"\033[1m{s}\033[0m" if TTY else s


def heading(msg: str) -> None:
    print(f"\n{bold('== ' + msg)}", flush=True)


@dataclasses.dataclass
class Config:
    root: Path
    steps: int = 120
    save_every: int = 10
    crash_at: int = 70
    d_model: int = 64
    layers: int = 4
    print_every: int = 10
    seed: int = 0
    lease_s: float = 5.0  # a silent rank aborts the save in flight after this long

    def train_args(self) -> list[str]:
        return [
            "--steps",
            str(self.steps),
            "--save-every",
            str(self.save_every),
            "--d-model",
            str(self.d_model),
            "--layers",
            str(self.layers),
            "--print-every",
            str(self.print_every),
            "--seed",
            str(self.seed),
            "--lease",
            str(self.lease_s),
        ]


def torchrun(cfg: Config, job: Path, log: Path, *, crash: bool, show: bool) -> tuple[int, float]:
    """Run train_gpt.py on 2 ranks; stream the story lines; (exit code, seconds)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(HERE / "train_gpt.py"),
        "--ckpt",
        str(job),
        "--out",
        str(job.parent / f"{job.name}.jsonl"),
        *cfg.train_args(),
    ]
    if crash:
        cmd += ["--crash-at", str(cfg.crash_at)]
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # torchrun keeps one TCP store across restarts and the workers' keys carry no
        # attempt, so restarted gloo workers can read the dead ones' addresses (the
        # restart then hangs or fails: pytorch/pytorch#167288). A store per attempt:
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    env.pop("CKPT_CRASH_AT", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "clients" / "python"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    t0 = time.perf_counter()
    stage = 1
    with (
        open(log, "w") as raw,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            raw.write(line)
            if not show:
                continue
            stage = narrate(line.rstrip("\n"), stage, cfg)
        rc = proc.wait()
    return rc, time.perf_counter() - t0


def narrate(line: str, stage: int, cfg: Config) -> int:
    """Print the lines that tell the story (headings as it unfolds); the rest stays in the log."""
    if "kill -9 of this rank planned" in line and stage < 2:
        heading(f"2. kill -9 rank 1 in the middle of its background save of step {cfg.crash_at}")
        stage = 2
    if "closing signal SIGTERM" in line and stage == 2:
        print(
            "[torchrun] rank 1 is dead: SIGTERM to rank 0 (which notes it and waits for its "
            "save in flight)"
        )
        return stage
    if "failed (exitcode: -9)" in line and stage < 3:
        heading("3. torchrun restarts both workers (--max-restarts 1): attempt 1")
        print("[torchrun] rank 1 exited with SIGKILL, rank 0 has exited: starting attempt 1")
        return 3
    if line.startswith("[rank0]: RuntimeError") and "Connection reset" in line:
        print("[train] rank 0: its next gradient all-reduce failed: rank 1 is gone")
        return stage
    if line.startswith("[ckpt]") and stage == 3:
        heading("4. The new workers resume from the last committed checkpoint")
        stage = 4
    if line.startswith("[train]") and "resumed from step" in line:
        if stage < 4:
            heading("4. The new workers resume from the last committed checkpoint")
        print(line)
        heading("5. Training goes on to the end")
        return 5
    if line.startswith(("[train]", "[ckpt]")):
        print(line, flush=True)
    return stage


def ckptctl(*args: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "ckptd.cli.ckptctl", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    return p.returncode, p.stdout + p.stderr


def attempts(job: Path) -> list[dict[str, Any]]:
    f = job.parent / f"{job.name}.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def compare(a: Path, b: Path, step: int) -> dict[str, Any]:
    """Step `step` of two jobs, compared bit for bit.

    The values are loaded (as rank 0 sees them) and compared byte by byte; and the
    blake3 of every chunk every rank saved (rank 1's own RNG states included) and every
    non-tensor value in the manifests must match too.
    """
    import torch

    import ckpt
    from ckptd.format import checkpoint as ckfmt
    from ckptd.storage import open_storage

    ra, rb = ckpt.load({}, str(a), step=step), ckpt.load({}, str(b), step=step)
    la, lb = flat(ra.state), flat(rb.state)
    tensors = [k for k, v in la.items() if isinstance(v, torch.Tensor)]
    differ = [
        k for k in sorted(set(la) | set(lb)) if k not in la or k not in lb or not same(la[k], lb[k])
    ]

    def digests(job: Path) -> tuple[dict[tuple[str, tuple[int, ...]], list[str]], Any]:
        ck = ckfmt.open_checkpoint(open_storage(str(job)), step)
        out = {
            (c.entry.key, tuple(c.entry.chunk_offsets)): c.entry.blake3
            for chunks in ck.chunks.values()
            for c in chunks
        }
        return out, ck.manifest.state

    da, sa = digests(a)
    db, sb = digests(b)
    differ += [f"chunk {k[0]}" for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]
    if sa != sb:
        differ.append("manifest state")
    return {
        "loss_a": ra.metadata.get("loss"),
        "loss_b": rb.metadata.get("loss"),
        "values": len(la),
        "chunks": len(da),
        "tensors": len(tensors),
        "model_tensors": sum(k.startswith("model/") for k in tensors),
        "optim_tensors": sum(k.startswith("optim/") for k in tensors),
        "differ": differ,
    }


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flat(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    if isinstance(node, (list, tuple)):
        out = {}
        for i, v in enumerate(node):
            out.update(flat(v, f"{prefix}/{i}"))
        return out
    if type(node).__name__ == "PerRank":
        return flat(node.value, prefix)
    return {prefix: node}


def same(x: Any, y: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return (
            x.dtype == y.dtype
            and x.shape == y.shape
            and x.contiguous()
            .reshape(-1)
            .view(torch.uint8)
            .equal(y.contiguous().reshape(-1).view(torch.uint8))
        )
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    return type(x) is type(y) and x == y


def story(cfg: Config, *, show: bool = True) -> dict[str, Any]:
    """Run the whole story; returns the facts (the test checks them too)."""
    shutil.rmtree(cfg.root, ignore_errors=True)
    cfg.root.mkdir(parents=True)
    job, ref = cfg.root / "gpt", cfg.root / "gpt-uninterrupted"
    facts: dict[str, Any] = {"crash_at": cfg.crash_at, "steps": cfg.steps}

    if show:
        heading(
            f"1. Train a tiny GPT ({cfg.layers} blocks, d={cfg.d_model}) on 2 CPU ranks under "
            f"torchrun; async checkpoint every {cfg.save_every} steps; rank 0 hosts the coordinator"
        )
    rc, secs = torchrun(cfg, job, cfg.root / "interrupted.log", crash=True, show=show)
    facts.update(rc=rc, seconds=secs, attempts=attempts(job))
    log = (cfg.root / "interrupted.log").read_text()
    facts["killed"] = "failed (exitcode: -9) local_rank: 1" in log
    facts["skipped_line"] = next(
        (x for x in log.splitlines() if "skipping step" in x and "resume" in x), None
    )
    facts["lease_line"] = next(
        (x for x in log.splitlines() if "aborting job" in x and "lease expired" in x), None
    )
    facts["recovered_line"] = next(
        (x for x in log.splitlines() if "recovered job" in x and "ABORTED" in x), None
    )
    if rc != 0:
        print(log[-6000:])
        print(
            f"torchrun failed (exit code {rc}); the whole log is in {cfg.root / 'interrupted.log'}"
        )
        return facts

    if show:
        heading("6. ckptctl verify --all: every block of every checkpoint re-read and re-hashed")
        print(f"$ ckptctl list {job}")
        print(ckptctl("list", str(job))[1].rstrip())
    vrc, vout = ckptctl("verify", str(job), "--all")
    facts["verify_rc"], facts["verify_out"] = vrc, vout
    if show:
        print(f"$ ckptctl verify {job} --all")
        print(vout.rstrip())
        print(f"exit code {vrc}")

    if show:
        heading("7. The same training, uninterrupted, same seed: compare to the bit")
        print("(running it: 2 ranks under torchrun, no crash ...)", flush=True)
    rrc, rsecs = torchrun(cfg, ref, cfg.root / "uninterrupted.log", crash=False, show=False)
    facts.update(reference_rc=rrc, reference_seconds=rsecs)
    if rrc != 0:
        print((cfg.root / "uninterrupted.log").read_text()[-6000:])
        return facts
    cmp = compare(job, ref, cfg.steps)
    facts["compare"] = cmp
    facts["same_loss"] = cmp["loss_a"] is not None and (
        float(cmp["loss_a"]).hex() == float(cmp["loss_b"]).hex()
    )
    facts["identical"] = not cmp["differ"] and facts["same_loss"]
    if show:
        la, lb = cmp["loss_a"], cmp["loss_b"]
        print(f"final loss, killed and resumed: {la!r} ({float(la).hex()})")
        print(f"final loss, uninterrupted:      {lb!r} ({float(lb).hex()})")
        if facts["identical"]:
            print(
                f"bit-identical: the loss, all {cmp['values']} values of step {cfg.steps} as "
                f"loaded ({cmp['model_tensors']} model tensors, {cmp['optim_tensors']} "
                "optimizer tensors, schedule, sampler position, RNG states), and the blake3 of "
                f"all {cmp['chunks']} chunks both ranks wrote"
            )
        else:
            print(f"DIFFERENT: {', '.join(cmp['differ'][:10])}")
    return facts


def summary(facts: dict[str, Any]) -> bool:
    heading("Summary")
    last = facts["attempts"][-1] if facts.get("attempts") else {}
    resumed = last.get("resumed_from")
    checked = facts.get("verify_out", "").count(": OK")
    cmp = facts.get("compare", {})
    rows = [
        (
            "rank killed mid-save (kill -9)",
            f"rank 1, writing its shard of step {facts['crash_at']}",
        ),
        (
            "interrupted save",
            f"step {facts['crash_at']}: "
            + ("aborted (rank 1 silent past the lease), " if facts.get("lease_line") else "")
            + "never committed, skipped by resume"
            if facts.get("skipped_line")
            else "?",
        ),
        (
            "torchrun restart",
            f"attempt {last.get('attempt')}, coordinator generation {last.get('generation')}",
        ),
        ("resumed from", f"step {resumed} (the last committed checkpoint)"),
        (
            "steps trained twice",
            f"{resumed + 1}-{facts['crash_at']}" if isinstance(resumed, int) else "?",
        ),
        ("ckptctl verify --all", f"{checked} checkpoints OK (exit code {facts.get('verify_rc')})"),
        (
            "final loss vs uninterrupted run",
            f"{cmp.get('loss_a')!r} vs {cmp.get('loss_b')!r}: "
            + ("bit-identical" if facts.get("same_loss") else "DIFFERENT"),
        ),
        (
            "saved state vs uninterrupted run",
            f"{cmp.get('values')} values, {cmp.get('chunks')} chunks: "
            + ("bit-identical" if not cmp.get("differ") else "DIFFERENT"),
        ),
        (
            "wall time",
            f"{facts['seconds']:.0f} s killed + resumed, {facts.get('reference_seconds', 0):.0f} s uninterrupted",
        ),
    ]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    ok = bool(
        facts.get("rc") == 0
        and facts.get("killed")
        and facts.get("skipped_line")
        and facts.get("verify_rc") == 0
        and facts.get("identical")
    )
    print(
        "\n"
        + bold(
            "The job survived a kill -9 mid-save and finished as if nothing had happened."
            if ok
            else "Something went wrong; see the logs in demo-ckpts/."
        )
    )
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="demo-ckpts", help="where checkpoints and logs go")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--crash-at", type=int, default=70)
    args = p.parse_args()
    cfg = Config(
        Path(args.root).resolve(),
        steps=args.steps,
        save_every=args.save_every,
        crash_at=args.crash_at,
    )
    if cfg.crash_at % cfg.save_every or not 0 < cfg.crash_at < cfg.steps:
        p.error("--crash-at must be a step that saves (a multiple of --save-every) before the last")
    t0 = time.perf_counter()
    facts = story(cfg)
    ok = summary(facts) if facts.get("rc") == 0 else False
    print(f"({time.perf_counter() - t0:.0f} s in all; logs and checkpoints in {cfg.root})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
