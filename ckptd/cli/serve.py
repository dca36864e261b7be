"""`ckptd serve` runs the coordinator; `ckptd rebuild-catalog` recreates its catalog;
`ckptd agent` runs a node's memory agent (ckptd.cli.agent).

    ckptd serve --root /ckpts --listen 0.0.0.0:7070 [--create-root]
                [--catalog /var/lib/ckptd/catalog.sqlite]
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
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from ckptd.cli import agent
from ckptd.coordinator.catalog import Catalog, CatalogLock
from ckptd.coordinator.core import Coordinator
from ckptd.errors import CkptError
from ckptd.server import ServerOptions, collector, create_server
from ckptd.server.auth import load_token
from ckptd.server.metrics import Metrics, MetricsServer
from ckptd.storage.local import makedirs_durable
from ckptd.storage.location import JobLocation

log = logging.getLogger("ckptd")


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
    s.add_argument("--catalog", help="catalog file (default <root>/.ckptd/catalog.sqlite)")
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
    lock = CatalogLock(
        _catalog_path(args),
        what=f"the catalog of root {root.path}",
        advice="Stop the other `ckptd serve`, or give this one its own --catalog and --root",
    )
    try:
        return await _serve_locked(args, token)
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


async def _serve_locked(args: argparse.Namespace, token: str | None) -> int:
    catalog = Catalog(_catalog_path(args), allow_network_fs=args.allow_network_catalog)
    core = Coordinator(
        args.root, catalog, lease_s=args.lease, barrier_timeout_s=args.barrier_timeout
    )
    await core.start()
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
    options = ServerOptions(
        token=token,
        tls_cert=_read(args.tls_cert),
        tls_key=_read(args.tls_key),
        tls_client_ca=_read(args.tls_client_ca),
        max_calls_per_client=args.max_calls_per_client,
    )
    try:
        server, port = await create_server(core, args.listen, options)
    except RuntimeError as e:  # grpc's "Failed to bind to address ..."
        await core.close()
        catalog.close()
        if metrics_server is not None:
            metrics_server.close()
        print(
            f"error: cannot listen on {args.listen}: {e}; is another server using the port? "
            "pick another --listen port (0 picks a free one)",
            file=sys.stderr,
        )
        return 1
    host = args.listen.rsplit(":", 1)[0]
    log.info("ckptd serving %s on %s:%d (catalog %s)", core.root, host, port, catalog.path)
    print(f"ckptd: serving {core.root} on {host}:{port}", flush=True)
    if args.port_file:
        _write_atomically(args.port_file, str(port))
    pacer = asyncio.get_running_loop().create_task(collector.pace(core))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: finishing in-flight calls")
    await server.stop(grace=10)
    pacer.cancel()
    await core.close()
    catalog.close()
    if metrics_server is not None:
        metrics_server.close()
    return 0


def _write_atomically(path: str, text: str) -> None:
    """A reader polling for the file never sees it half written."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def rebuild(args: argparse.Namespace) -> int:
    path = _catalog_path(args)
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
