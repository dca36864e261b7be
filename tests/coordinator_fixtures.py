"""Real parts for the coordinator tests: cores, servers, `ckptd serve` processes, ranks.

Nothing here is mocked. `RankSim` drives the transport-free core the way a rank's
Checkpointer does (flatten, hash, BeginSave, write a real shard with the real writer,
ReportShard); `ServerThread` runs the real grpc.aio server on port 0 on a private event
loop; `Serve` runs `ckptd serve` as a subprocess (port file, token file, its own env for
crash points); `start_rank` runs tests/ranks/plain_rank.py as a real rank process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import json
import multiprocessing as mp
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ckpt._flatten import flatten
from ckptd.coordinator.catalog import Catalog
from ckptd.coordinator.core import Coordinator
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import BeginResult, SaveRef, ShardReport, StatusResult
from ckptd.format.writer import WriteItem, hash_items, write_shard
from ckptd.server.client import CoordinatorClient
from ckptd.storage import open_storage

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
PY = sys.executable
BIN = Path(sys.executable).parent
TOKEN = "test-token-5b1f"


# ----------------------------------------------------------------------------- small things


def finished(result: Any) -> Any:
    """The SaveResult of Checkpointer.save: waits when it returned a PendingSave."""
    wait = getattr(result, "wait", None)
    return wait() if callable(wait) else result


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(
    target: Callable[..., None],
    world: int,
    args_of: Callable[[int, int], tuple[Any, ...]],
    out: Path,
    *,
    log_name: Callable[[int], str] = lambda r: f"rank{r}.log",
    timeout: float = 120,
    log_tail: int | None = None,
) -> tuple[list[Any], str]:
    """`world` rank processes (spawned: a fresh interpreter each, as torchrun gives)
    running target(*args_of(rank, port)) on one free port, waited for at most `timeout`
    together; a rank still running then is killed and fails the test by name. Returns the
    processes and every rank's log (out/log_name(rank); its last `log_tail` characters),
    for the caller's assertions."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=args_of(r, port), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)

    def log_of(r: int) -> str:
        text = (out / log_name(r)).read_text(errors="replace")
        return text[-log_tail:] if log_tail else text

    logs = "\n".join(
        f"--- rank {r}\n{log_of(r)}" for r in range(world) if (out / log_name(r)).exists()
    )
    assert not hung, f"ranks {hung} hung:\n{logs}"
    return procs, logs


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def child_env(**extra: str | None) -> dict[str, str]:
    """The environment for a child process: repo importable, no stray ckpt settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CKPT_", "CKPTD_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "clients" / "python"), str(TESTS), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def read_catalog(path: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """{step: row} of the saves table, read with a short-lived read-only connection."""
    db = sqlite3.connect(f"file:{os.fspath(path)}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT step, job, generation, world_size, status, reason, manifest_blake3 FROM saves"
        ).fetchall()
    finally:
        db.close()
    return {
        r[0]: dict(
            job=r[1], generation=r[2], world_size=r[3], status=r[4], reason=r[5], digest=r[6]
        )
        for r in rows
    }


def catalog_reports(path: str | os.PathLike[str], step: int) -> int:
    """How many shard reports of `step` the catalog holds durably (ranks, over its rows)."""
    return sum(catalog_report_rows(path, step))


def catalog_report_rows(path: str | os.PathLike[str], step: int) -> list[int]:
    """The catalog's report rows of `step`: how many ranks each holds."""
    db = sqlite3.connect(f"file:{os.fspath(path)}?mode=ro", uri=True)
    try:
        old = db.execute("SELECT COUNT(*) FROM reports WHERE step=?", (step,)).fetchone()[0]
        rows = db.execute("SELECT reports FROM batch_reports WHERE step=?", (step,)).fetchall()
    finally:
        db.close()
    return [1] * int(old) + [len(json.loads(r)) for (r,) in rows]


