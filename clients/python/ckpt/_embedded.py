"""The zero-configuration coordinator: a real gRPC coordinator in a background thread.

With no address configured, the process that hosts it (the single process, or rank 0
under torchrun) runs `ckptd`'s coordinator core and server on an event loop in a daemon
thread, bound to 127.0.0.1 (single node) or all interfaces (several nodes), with a random
token. Other ranks learn the address and token through torch.distributed's store, which
is a key-value service, not a collective: a slow rank never blocks another's training.

The catalog lives where `JobLocation.catalog_path` says: `<job>/.ckptd/catalog.sqlite`
when the job directory is on a local filesystem, else (a network filesystem, or an object
store URL such as s3://bucket/job) under `$CKPTD_CATALOG_DIR` or
`~/.cache/ckptd/catalogs/<hash>/` (SQLite is not safe on NFS/Lustre, and cannot live in a
bucket). It can always be rebuilt from storage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import socket
import threading
from typing import Any

from ckptd.coordinator.catalog import Catalog
from ckptd.coordinator.core import Coordinator
from ckptd.server import ServerOptions, create_server
from ckptd.storage.local import makedirs_durable
from ckptd.storage.location import JobLocation


class EmbeddedCoordinator:
    """Coordinator + gRPC server on a private event loop thread."""

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
        if not self.location.is_url:  # an object store has no directories to make
            makedirs_durable(self.job_path)
        self.root = self.location.parent  # the coordinator serves the job's parent
        self.token = secrets.token_urlsafe(24)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="ckptd-embedded", daemon=True
        )
        self._thread.start()
        self._server: Any = None
        self.core: Coordinator | None = None
        self.port = self._run(self._start(host, lease_s, barrier_timeout_s))
        bind = "127.0.0.1" if host in ("127.0.0.1", "localhost") else _reachable_host()
        self.address = f"{bind}:{self.port}"

    def _run(self, coro: Any, timeout: float | None = 60) -> Any:
        fut: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    async def _start(self, host: str, lease_s: float, barrier_timeout_s: float) -> int:
        catalog = Catalog(self.location.catalog_path())
        self.core = Coordinator(
            self.root,
            catalog,
            lease_s=lease_s,
            barrier_timeout_s=barrier_timeout_s,
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
        try:
            self._run(self._stop(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()


def _reachable_host() -> str:

    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name
