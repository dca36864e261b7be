"""A real PostgreSQL server for the tests of the PostgreSQL catalog (ckptd.coordinator.catalog_pg).

`initdb` into a temporary directory, then `postgres` on a free port of 127.0.0.1 (its unix
socket in that directory too), fsync off (the tests kill ckptd processes, never
PostgreSQL). PostgreSQL refuses to run as root: when the tests do, the server runs as the
`postgres` user where Debian's package made one, else as `nobody`. One server per test
session (`pg_server`), started on first use; each test gets a database of its own
(`pg_url`). Where PostgreSQL is not installed, the tests that need it skip, saying how to
install it (.ci/run does).
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


def pg_bin() -> str | None:
    """The directory of initdb/pg_ctl/postgres: on PATH, else Debian's newest."""
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0,
    )
    return os.path.dirname(versions[-1]) if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    def __init__(self, bindir: str):
        self.bindir = bindir
        self.dir = tempfile.mkdtemp(prefix="ckptd-pg-")
        self.data = os.path.join(self.dir, "data")
        self.user: str | None = None
        if os.geteuid() == 0:
            for name in ("postgres", "nobody"):
                try:
                    pw = pwd.getpwnam(name)
                except KeyError:
                    continue
                self.user = name
                os.chown(self.dir, pw.pw_uid, pw.pw_gid)
                break
            else:
                raise RuntimeError("running as root and no `postgres` nor `nobody` user to run as")
        os.chmod(self.dir, 0o755)  # the socket lives here; the data directory is 0700
        self.port = 0

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [os.path.join(self.bindir, cmd[0]), *cmd[1:]],
            user=self.user,
            cwd=self.dir,
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
        )

    def start(self) -> PgServer:
        self._run("initdb", "-D", self.data, "-U", "ckptd", "--auth=trust", "-E", "UTF8", "-N")
        last = ""
        for _ in range(5):  # a free port can be taken between the probe and the start
            self.port = _free_port()
            opts = (
                f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
            )
            log = os.path.join(self.dir, "log")
            r = self._run(
                "pg_ctl", "-D", self.data, "-o", opts, "-l", log, "-w", "start", check=False
            )
            if r.returncode == 0:
                return self
            last = r.stdout + r.stderr + (open(log).read() if os.path.exists(log) else "")
        raise RuntimeError(f"postgres did not start:\n{last}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://ckptd@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        import psycopg  # the optional `postgres` extra: pg_url skips without it

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-m", "immediate", "stop", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bindir = pg_bin()
    if bindir is None:
        pytest.skip(
            "PostgreSQL is not installed (no initdb on PATH nor in /usr/lib/postgresql/*/bin): "
            "apt-get install postgresql, as .ci/run does"
        )
    try:
        import psycopg  # noqa: F401 - the optional `postgres` extra
    except ImportError:
        pytest.skip("psycopg is not installed: pip install -e '.[postgres]' (the dev extra has it)")
    server = PgServer(bindir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """A fresh, empty database of the session's server."""
    return pg_server.create_database()


def leading_backend(url: str, root: str, *, lease_s: float = 10.0) -> Any:
    """A PostgresBackend that leads (waits for the lock) and has prepared the catalog."""
    from ckptd.coordinator.catalog_pg import PostgresBackend  # psycopg: optional extra

    b = PostgresBackend(url, root=root, lease_s=lease_s)
    try:
        assert b.try_lead(30), f"no leadership on {url} within 30 s"
        b.migrate()
    except BaseException:
        b.close()
        raise
    return b


def read_pg_catalog(url: str) -> tuple[dict[int, dict[str, Any]], set[int]]:
    """(step -> row of `saves`, as coordinator_fixtures.read_catalog gives them; the steps
    listed in `retiring`) of a PostgreSQL catalog."""
    import psycopg  # the optional `postgres` extra

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute("SELECT * FROM saves ORDER BY job, step")
        names = [d.name for d in cur.description or []]
        rows = {r[1]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}
        retiring = {r[0] for r in conn.execute("SELECT step FROM retiring").fetchall()}
    return rows, retiring


def pg_leader(url: str) -> dict[str, Any] | None:
    """The leader's row of a PostgreSQL catalog (host, pid, address, since_unix)."""
    import psycopg  # the optional `postgres` extra

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT value FROM ckptd_meta WHERE key = 'leader'").fetchone()
    return None if row is None else dict(json.loads(row[0]))