def step_files(job: str | os.PathLike[str], step: int) -> list[str]:
    d = Path(job) / f"step-{step:012d}"
    if not d.exists():
        return []
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def ckptctl(*args: str) -> tuple[int, str, str]:
    """ckptctl's main() in this process: (exit code, stdout, stderr)."""
    from ckptd.cli import ckptctl as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def ckptctl_json(*args: str) -> Any:
    rc, out, err = ckptctl(*args, "--json")
    assert rc == 0, f"ckptctl {' '.join(args)} failed ({rc}): {out}{err}"
    return json.loads(out)


def ckptctl_proc(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The real console script, in a subprocess."""
    p = subprocess.run(
        [str(BIN / "ckptctl"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or child_env(),
        cwd=REPO,
    )
    return p.returncode, p.stdout, p.stderr


def shard_index_keys(job: str | os.PathLike[str], step: int) -> dict[int, list[tuple]]:
    """{rank: [(key, chunk_offsets, chunk_sizes), ...]} from the shard indexes of a committed step."""
    d = Path(job) / f"step-{step:012d}"
    with open(d / "MANIFEST.json", "rb") as f:
        m = json.load(f)
    out: dict[int, list[tuple]] = {}
    for sh in m["shards"]:
        with open(d / sh["index"], "rb") as f:
            idx = json.load(f)
        out[sh["rank"]] = [
            (e["key"], tuple(e["chunk_offsets"]), tuple(e["chunk_sizes"])) for e in idx["entries"]
        ]
    return out


# ----------------------------------------------------------------------------- core driving


def run(coro: Any, timeout: float = 60) -> Any:
    """Run a coroutine on a fresh loop (the core needs a running loop)."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def new_core(
    root: str | os.PathLike[str], catalog: str | os.PathLike[str] | None = None, **kw: Any
) -> Coordinator:
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    cat = Catalog(os.fspath(catalog) if catalog else os.path.join(root, ".ckptd", "catalog.sqlite"))
    return Coordinator(root, cat, **kw)


@contextlib.asynccontextmanager
async def started(core: Coordinator) -> Any:
    await core.start()
    try:
        yield core
    finally:
        await core.close()
        core.catalog.close()


class RankSim:
    """One rank's side of a save, against the core directly (what Checkpointer.save does)."""

    def __init__(self, core: Coordinator, job: str, rank: int, world: int, generation: int = 0):
        self.core, self.job, self.rank, self.world, self.generation = (
            core,
            job,
            rank,
            world,
            generation,
        )
        self.items: list[WriteItem] = []
        self.digests: list[list[str]] = []
        self.plan: list[ChunkPlan] = []
        self.node: Any = None
        self.begun: BeginResult | None = None
        self.storage = open_storage(job, create=True)

    def ref(self, step: int) -> SaveRef:
        return SaveRef(self.job, step, self.generation, self.rank, self.world)

    def prepare(
        self, state: Any, boxes: dict[str, tuple[list[int], list[int], list[int]]] | None = None
    ) -> list[ChunkPlan]:
        """Flatten and hash; `boxes` makes a key a chunk (global shape, offsets, sizes)."""
        self.node, leaves = flatten(state, rank=self.rank)
        self.items = []
        for leaf in leaves:
            shape, offs, sizes = leaf.shape, leaf.chunk_offsets, leaf.chunk_sizes
            if boxes and leaf.key in boxes:
                shape, offs, sizes = boxes[leaf.key]
            self.items.append(
                WriteItem(leaf.key, leaf.dtype, list(shape), list(offs), list(sizes), leaf.data)
            )
        self.digests = hash_items(self.items)
        self.plan = ChunkPlan.of_items(self.items, self.digests)
        return self.plan

    async def begin(self, step: int, **kw: Any) -> BeginResult:
        kw.setdefault("state", self.node)
        self.begun = await self.core.begin_save(self.ref(step), self.plan, **kw)
        return self.begun

    def write_blocking(self, step: int, verify: str = "full") -> ShardReport:
        assert self.begun is not None
        info = write_shard(
            self.storage,
            job=self.job,
            step=step,
            rank=self.rank,
            world_size=self.world,
            generation=self.generation,
            items=[self.items[i] for i in self.begun.write],
            verify=verify,
            digests=[self.digests[i] for i in self.begun.write],
        )
        return ShardReport(
            info.path, info.size, info.index, info.index_size, info.index_blake3, verify
        )

    async def write(self, step: int) -> ShardReport:
        return await asyncio.to_thread(self.write_blocking, step)

    async def report(self, step: int, report: ShardReport) -> StatusResult:
        return await self.core.report_shard(self.ref(step), report)

    async def save(self, step: int, state: Any = None, **kw: Any) -> StatusResult:
        """The whole rank path; returns the final status (COMMITTED or ABORTED)."""
        if state is not None:
            self.prepare(state)
        await self.begin(step, **kw)
        rep = await self.write(step)
        st = await self.report(step, rep)
        if st.status == "ABORTED":
            return st
        return await self.core.await_commit(self.ref(step), 30)


