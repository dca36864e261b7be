"""The catalog in SQLite (WAL, synchronous=FULL) on a local disk: the embedded default.

Two connections: writes (and their fsyncs) run on the catalog's writer thread against
one, reads run on the event loop against the other (WAL lets them proceed). SQLite's
locking is not safe on NFS/Lustre/other network filesystems, so opening a catalog there
is refused unless explicitly allowed. One coordinator per catalog file is enforced by
`catalog.CatalogLock`, taken by whoever opens it.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from typing import Any

from ckptd.coordinator.catalog_sql import (
    BATCH_REPORTS_SCHEMA,
    PARENT_COLUMN,
    RETIRING_SCHEMA,
    SCHEMA,
    SCHEMA_VERSION,
    TIERS_SCHEMA,
    CatalogError,
    InsertIgnore,
    Replace,
    Sql,
    Statement,
)
from ckptd.storage.location import NETWORK_FS, filesystem_type


def migrate(db: sqlite3.Connection) -> None:
    """Bring a catalog to SCHEMA_VERSION; additive only, so older readers still work."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version < 2:
        db.executescript(TIERS_SCHEMA)
    if version < 3:
        db.executescript(RETIRING_SCHEMA)
    if version < 4:
        columns = {row[1] for row in db.execute("PRAGMA table_info(saves)")}
        if "parent" not in columns:
            db.execute(PARENT_COLUMN)
    if version < 5:
        db.executescript(BATCH_REPORTS_SCHEMA)
    if version < SCHEMA_VERSION:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def check_local(path: str) -> None:
    d = path if os.path.isdir(path) else os.path.dirname(path) or "."
    fstype = filesystem_type(d)
    if fstype in NETWORK_FS:
        raise CatalogError(
            f"the catalog {path} would live on a {fstype} filesystem; SQLite's locking and WAL "
            "are not safe there. Put it on a local disk (ckptd serve --catalog /local/path, or "
            "CKPTD_CATALOG_DIR for the embedded coordinator), keep it in PostgreSQL (ckptd "
            "serve --catalog postgresql://...), or pass --allow-network-catalog if only one "
            "coordinator will ever open it"
        )


def render(st: Statement) -> tuple[str, tuple[Any, ...]]:
    """A statement in SQLite's own spelling."""
    if isinstance(st, Sql):
        return st.sql, st.args
    cols = ", ".join(st.row)
    marks = ", ".join("?" * len(st.row))
    verb = "INSERT OR REPLACE" if isinstance(st, Replace) else "INSERT OR IGNORE"
    assert isinstance(st, Replace | InsertIgnore)
    return f"{verb} INTO {st.table} ({cols}) VALUES ({marks})", tuple(st.row.values())


class SqliteBackend:
    def __init__(self, path: str, *, allow_network_fs: bool = False):
        self.path = self.where = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if not allow_network_fs:
            check_local(path)
        self.created = not os.path.exists(path)
        try:
            self.wdb = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.wdb.execute("PRAGMA journal_mode=WAL")
            self.wdb.execute("PRAGMA synchronous=FULL")
            self.wdb.executescript(SCHEMA)
            migrate(self.wdb)
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise CatalogError(
                f"cannot open the catalog {path}: {e}; it must be a writable file on a local "
                "disk (ckptd serve --catalog PATH, or CKPTD_CATALOG_DIR for the embedded "
                "coordinator)"
            ) from e

    def transact(self, statements: Sequence[Statement]) -> None:
        try:
            self.wdb.execute("BEGIN IMMEDIATE")
            for st in statements:
                self.wdb.execute(*render(st))
            self.wdb.execute("COMMIT")
        except sqlite3.Error as e:
            try:
                self.wdb.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise CatalogError(f"catalog {self.path}: write failed: {e}") from e

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.db.execute(sql, tuple(args)).fetchall()

    def close(self) -> None:
        self.db.close()
        self.wdb.close()
