"""The coordinator options (--coordinator, --token, TLS) and the client they make: the same
on every ckptctl command that asks a coordinator (list, verify)."""

from __future__ import annotations

import argparse
import os

from ckptd.cli.ctl.output import UsageError
from ckptd.server.client import CoordinatorClient


def add_coordinator_options(sp: argparse.ArgumentParser, what: str) -> None:
    """--coordinator and the connection options, the same on every command that asks one."""
    sp.add_argument("--coordinator", metavar="ADDR", help=what)
    sp.add_argument("--token", help="coordinator token (default $CKPTD_TOKEN)")
    sp.add_argument("--tls-root-cert", metavar="PEM", help="CA of a TLS coordinator")
    sp.add_argument(
        "--tls-client-cert",
        metavar="PEM",
        help="client certificate, for a coordinator that requires mutual TLS (with --tls-client-key)",
    )
    sp.add_argument("--tls-client-key", metavar="PEM", help="the client certificate's key")


def coordinator_client(args: argparse.Namespace) -> CoordinatorClient:
    """The client of `args.coordinator`, from the options add_coordinator_options added.

    A person waits at the terminal: a coordinator that is down or mistyped is reported
    within a few seconds, not after the training client's retries.
    """
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise UsageError("--tls-client-cert and --tls-client-key go together (mutual TLS)")
    key, cert = _read_file(args.tls_client_key), _read_file(args.tls_client_cert)
    return CoordinatorClient(
        args.coordinator,
        token=args.token or os.environ.get("CKPTD_TOKEN"),
        root_certificates=_read_file(args.tls_root_cert),
        client_cert=(key, cert) if key is not None and cert is not None else None,
        retry_for_s=10,
        connect_retry_s=2,
    )


def _read_file(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
