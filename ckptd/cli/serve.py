"""`ckptd serve` runs the coordinator; `ckptd rebuild-catalog` recreates its catalog;
`ckptd agent` runs a node's memory agent (ckptd.cli.agent).

    ckptd serve --root /ckpts --listen 0.0.0.0:7070 [--create-root]
                [--catalog /var/lib/ckptd/catalog.sqlite | --catalog postgresql://U@H/DB]
                [--token-file F] [--tls-cert C --tls-key K [--tls-client-ca CA]]
                [--lease 60] [--barrier-timeout 600]
                [--metrics-port N [--metrics-host H] [--metrics-port-file F]]

Jobs outside --root are refused; a --root that does not exist is refused (a typo would be
served, empty) unless --create-root. One coordinator per catalog: a second `ckptd serve`
on the same catalog is refused while the first runs. The catalog defaults to <root>/.ckptd/catalog.sqlite and
must be on a local disk (SQLite is not safe on NFS/Lustre): pass --catalog elsewhere when
the root is a parallel filesystem. Usage errors exit 2, failures to start (a port in use, a
catalog held) 1, each with one `error:` line. SIGTERM/SIGINT stop it gracefully. A job, step or directory below the root that
cannot be read (unreadable, a symlink loop or a link out of the root, a corrupt
manifest) is logged with its path and skipped by the start-up scan, never fatal; the
metric ckptd_scan_skipped counts them and `ckptd rebuild-catalog` prints them. With --metrics-port,
Prometheus metrics are served at http://HOST:PORT/metrics (ckptd/server/metrics.py).

With --catalog postgresql://..., several `ckptd serve` (one root) share the catalog: one
leads, the others stand by answering UNAVAILABLE until PostgreSQL hands them the
leadership (ckptd/coordinator/catalog_pg.py, docs/coordinator.md); a leader that loses it
exits 1, to be restarted as a standby.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

from ckptd.cli import agent
from ckptd.coordinator.catalog import Catalog, CatalogLock
from ckptd.coordinator.catalog_sql import is_postgres_url
from ckptd.coordinator.core import Coordinator
from ckptd.errors import CkptError
from ckptd.server import ServerOptions, collector, create_server
from ckptd.server.app import create_standby_server
from ckptd.server.auth import load_token
from ckptd.server.metrics import Metrics, MetricsServer
from ckptd.storage.local import makedirs_durable
from ckptd.storage.location import JobLocation

log = logging.getLogger("ckptd")

# A standby asks PostgreSQL for the leadership lock in waits of this long (it is granted
# the moment the leader's session ends; the bound only lets a standby notice SIGTERM).
STANDBY_POLL_S = 1.0
# How often a leader on PostgreSQL proves it still holds the lock (at most a quarter lease).
HEARTBEAT_S = 2.0


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptd", description="The ckptd checkpoint coordinator.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("serve", help="run the coordinator")
    s.add_argument("--root", required=True, help="checkpoint root; every job lives under it")
    s.add_argument("--create-root", action="store_true", help="create --root if it does not exist")
    s.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT (port 0 picks one)")
    s.add_argument(
        "--catalog",
        help="catalog file (default <root>/.ckptd/catalog.sqlite), or postgresql://USER@HOST/DB "
        "(a leader and standbys share it)",
    )
    s.add_argument(
        "--allow-network-catalog", action="store_true", help="allow the catalog on NFS/Lustre"
    )
    s.add_argument("--token-file", help="shared secret clients must send (else $CKPTD_TOKEN)")
    s.add_argument(
        "--insecure-no-token", action="store_true", help="accept clients without a token"
    )
    s.add_argument("--tls-cert")
    s.add_argument("--tls-key")
    s.add_argument(
        "--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)"
    )
    s.add_argument(
        "--lease", type=float, default=60.0, help="seconds a writing rank may stay silent"
    )
    s.add_argument(
        "--barrier-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for all ranks to join a save",
    )
    s.add_argument(
        "--max-calls-per-client",
        type=int,
        default=ServerOptions.max_calls_per_client,
        help="calls one client connection may have in flight; more are refused",
    )
    s.add_argument("--port-file", help="write the bound port here once serving")
    s.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve Prometheus metrics at http://HOST:N/metrics (0 picks a free port)",
    )
    s.add_argument(
        "--metrics-host",
        help="address the metrics endpoint binds (default: the host of --listen)",
    )
    s.add_argument("--metrics-port-file", help="write the metrics port here once serving")
    agent.add_parser(sub)
    r = sub.add_parser("rebuild-catalog", help="recreate the catalog from the manifests in storage")
    r.add_argument("--root", required=True)
    r.add_argument("--catalog")
    r.add_argument("--allow-network-catalog", action="store_true")
    return p


def _catalog_path(args: argparse.Namespace) -> str:
    return args.catalog or JobLocation.of(args.root).catalog_beside


async def serve(args: argparse.Namespace) -> int:
    token = load_token(args.token_file)
    if token is None and not args.insecure_no_token:
        print(
            "error: no token: pass --token-file F or set CKPTD_TOKEN (or --insecure-no-token "
            "on a trusted network)",
            file=sys.stderr,
        )
        return 2
    if bool(args.tls_cert) != bool(args.tls_key):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        print(f"error: --metrics-port {args.metrics_port} is not a port (0-65535)", file=sys.stderr)
        return 2
    listen_error = _check_listen(args.listen)
    if listen_error:
        print(f"error: --listen {args.listen!r}: {listen_error}", file=sys.stderr)
        return 2
    root = JobLocation.of(args.root)
    if not root.is_url and not os.path.isdir(root.path):
        if os.path.exists(root.path) or not args.create_root:
            what = "is not a directory" if os.path.exists(root.path) else "does not exist"
            print(
                f"error: --root {root.path} {what}; check the path, or pass --create-root "
                "to serve a new, empty root",
                file=sys.stderr,
            )
            return 2
        makedirs_durable(root.path)
    if is_postgres_url(args.catalog or ""):
        return await _serve_postgres(args, token, root.path)
    lock = CatalogLock(
        _catalog_path(args),
        what=f"the catalog of root {root.path}",
        advice="Stop the other `ckptd serve`, or give this one its own --catalog and --root",
    )
    try:
        catalog = Catalog(_catalog_path(args), allow_network_fs=args.allow_network_catalog)
        return await _run(args, token, catalog, args.listen, _stop_event())
    finally:
        lock.release()


def _check_listen(listen: str) -> str:
    """Why `listen` is not HOST:PORT ('' when it is)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host:
        return "expected HOST:PORT (e.g. 127.0.0.1:7070, 0.0.0.0:7070, [::]:7070)"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        return f"{port!r} is not a port (0-65535; 0 picks a free one)"
    return ""


