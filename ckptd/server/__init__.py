"""The gRPC face of the coordinator: thin servicers, auth, health, create_server()."""

from ckptd.server.app import ServerOptions, create_server

__all__ = ["ServerOptions", "create_server"]
