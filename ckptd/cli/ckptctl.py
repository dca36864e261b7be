"""ckptctl: list, inspect, verify, diff, restore and garbage-collect checkpoints, from storage alone.

Exit codes: 0 all good, 1 a problem was found (corrupt, missing, no checkpoint, no such
step, a path that is not a job directory, storage that refused an operation; `diff
--exit-code`: the steps differ), 2 usage error. `--json` prints exactly one JSON document on
stdout, also on failure ({"command", "path", "ok": false, "error", "exit_code"}); every
document has "command", "path" (absolute, or the URL) and "ok" (docs/cli.md has each
command's schema). Human text goes to stdout, errors to stderr as one `error:` line;
progress bars go to stderr, only when it is a terminal and never with --json. Every
CkptError and OSError a command meets ends in that error line (and document), never a
traceback: `main` is the one place that turns them into exit codes.

This module is the parser and `main`; each command is a module of ckptd.cli.ctl
(cmd_list, cmd_inspect, cmd_verify, cmd_gc, cmd_diff, cmd_restore) over the shared
output, progress and connection modules, and no command imports another.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence

from ckptd.cli.ctl.cmd_diff import cmd_diff
from ckptd.cli.ctl.cmd_gc import cmd_gc
from ckptd.cli.ctl.cmd_inspect import cmd_inspect
from ckptd.cli.ctl.cmd_list import cmd_list, cmd_list_coordinator
from ckptd.cli.ctl.cmd_restore import cmd_restore
from ckptd.cli.ctl.cmd_verify import cmd_verify
from ckptd.cli.ctl.connection import add_coordinator_options
from ckptd.cli.ctl.output import PROBLEM, USAGE, UsageError, fail, job_path
from ckptd.errors import CkptError
from ckptd.format import health
from ckptd.storage import Storage, open_storage


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptctl",
        description="List, inspect, verify, diff, restore and clean up ckptd checkpoints, "
        "from storage alone.",
        epilog="exit codes: 0 ok; 1 a problem was found (corrupt or missing data, no such "
        "step; diff --exit-code: the steps differ); 2 usage error. --json: one JSON document "
        "on stdout, also on failure (docs/cli.md).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument(
            "path", metavar="PATH", help="the job's checkpoint directory (or fsspec URL)"
        )
        sp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        return sp

    sp = add("list", "list the steps of a job and their status")
    add_coordinator_options(sp, "ask a running coordinator (shows OPEN and ABORTED saves too)")
    sp.add_argument(
        "--mirror",
        metavar="URL",
        help="the job's mirror tier (e.g. s3://bucket/job): show which tiers hold each step",
    )
    sp = add("inspect", "show a committed step's manifest and tensors")
    sp.add_argument("--step", type=int, help="step (default: newest committed)")
    sp.add_argument(
        "--stats",
        action="store_true",
        help="also each floating-point tensor's health (L2 norm, max |x|, NaN and Inf counts) "
        "recorded at save time",
    )
    sp = add("verify", "check sizes and blake3 hashes of committed steps")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="step (default: newest committed)")
    g.add_argument("--all", action="store_true", help="every committed step")
    sp.add_argument(
        "--level",
        choices=("size", "full"),
        default="full",
        help="size: presence and sizes; full: re-read and hash every byte (default)",
    )
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_coordinator_options(
        sp,
        "also check each manifest against the blake3 the coordinator's catalog recorded "
        "at commit (detects a consistent rewrite of shards, indexes and manifest)",
    )
    sp = add("gc", "remove debris of unfinished saves and, optionally, old steps")
    sp.add_argument("--keep-last", type=int, help="also remove committed steps beyond the newest N")
    sp.add_argument(
        "--include-newer",
        action="store_true",
        help="also remove unfinished steps newer than the newest committed one (only when no save is running)",
    )
    sp.add_argument(
        "--quarantined",
        action="store_true",
        help="also remove steps quarantined after failing verification at load time",
    )
    sp.add_argument(
        "--abandoned",
        action="store_true",
        help="also remove committed steps off the live line (a branch a rollback left)",
    )
    sp.add_argument("--dry-run", action="store_true", help="show what would be removed")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument(
        "--keep-recycled", action="store_true", help="keep retired shard files kept for reuse"
    )
    sp = add(
        "restore",
        "write a consolidated (unsharded) copy of a step as safetensors, torch or zarr, "
        "verifying every byte",
    )
    sp.add_argument("--step", type=int, help="step (default: newest committed)")
    sp.add_argument("--to", required=True, metavar="OUT", help="output file (zarr: directory)")
    sp.add_argument(
        "--format",
        required=True,
        choices=("safetensors", "torch", "zarr"),
        help="safetensors: one file (safetensors.torch.load_file); torch: one file "
        "(torch.load(weights_only=True)); zarr: a Zarr v3 hierarchy (docs/restore.md)",
    )
    sp.add_argument(
        "--keys",
        action="append",
        metavar="PATTERN",
        help="only tensors whose keys match this glob (repeatable; 'model' also means 'model/*')",
    )
    sp.add_argument(
        "--zarr-keep-bfloat16",
        action="store_true",
        help="zarr: write bfloat16 as tensorstore's bfloat16 type (readable by tensorstore and "
        "JAX, not by zarr-python) instead of its raw bits as uint16",
    )
    sp.add_argument("--force", action="store_true", help="replace OUT if it exists")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp = add(
        "diff",
        "which tensors and values changed, were added or removed between two committed steps "
        "(by blake3; data is read only where the chunk layouts differ)",
    )
    sp.add_argument("step_a", metavar="STEP_A", type=int)
    sp.add_argument("step_b", metavar="STEP_B", type=int)
    sp.add_argument("--all", action="store_true", help="also list the unchanged keys")
    sp.add_argument(
        "--exit-code", action="store_true", help="exit 1 when the steps differ (like git diff)"
    )
    sp.add_argument(
        "--norm-jump",
        type=float,
        default=health.DEFAULT_JUMP,
        metavar="FACTOR",
        help="mark a tensor whose L2 norm grew or shrank by more than FACTOR (default 2)",
    )
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


COMMANDS = {
    "list": cmd_list,
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "gc": cmd_gc,
    "restore": cmd_restore,
    "diff": cmd_diff,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if e.code in (0, None) else USAGE
    try:
        if args.command == "list" and args.coordinator:
            return cmd_list_coordinator(args)
        storage = open_storage(args.path)
        not_a_job = _not_a_job(storage, args)
        if not_a_job:
            return fail(args, not_a_job)
        return COMMANDS[args.command](storage, args)
    except UsageError as e:
        return fail(args, str(e), USAGE)
    except (ValueError, CkptError) as e:
        usage = isinstance(e, ValueError) and not isinstance(e, CkptError)
        return fail(args, str(e), USAGE if usage else PROBLEM)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ckptctl inspect --json | head`: the reader left; no traceback, and no second
        # error when Python flushes stdout at exit.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (in-process runs)
            pass
        return PROBLEM
    except OSError as e:  # storage refused (read-only, permissions, a full disk, EIO)
        return fail(args, _os_error(e, args))


def _not_a_job(storage: Storage, args: argparse.Namespace) -> str | None:
    """Why PATH cannot be a job's checkpoint directory (None when it can be one)."""
    local = storage.local_path("")
    if local is not None and os.path.lexists(local) and not os.path.isdir(local):
        return (
            f"{job_path(args)} is a file, not a job's checkpoint directory (the directory "
            "that holds its step-* directories)"
        )
    if not storage.exists(""):
        return f"{job_path(args)} does not exist; pass the job's checkpoint directory"
    return None


def _os_error(e: OSError, args: argparse.Namespace) -> str:
    """An OSError as one line: the file, what the system said (with the errno's name) and
    what to do about it."""
    name = errno.errorcode.get(e.errno or 0, "")
    where = e.filename or job_path(args)
    msg = f"{where}: {e.strerror or e}" + (f" ({name})" if name else "")
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        msg += (
            f"; ckptctl {args.command} needs to write there: run it where the storage is "
            "writable, as a user allowed to write it"
        )
    elif e.errno == errno.ENOSPC:
        msg += "; the filesystem is full: free space (ckptctl gc --keep-last N)"
    return msg


if __name__ == "__main__":
    sys.exit(main())