# ----------------------------------------------------------------------------- servers


class ServerThread:
    """The real core + grpc.aio server on port 0, on an event loop in a daemon thread."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        options: Any = None,
        lease_s: float = 60.0,
        barrier_timeout_s: float = 600.0,
        host: str = "127.0.0.1",
        port: int = 0,  # a restarted coordinator takes its predecessor's port
        **core_kw: Any,  # more Coordinator arguments (storage_factory: a faulty storage)
    ):
        from ckptd.server import create_server

        self.root = os.fspath(root)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.core = new_core(
            self.root, lease_s=lease_s, barrier_timeout_s=barrier_timeout_s, **core_kw
        )

        async def start() -> tuple[Any, int]:
            await self.core.start()
            return await create_server(self.core, f"{host}:{port}", options)

        self.server, self.port = self.call(start())
        self.address = f"{host}:{self.port}"
        self._closed = False

    def call(self, coro: Any, timeout: float = 60) -> Any:
        fut: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def stop(self, grace: float | None = 1.0) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            await self.server.stop(grace)
            await self.core.close()
            self.core.catalog.close()

        try:
            self.call(stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


class Serve:
    """`ckptd serve` as a real subprocess (SIGKILL-able, restartable on the same port)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        workdir: str | os.PathLike[str],
        *,
        lease_s: float = 60.0,
        barrier_timeout_s: float = 600.0,
        extra_args: list[str] | None = None,
        token: str = TOKEN,
    ):
        self.root = Path(root)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.token_file = self.workdir / "token"
        self.token_file.write_text(token + "\n")
        self.lease_s, self.barrier_timeout_s = lease_s, barrier_timeout_s
        self.extra_args = extra_args or []
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives = 0
        self.catalog = self.root / ".ckptd" / "catalog.sqlite"

    @property
    def address(self) -> str:
        assert self.port is not None
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"serve-{self.lives}.log"

    def start(self, env: dict[str, str | None] | None = None, timeout: float = 60) -> Serve:
        assert self.proc is None or self.proc.poll() is not None
        self.lives += 1
        port_file = self.workdir / f"port-{self.lives}"
        listen = f"127.0.0.1:{self.port or 0}"
        cmd = [
            str(BIN / "ckptd"),
            "serve",
            "--root",
            str(self.root),
            "--create-root",  # a test's root is new on the first life
            "--listen",
            listen,
            "--token-file",
            str(self.token_file),
            "--port-file",
            str(port_file),
            "--lease",
            str(self.lease_s),
            "--barrier-timeout",
            str(self.barrier_timeout_s),
            *self.extra_args,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(**(env or {})),
                cwd=self.workdir,
            )

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"ckptd serve exited with {self.proc.returncode}:\n{self.log()}"
                )
            return port_file.exists()

        wait_for(ready, timeout, "ckptd serve to write its port file")
        self.port = int(port_file.read_text())
        return self

    def log(self) -> str:
        return "\n".join(
            f"--- serve life {i}\n" + (self.workdir / f"serve-{i}.log").read_text(errors="replace")
            for i in range(1, self.lives + 1)
            if (self.workdir / f"serve-{i}.log").exists()
        )

    def wait_dead(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> int | None:
        """SIGTERM (graceful); SIGKILL if it does not go."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def client(self) -> CoordinatorClient:
        return CoordinatorClient(self.address, token=self.token, retry_for_s=5, call_timeout_s=10)


@contextlib.contextmanager
def serving(root: Path, workdir: Path, **kw: Any) -> Iterator[Serve]:
    s = Serve(root, workdir, **kw)
    try:
        yield s
    finally:
        s.stop()


# ----------------------------------------------------------------------------- rank processes


class Rank:
    """tests/ranks/plain_rank.py as a real process: one rank against a coordinator service."""

    def __init__(self, proc: subprocess.Popen[bytes], out: Path, log: Path, rank: int):
        self.proc, self.out, self.log_path, self.rank = proc, out, log, rank

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(
                f"rank {self.rank} did not finish in {timeout}s:\n{self.log()}"
            ) from None

    def result(self) -> dict[str, Any]:
        if not self.out.exists():
            return {}
        with open(self.out) as f:
            return json.load(f)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_paused(self, n: int = 1, timeout: float = 60) -> None:
        """Until the rank stopped itself (SIGSTOP) for the n-th time."""
        marker = Path(str(self.out) + ".paused")

        def paused() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"rank {self.rank} exited ({self.proc.returncode}):\n{self.log()}"
                )
            return (
                marker.exists() and marker.read_text() == str(n) and process_state(self.pid) == "T"
            )

        wait_for(paused, timeout, f"rank {self.rank} to pause")

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def outcomes(self) -> list[str]:
        return [r["outcome"] for r in self.result().get("results", [])]

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


def start_rank(
    workdir: Path,
    spec: dict[str, Any],
    *,
    rank: int,
    world: int,
    address: str,
    attempt: str,
    token: str = TOKEN,
    env: dict[str, str | None] | None = None,
    tag: str = "",
) -> Rank:
    """Start one rank of a plain (no torch.distributed) job against a coordinator service."""
    name = f"rank{rank}{tag}"
    spec_path = workdir / f"{name}.spec.json"
    out = workdir / f"{name}.out.json"
    log = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    e = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "CKPTD_ADDRESS": address,
        "CKPTD_TOKEN": token,
        "CKPT_ATTEMPT": attempt,
        **(env or {}),
    }
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [PY, str(TESTS / "ranks" / "plain_rank.py"), str(spec_path), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=child_env(**e),
            cwd=workdir,
        )
    return Rank(proc, out, log, rank)


def process_state(pid: int) -> str:
    """The one-letter state of a process from /proc ('T' when stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


# ----------------------------------------------------------------------------- certificates


def make_certs(
    d: Path, server_names: str = "DNS:localhost,IP:127.0.0.1"
) -> dict[str, bytes] | None:
    """A CA, a server cert for `server_names` (subjectAltName) and a client cert, with openssl."""
    import shutil

    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ossl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=ckptd-test-ca",
    )
    (d / "server.ext").write_text(f"subjectAltName={server_names}\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client", "rogue"):
        ossl(
            "req",
            *ec,
            "-keyout",
            f"{who}.key",
            "-out",
            f"{who}.csr",
            "-subj",
            f"/CN={'localhost' if who == 'server' else who}",
        )
    for who in ("server", "client"):
        ossl(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{who}.pem",
            "-days",
            "2",
            "-extfile",
            f"{who}.ext",
        )
    # A client certificate that no trusted CA signed (self-signed).
    ossl(
        "x509",
        "-req",
        "-in",
        "rogue.csr",
        "-signkey",
        "rogue.key",
        "-out",
        "rogue.pem",
        "-days",
        "2",
        "-extfile",
        "client.ext",
    )
    return {p.name: p.read_bytes() for p in d.iterdir() if p.suffix in (".pem", ".key")}
