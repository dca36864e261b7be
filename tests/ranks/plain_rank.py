"""One rank of a plain job against a coordinator service (no torch.distributed, unless
the spec's "process_group": then a gloo group from MASTER_ADDR/PORT, and ranks of one node
by LOCAL_RANK / LOCAL_WORLD_SIZE save through their node's aggregator).

    python plain_rank.py SPEC.json OUT.json

The environment names the rank and the service (RANK, WORLD_SIZE, CKPTD_ADDRESS,
CKPTD_TOKEN, CKPT_ATTEMPT). SPEC: {"job": path, "lease_s": s, "timeout_s": s,
"actions": [...]}; each action is one of

    {"save": step, "seed": n, "crash_at": "rank.mid_write@1", "pause": "before_write"|"after_write"}
        pause: stop after BeginSave answered / before ReportShard
    {"load": step|null, "seed": n}          load and compare bit-exactly with state(seed)
    {"stop": true}                          pause here (between saves) until SIGCONT

A pause writes OUT.json.paused and stops this process with SIGSTOP (the test resumes it
with SIGCONT). OUT.json gets {"generation", "results": [{"action", "outcome", "message"}]},
rewritten after every action so a killed rank still leaves what it did.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

import ckpt
from ckptd.server.client import CoordinatorClient


def make_state(seed: int, rank: int, step: int, frozen: bool = False) -> dict:
    """frozen: add a 4 MiB tensor (4 hash blocks) of which only block `seed % 4` differs
    from step to step: an incremental save borrows the other blocks of the entry from the
    step before and writes only the changed ones (block references)."""
    g = torch.Generator().manual_seed(seed)
    extra = {}
    if frozen:
        t = torch.arange(1 << 20, dtype=torch.float32)
        t[(seed % 4) * (1 << 18) + 1] = -float(seed)
        extra = {"frozen": t}
    return {
        **extra,
        "w": torch.randn(48, 40, generator=g),  # replicated: equal on every rank
        "b": torch.randn(33, generator=g).to(torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64) * seed,
        "mine": ckpt.PerRank(torch.full((257,), float(rank * 1000 + seed))),
        "who": ckpt.PerRank({"rank": rank, "name": f"r{rank}"}),
        "step": step,
    }


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    results: list[dict] = []
    doc: dict = {"rank": rank, "results": results}

    def dump() -> None:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, out_path)

    # Pause points on the wire client (a stable interface, whatever the writer looks like):
    # "before_write" right after BeginSave answered, "after_write" right before ReportShard.
    pause: dict = {"at": None}
    real_begin, real_report = CoordinatorClient.begin_save, CoordinatorClient.report_shard

    def begin_save(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        r = real_begin(self, *a, **kw)
        if pause["at"] == "before_write":
            stop_here()
        return r

    def report_shard(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if pause["at"] == "after_write":
            stop_here()
        return real_report(self, *a, **kw)

    def stop_here() -> None:
        pause["at"] = None
        pause["n"] = pause.get("n", 0) + 1
        with open(out_path + ".paused", "w") as f:
            f.write(str(pause["n"]))
        # To this thread: a process-directed SIGSTOP lets the sending thread run on until
        # another thread takes the signal; a thread-directed one stops it on the spot.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    CoordinatorClient.begin_save = begin_save
    CoordinatorClient.report_shard = report_shard
    if spec.get("process_group"):  # one node of ranks: they save through its aggregator
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    try:
        cp = ckpt.Checkpointer(
            spec["job"],
            lease_s=spec.get("lease_s", 60.0),
            timeout_s=spec.get("timeout_s", 60.0),
            keep_last=spec.get("keep_last"),
            incremental=bool(spec.get("incremental")),
        )
    except Exception as e:
        results.append({"action": "open", "outcome": type(e).__name__, "message": str(e)})
        dump()
        return 3
    doc["generation"] = cp.generation
    dump()
    try:
        for act in spec["actions"]:
            seed = act.get("seed", 1)
            rec: dict = {"action": act, "t0": time.time()}
            try:
                if act.get("stop"):
                    stop_here()
                    rec.update(outcome="ok")
                elif "save" in act:
                    step = act["save"]
                    if act.get("crash_at"):
                        os.environ["CKPT_CRASH_AT"] = act["crash_at"]
                    pause["at"] = act.get("pause")
                    frozen = bool(spec.get("incremental"))
                    r = cp.save(make_state(seed, rank, step, frozen), step, metadata={"seed": seed})
                    r = r.wait() if callable(getattr(r, "wait", None)) else r
                    rec.update(outcome="ok", bytes=r.bytes)
                else:
                    want = make_state(seed, rank, 0)
                    got = make_state(seed + 12345, rank, -1)
                    r = cp.load(got, act["load"])
                    ok = (
                        all(
                            raw(got[k]) == raw(want[k]) and got[k].dtype == want[k].dtype
                            for k in ("w", "b", "ids")
                        )
                        and raw(got["mine"].value) == raw(want["mine"].value)
                        and got["who"].value == want["who"].value
                        and got["step"] == r.step
                    )
                    rec.update(outcome="ok" if ok else "MISMATCH", step=r.step, metadata=r.metadata)
            except Exception as e:
                rec.update(outcome=type(e).__name__, message=str(e))
                traceback.print_exc()
            rec["t1"] = time.time()
            results.append(rec)
            dump()
            print(f"rank {rank}: {rec}", flush=True)
    finally:
        try:
            cp.close()
        except Exception as e:  # a failure already recorded above
            print(f"close: {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