def _stop_event() -> asyncio.Event:
    """Set by SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _options(args: argparse.Namespace, token: str | None) -> ServerOptions:
    return ServerOptions(
        token=token,
        tls_cert=_read(args.tls_cert),
        tls_key=_read(args.tls_key),
        tls_client_ca=_read(args.tls_client_ca),
        max_calls_per_client=args.max_calls_per_client,
    )


def _cannot_listen(args: argparse.Namespace, e: BaseException) -> int:
    print(
        f"error: cannot listen on {args.listen}: {e}; is another server using the port? "
        "pick another --listen port (0 picks a free one)",
        file=sys.stderr,
    )
    return 1


async def _serve_postgres(args: argparse.Namespace, token: str | None, root: str) -> int:
    """Stand by on a PostgreSQL catalog until this process leads, then serve (catalog_pg).

    While standing by, the address answers every call UNAVAILABLE, naming the leader; once
    PostgreSQL grants the leadership lock, the catalog is prepared, saves a previous leader
    left in flight are finished or aborted (recovery, as after a restart), and the real
    server takes the same address. A leader that loses its session exits (1)."""
    try:
        # Imported here: psycopg is the optional `postgres` extra, needed for this catalog only.
        from ckptd.coordinator import catalog_pg
    except ImportError as e:
        print(
            f"error: --catalog {args.catalog.split('@')[-1]} is a PostgreSQL catalog, which "
            f"needs psycopg 3 ({e}): pip install 'ckptd[postgres]'",
            file=sys.stderr,
        )
        return 1
    backend = catalog_pg.PostgresBackend(
        args.catalog, root=root, lease_s=args.lease, address=args.listen
    )
    stop = _stop_event()
    state = {"phase": "standing by"}

    def why() -> str:
        leader = backend.leader() if state["phase"] == "standing by" else None
        who = (
            f"the leader is pid {leader.get('pid')} on {leader.get('host')} (--listen "
            f"{leader.get('address')})"
            if leader
            else "no leader has written its name yet"
        )
        return (
            f"this ckptd serve ({backend.address}) is {state['phase']} on the catalog "
            f"{backend.where}; {who}. Give clients every coordinator's address "
            "(CKPTD_ADDRESS=host1:port,host2:port): they move to the leader on their own"
        )

    options = _options(args, token)
    try:
        standby, port = await create_standby_server(args.listen, options, why)
    except RuntimeError as e:  # grpc's "Failed to bind to address ..."
        backend.close()
        return _cannot_listen(args, e)
    host = args.listen.rsplit(":", 1)[0]
    backend.address = f"{host}:{port}"  # what the leader's row will say, once it leads
    log.info("standing by on %s:%d for the catalog %s", host, port, backend.where)
    print(f"ckptd: standing by on {host}:{port} (catalog {backend.where})", flush=True)
    if args.port_file:
        _write_atomically(args.port_file, str(port))
    try:
        while not stop.is_set():
            if await asyncio.to_thread(backend.try_lead, STANDBY_POLL_S):
                break
        if stop.is_set():
            await standby.stop(0)
            backend.close()
            return 0
        state["phase"] = "taking over"
        log.info("leading on the catalog %s: preparing it and recovering saves", backend.where)
        await asyncio.to_thread(backend.migrate)
    except BaseException:
        await standby.stop(0)
        backend.close()
        raise
    lost: list[str] = []
    loop = asyncio.get_running_loop()

    def on_lost(reason: str) -> None:
        lost.append(reason)
        loop.call_soon_threadsafe(stop.set)

    backend.on_lost = on_lost
    # From the first moment it leads (recovery can take a while): PostgreSQL ends an idle
    # leader's session (catalog_pg), and a leader that cannot prove itself stops.
    beat = loop.create_task(_beat(backend.beat, args.lease, stop, lost))
    try:
        rc = await _run(
            args,
            token,
            Catalog(backend),
            f"{host}:{port}",
            stop,
            before_listen=lambda: standby.stop(None),
        )
    finally:
        beat.cancel()
    if lost:
        print(
            f"error: this ckptd serve lost the leadership of the catalog {backend.where} "
            f"({lost[0]}); it exits so that a standby leads (saves in flight are finished or "
            "aborted by the new leader). Start it again to stand by",
            file=sys.stderr,
        )
        return 1
    return rc


async def _run(
    args: argparse.Namespace,
    token: str | None,
    catalog: Catalog,
    listen: str,
    stop: asyncio.Event,
    *,
    before_listen: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Serve `catalog` on `listen` until `stop`: recovery, metrics, the server, shutdown.
    `before_listen` frees the address first (a standby's server)."""
    core = Coordinator(
        args.root, catalog, lease_s=args.lease, barrier_timeout_s=args.barrier_timeout
    )
    try:
        await core.start()
    except BaseException:
        if before_listen is not None:
            await before_listen()
        catalog.close()
        raise
    if core.skipped_count:
        log.warning(
            "%d job(s), step(s) or directories under %s could not be read and are not "
            "listed (each logged above; metric ckptd_scan_skipped); every other job is served",
            core.skipped_count,
            core.root,
        )
    metrics_server = None
    if args.metrics_port is not None:
        metrics_host = args.metrics_host or args.listen.rsplit(":", 1)[0].strip("[]")
        try:
            metrics_server = MetricsServer(Metrics().attach(core), metrics_host, args.metrics_port)
        except OSError as e:
            await core.close()
            catalog.close()
            print(
                f"error: cannot serve metrics on {metrics_host}:{args.metrics_port}: {e}; "
                "pick another --metrics-port (0 picks a free one) or --metrics-host",
                file=sys.stderr,
            )
            return 1
        log.info("metrics at %s", metrics_server.url)
        print(f"ckptd: metrics on {metrics_host}:{metrics_server.port} (/metrics)", flush=True)
        if args.metrics_port_file:
            _write_atomically(args.metrics_port_file, str(metrics_server.port))
    if before_listen is not None:
        await before_listen()
    try:
        server, port = await create_server(core, listen, _options(args, token))
    except RuntimeError as e:  # grpc's "Failed to bind to address ..."
        await core.close()
        catalog.close()
        if metrics_server is not None:
            metrics_server.close()
        return _cannot_listen(args, e)
    host = listen.rsplit(":", 1)[0]
    log.info("ckptd serving %s on %s:%d (catalog %s)", core.root, host, port, catalog.path)
    print(f"ckptd: serving {core.root} on {host}:{port}", flush=True)
    if args.port_file:
        _write_atomically(args.port_file, str(port))
    pacer = asyncio.get_running_loop().create_task(collector.pace(core))
    await stop.wait()
    log.info("stopping: finishing in-flight calls")
    await server.stop(grace=10)
    pacer.cancel()
    await core.close()
    catalog.close()
    if metrics_server is not None:
        metrics_server.close()
    return 0


