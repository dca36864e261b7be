"""The life of a spawned test rank: a local torchrun-like environment, a gloo group, a
result file.

`run_rank` makes this process rank `rank` of `world` on one host (its output to `log`,
MASTER_ADDR/PORT and the RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE torchrun would
set), runs `body()` inside an initialized gloo process group, and writes the returned dict
(with the traceback under "error" when it raised) to `result`; the process exits 1 on error.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def run_rank(
    rank: int,
    world: int,
    port: int,
    *,
    log: str,
    result: str,
    body: Callable[[], dict[str, Any]],
    base: dict[str, Any] | None = None,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch.distributed as dist

    out: dict[str, Any] = dict(base or {"rank": rank})
    code = 0
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        try:
            out.update(body())
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported through the result file
        out["error"] = traceback.format_exc()
        traceback.print_exc()
        code = 1
    with open(result, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)
