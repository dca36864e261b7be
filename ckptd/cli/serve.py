"""`ckptd serve` runs the coordinator; `ckptd rebuild-catalog` recreates its catalog.

    ckptd serve --root /ckpts --listen 0.0.0.0:7070 [--catalog /var/lib/ckptd/catalog.sqlite]
                [--token-file F] [--tls-cert C --tls-key K [--tls-client-ca CA]]
                [--lease 60] [--barrier-timeout 600]
                [--metrics-port N [--metrics-host H] [--metrics-port-file F]]

Jobs outside --root are refused. The catalog defaults to <root>/.ckptd/catalog.sqlite and
must be on a local disk (SQLite is not safe on NFS/Lustre): pass --catalog elsewhere when
the root is a parallel filesystem. SIGTERM/SIGINT stop it gracefully. With --metrics-port,
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

from ckptd.coordinator.catalog import Catalog
from ckptd.coordinator.core import Coordinator
from ckptd.errors import CkptError
from ckptd.server import ServerOptions, create_server
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
    makedirs_durable(args.root)
    catalog = Catalog(_catalog_path(args), allow_network_fs=args.allow_network_catalog)
    core = Coordinator(
        args.root, catalog, lease_s=args.lease, barrier_timeout_s=args.barrier_timeout
    )
    await core.start()
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
    server, port = await create_server(core, args.listen, options)
    host = args.listen.rsplit(":", 1)[0]
    log.info("ckptd serving %s on %s:%d (catalog %s)", core.root, host, port, catalog.path)
    print(f"ckptd: serving {core.root} on {host}:{port}", flush=True)
    if args.port_file:
        _write_atomically(args.port_file, str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: finishing in-flight calls")
    await server.stop(grace=10)
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
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return asyncio.run(serve(args))
        return rebuild(args)
    except CkptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