async def _beat(
    heartbeat: Callable[[], None], lease_s: float, stop: asyncio.Event, lost: list[str]
) -> None:
    """Prove the leadership every HEARTBEAT_S (at most a quarter lease); a proof that
    fails, or does not come within half the lease, stops the service (a standby may lead
    by then)."""
    while not stop.is_set():
        await asyncio.sleep(min(HEARTBEAT_S, lease_s / 4))
        try:
            await asyncio.wait_for(asyncio.to_thread(heartbeat), lease_s / 2)
        except (CkptError, TimeoutError) as e:
            why = str(e) or f"the catalog did not answer within {lease_s / 2:.0f} s"
            log.error("leadership lost: %s", why)
            lost.append(why)
            stop.set()
            return


def _write_atomically(path: str, text: str) -> None:
    """A reader polling for the file never sees it half written."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def rebuild(args: argparse.Namespace) -> int:
    path = _catalog_path(args)
    if is_postgres_url(path):
        return _rebuild_postgres(args, path)
    lock = CatalogLock(
        path,
        what=f"the catalog of root {JobLocation.of(args.root).path}",
        advice="Stop the `ckptd serve` using it before rebuilding its catalog",
    )
    try:
        return _rebuild_locked(args, path)
    finally:
        lock.release()


def _rebuild_locked(args: argparse.Namespace, path: str) -> int:
    if os.path.exists(path):
        os.replace(path, path + ".old")
        for ext in ("-wal", "-shm"):
            if os.path.exists(path + ext):
                os.remove(path + ext)
    catalog = Catalog(path, allow_network_fs=args.allow_network_catalog)
    core = Coordinator(args.root, catalog)
    n = core.rebuild_from_storage()
    catalog.close()
    print(f"rebuilt {path}: {n} committed checkpoint(s) found under {core.root}")
    for skipped in core.skipped:
        print(f"skipped {skipped.path}: {skipped.reason}; {skipped.advice}")
    if core.skipped_count > len(core.skipped):
        print(f"... and {core.skipped_count - len(core.skipped)} more (see the log)")
    return 0


def _rebuild_postgres(args: argparse.Namespace, url: str) -> int:
    """rebuild-catalog on a PostgreSQL catalog: only while no `ckptd serve` leads on it
    (this process takes the leadership lock, so none can start meanwhile)."""
    # Imported here: psycopg is the optional `postgres` extra, needed for this catalog only.
    from ckptd.coordinator import catalog_pg

    root = JobLocation.of(args.root).path
    backend = catalog_pg.PostgresBackend(url, root=root)
    if not backend.try_lead(0.5):
        leader = backend.leader() or {}
        backend.close()
        print(
            f"error: a ckptd serve leads on the catalog {backend.where} (pid "
            f"{leader.get('pid', '?')} on {leader.get('host', '?')}): stop every ckptd serve "
            "on it (the standbys too) before rebuilding it",
            file=sys.stderr,
        )
        return 1
    try:
        backend.reset()
        backend.migrate()
    except BaseException:
        backend.close()
        raise
    catalog = Catalog(backend)
    try:
        core = Coordinator(args.root, catalog)
        n = core.rebuild_from_storage()
    finally:
        catalog.close()
    print(f"rebuilt {backend.where}: {n} committed checkpoint(s) found under {core.root}")
    for skipped in core.skipped:
        print(f"skipped {skipped.path}: {skipped.reason}; {skipped.advice}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            collector.set_young(collector.GC_YOUNG)  # from the start: the catalog loads
            return asyncio.run(serve(args))
        if args.command == "agent":
            return agent.run(args)
        return rebuild(args)
    except CkptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
