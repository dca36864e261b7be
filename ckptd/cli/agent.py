"""`ckptd agent`: one node's memory tier (ckptd.agent), serving until stopped.

    ckptd agent --root /dev/shm/ckptd-JOB --node N [--listen HOST:PORT]
                [--token-file F] [--max-steps K] [--max-bytes B]

The token is the job's (the file's first line, else $CKPTD_TOKEN); without one the agent
refuses to start. The address it listens on is written to <root>/agent.json, which the
node's ranks read (ckpt._memory starts an agent this way when none is running; Slurm or
Kubernetes may start it instead, one per node, before the ranks). It exits on SIGTERM or
when its root is removed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from ckptd.agent.holdings import Budget, Holdings
from ckptd.agent.server import AgentServer
from ckptd.errors import CkptError
from ckptd.server.auth import load_token

log = logging.getLogger("ckptd.agent")


def add_parser(sub: Any) -> None:
    a = sub.add_parser("agent", help="run this node's memory agent (the in-memory tier)")
    a.add_argument("--root", required=True, help="shared-memory directory, e.g. /dev/shm/ckptd-J")
    a.add_argument("--node", type=int, default=0, help="this node's index in the job")
    a.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks one)")
    a.add_argument("--token-file", help="the job's token (else $CKPTD_TOKEN)")
    a.add_argument("--max-steps", type=int, help="steps held at most (oldest evicted)")
    a.add_argument("--max-bytes", type=int, help="bytes held at most (oldest evicted)")


def run(args: argparse.Namespace) -> int:
    token = load_token(args.token_file)
    if not token:
        print(
            "error: ckptd agent needs the job's token (--token-file or CKPTD_TOKEN)",
            file=sys.stderr,
        )
        return 2
    host, _, port = args.listen.rpartition(":")
    try:
        holdings = Holdings(args.root, Budget(args.max_steps, args.max_bytes), node=args.node)
        server = AgentServer(holdings, token, host or "127.0.0.1", int(port or 0))
    except (CkptError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    server.publish()
    log.info("memory agent node %d: %s serving %s", args.node, server.address, holdings.root)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_until_root_gone()
    return 0
