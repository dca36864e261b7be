"""The zero-configuration coordinator: a real gRPC coordinator in a background thread.

With no address configured, the process that hosts it (the single process, or rank 0
under torchrun) runs `ckptd`'s coordinator core and server on an event loop in a daemon
thread, bound to 127.0.0.1 (single node) or all interfaces (several nodes), with a random
token. Other ranks learn the address and token through torch.distributed's store, which
is a key-value service, not a collective: a slow rank never blocks another's training.
Across nodes it advertises the address this host reaches the job's store ($MASTER_ADDR)
from: every rank reaches that network already, which the host name's address (often one
of a management network, or 127.0.1.1 from /etc/hosts) need not be.

The catalog lives where `JobLocation.catalog_path` says: `<job>/.ckptd/catalog.sqlite`
when the job directory is on a local, writable filesystem, else (a network filesystem, a
read-only mount, or an object store URL such as s3://bucket/job) under
`$CKPTD_CATALOG_DIR` or `~/.cache/ckptd/catalogs/<hash>/` (SQLite is not safe on
NFS/Lustre, and cannot live in a bucket). It is the job's alone, and can always be
rebuilt from storage: from the job's own directory, never its neighbours' (the coordinator
is rooted at the job's parent, which names the job, but scoped to the job).

Metrics: with $CKPTD_METRICS_PORT set (0 picks a free port), the hosting process serves
the coordinator's Prometheus metrics at http://HOST:PORT/metrics, the same registry and
endpoint as `ckptd serve --metrics-port` (ckptd.server.metrics), bound to the coordinator's
own host unless $CKPTD_METRICS_HOST says otherwise; $CKPTD_METRICS_PORT_FILE receives the
port once serving (for port 0). A torchrun job is observable without a service.

One coordinator per job and host: each holds its catalog's `CatalogLock` for its life, so
a second process opening the job gets `JobInUse` (the kernel drops the lock of a killed
process). Within one process, every `EmbeddedCoordinator(job)` is a handle on one shared
coordinator per job (the module-level `ckpt.save` while a Checkpointer is open, a DCP
writer and a Checkpointer): the process behaves as one client of one coordinator, as it
would against `ckptd serve`, where each Checkpointer is its own attempt and the newest
fences the older. The last handle closed stops it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import socket
import threading
from typing import Any

from ckptd.coordinator.catalog import Catalog, CatalogLock
from ckptd.coordinator.core import Coordinator
from ckptd.errors import CkptError
from ckptd.server import ServerOptions, create_server
from ckptd.server.metrics import Metrics, MetricsServer
from ckptd.storage import open_storage
from ckptd.storage.location import JobLocation

log = logging.getLogger("ckpt")


class _Hosted:
    """Coordinator + gRPC server on a private event loop thread, holding the catalog lock."""

    def __init__(
        self, location: JobLocation, *, host: str, lease_s: float, barrier_timeout_s: float
    ):
        self.location = location
        # Refuses a path that is a file, an unknown URL scheme, an unwritable parent, before
        # anything is started; makes the job's directory (an object store has none to make).
        open_storage(location, create=not location.read_only)
        catalog_path = location.catalog_path()
        self.lock = CatalogLock(
            catalog_path,
            what=f"job {location.path}",
            advice=(
                "Two coordinators over one job would abort each other's saves: close the "
                "other process's Checkpointer (or let it finish), or run one `ckptd serve` "
                "and point every process at it (CKPTD_ADDRESS)"
            ),
        )
        if location.read_only:
            log.info(
                "job %s is on a read-only filesystem: its catalog is kept at %s; load and "
                "resume work, saves will fail",
                location.path,
                catalog_path,
            )
        self.users = 0
        self.token = secrets.token_urlsafe(24)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="ckptd-embedded", daemon=True
        )
        self._thread.start()
        self._server: Any = None
        self.core: Coordinator | None = None
        self.metrics: MetricsServer | None = None
        try:
            self.port = self._run(self._start(catalog_path, host, lease_s, barrier_timeout_s))
            self.metrics = _serve_metrics(self.core, host, location.path)
        except BaseException:
            self.close()
            raise
        bind = "127.0.0.1" if host in ("127.0.0.1", "localhost") else _reachable_host()
        self.address = f"{bind}:{self.port}"

    def _run(self, coro: Any, timeout: float | None = 60) -> Any:
        fut: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    async def _start(
        self, catalog_path: str, host: str, lease_s: float, barrier_timeout_s: float
    ) -> int:
        catalog = Catalog(catalog_path)
        # Rooted at the job's parent (memory://job's is memory://), so that the job keeps
        # the name its catalog has always filed it under, and scoped to the job: its catalog
        # is the job's own, so it rebuilds from the job's directory alone and refuses any
        # other (a neighbour's steps are not this job's; promise 6).
        self.core = Coordinator(
            self.location.parent,
            catalog,
            lease_s=lease_s,
            barrier_timeout_s=barrier_timeout_s,
            job=self.location.path,
        )
        await self.core.start()
        self._server, port = await create_server(
            self.core, f"{host}:0", ServerOptions(token=self.token)
        )
        return int(port)

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=2)
        if self.core is not None:
            await self.core.close()
            self.core.catalog.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        try:
            self._run(self._stop(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            self.lock.release()  # only once the catalog is closed


_lock = threading.Lock()
_hosted: dict[str, _Hosted] = {}


class EmbeddedCoordinator:
    """A handle on this process's embedded coordinator of job `job_path` (module docstring):
    the first handle starts it (with its host, lease and barrier timeout), the last one
    closed stops it."""

    def __init__(
        self,
        job_path: str,
        *,
        host: str = "127.0.0.1",
        lease_s: float = 60.0,
        barrier_timeout_s: float = 600.0,
    ):
        self.location = JobLocation.of(job_path)
        self.job_path = self.location.path
        with _lock:  # held while starting: a second handle must not start a second one
            hosted = _hosted.get(self.job_path)
            if hosted is None:
                hosted = _Hosted(
                    self.location, host=host, lease_s=lease_s, barrier_timeout_s=barrier_timeout_s
                )
                _hosted[self.job_path] = hosted
            hosted.users += 1
        self._hosted: _Hosted | None = hosted
        self.root = self.location.parent
        self.token, self.port, self.address = hosted.token, hosted.port, hosted.address
        self.core = hosted.core
        # http://HOST:PORT/metrics with $CKPTD_METRICS_PORT set, else None
        self.metrics_url = hosted.metrics.url if hosted.metrics is not None else None

    def close(self) -> None:
        # Stopped under the lock: a handle opened meanwhile must not start a second
        # coordinator while this one still holds the catalog's lock.
        with _lock:
            hosted, self._hosted = self._hosted, None
            if hosted is None:
                return
            hosted.users -= 1
            if hosted.users == 0:
                del _hosted[self.job_path]
                hosted.close()


def _serve_metrics(core: Coordinator | None, host: str, job: str) -> MetricsServer | None:
    """The metrics endpoint $CKPTD_METRICS_PORT asks for (module docstring), or None."""
    raw = os.environ.get("CKPTD_METRICS_PORT", "")
    if raw == "" or core is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        raise ValueError(
            f"environment variable CKPTD_METRICS_PORT={raw!r} is not a port (0-65535; 0 "
            "picks a free one)"
        )
    metrics_host = os.environ.get("CKPTD_METRICS_HOST") or host
    try:
        server = MetricsServer(Metrics().attach(core), metrics_host, port)
    except OSError as e:
        raise CkptError(
            f"job {job}: the embedded coordinator cannot serve metrics on "
            f"{metrics_host}:{port} (CKPTD_METRICS_PORT): {e}; pick another port (0 picks a "
            "free one, with CKPTD_METRICS_PORT_FILE to learn it) or unset it"
        ) from None
    port_file = os.environ.get("CKPTD_METRICS_PORT_FILE")
    if port_file:
        tmp = f"{port_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(str(server.port))
        os.replace(tmp, port_file)  # a reader never sees half a port number
    log.info("job %s: the embedded coordinator serves metrics at %s", job, server.url)
    return server


def _reachable_host() -> str:
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                # A datagram socket's connect sends nothing: the kernel only picks the route,
                # and with it the source address the other nodes see this host by.
                probe.connect(sockaddr)
                addr = str(probe.getsockname()[0])
            if addr and not addr.startswith("127.") and addr != "::1":
                return f"[{addr}]" if family == socket.AF_INET6 else addr
        except OSError:
            pass  # MASTER_ADDR does not resolve or route here: fall back to the host name
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name
