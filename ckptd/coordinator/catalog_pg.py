"""The catalog in PostgreSQL, and which of the coordinators sharing it leads.

`ckptd serve --catalog postgresql://...` keeps the catalog (catalog.Catalog's statements,
rendered here) in a PostgreSQL database, so several `ckptd serve` processes on several
hosts can share it: one leads, the others stand by. PostgreSQL decides who leads, nothing
here votes: the leader is the process whose *writer session* holds the database's
advisory lock `LOCK_KEY` (session-level, `pg_advisory_lock`). A standby waits for that
lock on its own writer session (`try_lead`); PostgreSQL grants it the moment the leader's
session ends: at once when the leader process dies (its socket closes), within the TCP
keepalive bounds set on the session (about the lease) when its host or network vanishes.

Fencing: every catalog write of the leader runs in a transaction on that same session,
and the transaction's first statement checks that the session still holds the lock
(`_FENCE`); a leader whose session PostgreSQL ended cannot write at all, and one whose lock
is gone (a pooler that reset the session) cannot commit. Either way it stops leading for
good (`lost`): `ckptd serve` exits, and a supervisor restarts it as a standby. Reads run on
a second session; the writer session is never reconnected.

One database (or schema, with `?options=-csearch_path%3D...`) per root: the catalog
records the root it belongs to (`ckptd_meta`) and refuses another. Its schema version is
kept there too (SQLite keeps it in PRAGMA user_version). Needs the `postgres` extra
(psycopg 3); this module is imported only for a postgresql:// catalog.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg
import psycopg.errors

from ckptd.coordinator.catalog_sql import (
    BATCH_REPORTS_SCHEMA,
    PARENT_COLUMN,
    RETIRING_SCHEMA,
    SCHEMA,
    SCHEMA_VERSION,
    TIERS_SCHEMA,
    CatalogError,
    CatalogUnavailable,
    InsertIgnore,
    Replace,
    Sql,
    Statement,
    postgres_ddl,
)

# The leadership lock of a catalog database ("ckpt", "cat1"): advisory locks are per
# database, so each catalog database has its own leader.
LOCK_KEY = (0x636B7074, 0x63617431)
_FENCE = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s "
    "AND objsubid = 2 AND granted AND pid = pg_backend_pid() "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
TABLES = ("jobs", "saves", "attempts", "reports", "tiers", "retiring", "batch_reports")
META = "CREATE TABLE IF NOT EXISTS ckptd_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
READ_TIMEOUT_MS = 10_000  # a read runs on the event loop: never let one hang it


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class PostgresBackend:
    """A catalog database and this process's place on it (standby, then leader).

    Call order: construct (connects; raises CatalogUnavailable when it cannot), `try_lead`
    until it returns True (standby meanwhile: `leader` says who leads), `migrate` (the
    leader's first transaction: schema, root, the leader's row), then the Backend calls;
    `beat` regularly proves the leadership; `close`."""

    def __init__(
        self,
        url: str,
        *,
        root: str,
        lease_s: float = 60.0,
        address: str = "",
        connect_timeout_s: float = 10.0,
    ):
        self.url = url
        self.where = redact(url)
        self.root = root
        self.lease_s = lease_s
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.created = False
        self.leading = False
        self.lost: str | None = None  # why this process no longer leads (for good)
        self.on_lost: Callable[[str], None] | None = None
        self._wlock = threading.Lock()
        self._sql: dict[str, str] = {}
        self._writer = self._connect("writer")
        try:
            self._keepalive(self._writer)
            self._reader = self._connect("reader")
        except BaseException:
            self._writer.close()
            raise

    # -- connections -------------------------------------------------------------------
    def _connect(self, purpose: str) -> psycopg.Connection[Any]:
        # The client side of the session's TCP keepalive: a leader learns within about
        # the lease that PostgreSQL is gone (then it stops leading).
        idle, interval = max(1, int(self.lease_s / 4)), max(1, int(self.lease_s / 8))
        try:
            conn = psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=max(1, int(self.connect_timeout_s)),
                application_name=f"ckptd serve {purpose} pid {os.getpid()}"[:63],
                keepalives=1,
                keepalives_idle=idle,
                keepalives_interval=interval,
                keepalives_count=3,
            )
            if purpose == "reader":
                conn.execute(f"SET statement_timeout = {READ_TIMEOUT_MS}")
            return conn
        except psycopg.Error as e:
            raise CatalogUnavailable(
                f"cannot reach the catalog {self.where}: {_first_line(e)}; check the URL "
                "(host, port, database, user; a password in the URL or in ~/.pgpass), that "
                "PostgreSQL runs and accepts this host (pg_hba.conf), and that the database "
                "exists (createdb)"
            ) from None

    def _keepalive(self, conn: psycopg.Connection[Any]) -> None:
        """The server side: PostgreSQL ends the session of a leader whose host vanished
        within about half the lease, so a standby can take over within the lease."""
        idle, interval = max(1, int(self.lease_s / 4)), max(1, int(self.lease_s / 8))
        conn.execute(f"SET tcp_keepalives_idle = {idle}")
        conn.execute(f"SET tcp_keepalives_interval = {interval}")
        conn.execute("SET tcp_keepalives_count = 3")
        conn.execute(f"SET tcp_user_timeout = {int(self.lease_s * 500)}")

    # -- leadership --------------------------------------------------------------------
    def try_lead(self, wait_s: float) -> bool:
        """Wait up to `wait_s` for the leadership lock on the writer session; True once
        this process holds it (it never lets go until its session ends or `close`)."""
        with self._wlock:
            try:
                self._writer.execute(f"SET lock_timeout = {max(1, int(wait_s * 1000))}")
                try:
                    self._writer.execute("SELECT pg_advisory_lock(%s, %s)", LOCK_KEY)
                except psycopg.errors.LockNotAvailable:
                    return False
                self._writer.execute("SET lock_timeout = 0")
                self._lease_on_session()
            except psycopg.Error as e:
                raise CatalogUnavailable(
                    f"the catalog {self.where} went away while this coordinator stood by: "
                    f"{_first_line(e)}; restart it once PostgreSQL is reachable"
                ) from None
        self.leading = True
        return True

    def _lease_on_session(self) -> None:
        """A leader that stops running (SIGSTOP, a hung loop: its session alive, idle) must
        not keep the lock: PostgreSQL ends a leader's session idle for half the lease, and
        the leader's heartbeat (`beat`, every few seconds) keeps a running one busy."""
        ms = max(1000, int(self.lease_s * 500))
        for setting in ("idle_session_timeout", "idle_in_transaction_session_timeout"):
            try:
                self._writer.execute(f"SET {setting} = {ms}")
            except psycopg.errors.UndefinedObject:  # PostgreSQL < 14: no idle_session_timeout
                pass

    def leader(self) -> dict[str, Any] | None:
        """Who leads (as its row in ckptd_meta says: host, pid, address, since), if any
        leader ever wrote one; None when none did or the catalog cannot be read."""
        try:
            rows = self._reader.execute("SELECT value FROM ckptd_meta WHERE key = 'leader'")
            row = rows.fetchone()
        except psycopg.Error:
            return None
        return None if row is None else dict(json.loads(row[0]))

    def reset(self) -> None:
        """Drop the catalog's rows for a rebuild from storage (`ckptd rebuild-catalog`); the
        leader only, on a catalog of this root. `migrate` then recreates the tables."""
        with self._wlock:
            try:
                with self._writer.transaction():
                    cur = self._writer.cursor()
                    self._fence(cur)
                    cur.execute(META)
                    row = cur.execute("SELECT value FROM ckptd_meta WHERE key = 'root'").fetchone()
                    if row is not None and row[0] != self.root:
                        raise CatalogError(
                            f"the catalog {self.where} belongs to the root {row[0]}, not "
                            f"{self.root}: rebuild it with --root {row[0]}"
                        )
                    for table in TABLES:
                        cur.execute(f"DROP TABLE IF EXISTS {table}")
                    cur.execute("DELETE FROM ckptd_meta WHERE key = 'schema_version'")
            except psycopg.Error as e:
                raise self._failed(e, "dropping the catalog's rows") from None

    def migrate(self) -> None:
        """The leader's first transaction: the schema at SCHEMA_VERSION (additive, as
        SQLite's migrate), the root this catalog belongs to, and who leads now."""
        with self._wlock:
            try:
                with self._writer.transaction():
                    cur = self._writer.cursor()
                    self._fence(cur)
                    cur.execute(META)
                    meta = dict(cur.execute("SELECT key, value FROM ckptd_meta").fetchall())
                    root = meta.get("root")
                    if root is not None and root != self.root:
                        raise CatalogError(
                            f"the catalog {self.where} belongs to the root {root}, not "
                            f"{self.root}: every `ckptd serve` on one catalog serves the same "
                            "--root (mounted at the same path); give another root its own "
                            "database, or its own schema (options=-csearch_path=NAME in the URL)"
                        )
                    self.created = "schema_version" not in meta
                    for ddl in (SCHEMA, TIERS_SCHEMA, RETIRING_SCHEMA, BATCH_REPORTS_SCHEMA):
                        for one in postgres_ddl(ddl).split(";"):
                            if one.strip():
                                cur.execute(one)
                    cur.execute(
                        postgres_ddl(PARENT_COLUMN).replace(
                            "ADD COLUMN", "ADD COLUMN IF NOT EXISTS"
                        )
                    )
                    version = max(SCHEMA_VERSION, int(meta.get("schema_version", 0)))
                    me = {
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "address": self.address,
                        "since_unix": time.time(),
                    }
                    for key, value in (
                        ("root", self.root),
                        ("schema_version", str(version)),
                        ("leader", json.dumps(me)),
                    ):
                        cur.execute(
                            "INSERT INTO ckptd_meta (key, value) VALUES (%s, %s) "
                            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                            (key, value),
                        )
            except psycopg.Error as e:
                raise self._failed(e, "preparing the catalog") from None

    def beat(self) -> None:
        """Prove the leadership now (the fence, alone); raises CatalogUnavailable when
        this process no longer leads, and it never will again. While a write runs, that
        write is the proof (its own fence; the session is busy, not idle)."""
        if not self._wlock.acquire(blocking=False):
            return
        try:
            self._check_lost()
            try:
                self._fence(self._writer.cursor())
            except psycopg.Error as e:
                raise self._failed(e, "proving its leadership") from None
        finally:
            self._wlock.release()

    def _fence(self, cur: psycopg.Cursor[Any]) -> None:
        row = cur.execute(_FENCE, LOCK_KEY).fetchone()
        if not row or int(row[0]) != 1:
            raise self._lose(
                "its session no longer holds the catalog's leadership lock (was the session "
                "reset, e.g. by a pooler in transaction mode? connect to PostgreSQL directly "
                "or through a session-mode pool)"
            )

    def _lose(self, why: str) -> CatalogUnavailable:
        """Stop leading for good: close the writer session (so PostgreSQL frees the lock
        at once, if it still held it) and tell `on_lost`."""
        first = self.lost is None
        if first:
            self.lost = why
            self.leading = False
        try:
            self._writer.close()
        except psycopg.Error:
            pass
        if first and self.on_lost is not None:
            self.on_lost(why)
        return self._lost_error()

    def _lost_error(self) -> CatalogUnavailable:
        return CatalogUnavailable(
            f"this coordinator no longer leads on the catalog {self.where} ({self.lost}); "
            "another `ckptd serve` on it takes over: clients given every address "
            "(CKPTD_ADDRESS=a,b) move to it on their own"
        )

    def _check_lost(self) -> None:
        if self.lost is not None:
            raise self._lost_error()

    def _failed(self, e: psycopg.Error, doing: str) -> CatalogError:
        """A failed statement of the writer session: the session is gone (leadership
        lost: CatalogUnavailable), or the statement failed (CatalogError)."""
        if self._writer.broken:
            return self._lose(f"its session to PostgreSQL failed while {doing}: {_first_line(e)}")
        if self._writer.closed:
            return self._lost_error()
        return CatalogError(f"catalog {self.where}: {doing} failed: {_first_line(e)}")

    # -- the Backend calls -------------------------------------------------------------
    def transact(self, statements: Sequence[Statement]) -> None:
        with self._wlock:
            self._check_lost()
            if not self.leading:
                raise CatalogUnavailable(
                    f"this coordinator is a standby on the catalog {self.where}; it writes "
                    "nothing until it leads"
                )
            try:
                with self._writer.transaction():
                    cur = self._writer.cursor()
                    self._fence(cur)
                    for sql, rows in _grouped(self._render(statements)):
                        if len(rows) == 1:
                            cur.execute(sql, rows[0])
                        else:
                            cur.executemany(sql, rows)
            except psycopg.Error as e:
                raise self._failed(e, "write") from None

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        pg = self._pg(sql)
        for attempt in (0, 1):
            try:
                return self._reader.execute(pg, _args(args)).fetchall()
            except psycopg.Error as e:
                if not self._reader.broken or attempt == 1:
                    raise CatalogUnavailable(
                        f"the catalog {self.where} did not answer a read: {_first_line(e)}; "
                        "check that PostgreSQL runs and this host reaches it"
                    ) from None
                self._reader = self._connect("reader")  # a read session may be renewed
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in (self._reader, self._writer):
            try:
                conn.close()
            except psycopg.Error:
                pass

    # -- rendering ---------------------------------------------------------------------
    def _pg(self, sql: str) -> str:
        out = self._sql.get(sql)
        if out is None:
            out = self._sql[sql] = sql.replace("?", "%s")
        return out

    def _render(self, statements: Sequence[Statement]) -> Iterable[tuple[str, tuple[Any, ...]]]:
        """Statements in PostgreSQL's spelling. A Replace is SQLite's INSERT OR REPLACE
        exactly: the row of its key deleted, the new one inserted (the columns it leaves
        out get their defaults). A run of Replaces into one table is one DELETE and one
        INSERT of many rows (the last row of a key wins, as one after another would)."""
        i = 0
        while i < len(statements):
            st = statements[i]
            if isinstance(st, Sql):
                yield self._pg(st.sql), _args(st.args)
                i += 1
            elif isinstance(st, InsertIgnore):
                cols = ", ".join(st.row)
                marks = ", ".join(["%s"] * len(st.row))
                yield (
                    f"INSERT INTO {st.table} ({cols}) VALUES ({marks}) ON CONFLICT DO NOTHING",
                    _args(tuple(st.row.values())),
                )
                i += 1
            else:
                j = i
                run: dict[tuple[Any, ...], Replace] = {}
                while j < len(statements):
                    nxt = statements[j]
                    if not (
                        isinstance(nxt, Replace)
                        and nxt.table == st.table
                        and nxt.keys == st.keys
                        and list(nxt.row) == list(st.row)
                    ):
                        break
                    key = tuple(nxt.row[k] for k in nxt.keys)
                    run.pop(key, None)
                    run[key] = nxt
                    j += 1
                where = " AND ".join(f"{k} = %s" for k in st.keys)
                for key in run:
                    yield f"DELETE FROM {st.table} WHERE {where}", _args(key)
                cols = ", ".join(st.row)
                marks = ", ".join(["%s"] * len(st.row))
                for rep in run.values():
                    yield (
                        f"INSERT INTO {st.table} ({cols}) VALUES ({marks})",
                        _args(tuple(rep.row.values())),
                    )
                i = j


def _grouped(
    rendered: Iterable[tuple[str, tuple[Any, ...]]],
) -> Iterable[tuple[str, list[tuple[Any, ...]]]]:
    """Consecutive statements of one SQL text, together (one executemany: pipelined)."""
    sql: str | None = None
    rows: list[tuple[Any, ...]] = []
    for s, a in rendered:
        if s != sql and sql is not None:
            yield sql, rows
            rows = []
        sql = s
        rows.append(a)
    if sql is not None:
        yield sql, rows


def _args(args: Sequence[Any]) -> tuple[Any, ...]:
    """PostgreSQL's text cannot hold NUL (SQLite's can): a client's reason or URL with one
    is stored with U+FFFD in its place instead of failing the write."""
    return tuple(a.replace("\0", "\ufffd") if isinstance(a, str) and "\0" in a else a for a in args)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
