"""What the catalog's two backends share: the schema, the statement forms, the backend seam.

The catalog's semantics are written once, in `catalog.Catalog`: every statement it runs is
one of the forms here, in SQLite's spelling (`?` placeholders, SQLite's types), and a
backend renders them for its database:

    Sql(sql, args)                      a statement as written
    Replace(table, keys, row)           the row of `keys` replaced whole (SQLite's INSERT OR
                                        REPLACE: the columns `row` leaves out get their
                                        defaults, never an earlier row's values)
    InsertIgnore(table, row)            inserted unless a row of its key exists

The DDL below is SQLite's; PostgreSQL's is derived from it (`postgres_ddl`: INTEGER is
BIGINT, REAL is DOUBLE PRECISION, TEXT sorts bytewise as in SQLite), so the two cannot
drift. A backend (`Backend`) opens its database, brings it to SCHEMA_VERSION, runs a batch
of statements as one durable transaction, and answers queries.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Protocol

from ckptd.errors import CkptError, CoordinatorUnavailable

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job TEXT PRIMARY KEY,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS saves (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    bytes INTEGER NOT NULL DEFAULT 0,
    created_unix REAL NOT NULL,
    committed_unix REAL NOT NULL DEFAULT 0,
    manifest_blake3 TEXT NOT NULL DEFAULT '',
    draft TEXT,
    keep_last INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job, step)
);
CREATE TABLE IF NOT EXISTS attempts (
    job TEXT NOT NULL,
    attempt TEXT NOT NULL,
    generation INTEGER NOT NULL,
    PRIMARY KEY (job, attempt)
);
CREATE TABLE IF NOT EXISTS reports (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    report TEXT NOT NULL,
    PRIMARY KEY (job, step, generation, rank)
);
"""

# Schema 2: the tiers that hold each step besides the job's directory (the "local" tier,
# whose state is the saves table): a mirror's copy is UPLOADING, HELD (verified and
# committed there) or FAILED (reason says why); retention in the mirror deletes the row.
# A new table, so the migration of a schema-1 catalog is creating it (`migrate`).
TIERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS tiers (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier TEXT NOT NULL,
    url TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    updated_unix REAL NOT NULL,
    PRIMARY KEY (job, step, tier)
);
"""
# Schema 3: steps retention has begun to remove. Retention lists a step here, removes it
# from storage, then deletes its rows; a restarted coordinator finishes exactly what is
# listed. A committed step whose manifest vanished otherwise is damage to report, never
# debris to delete.
RETIRING_SCHEMA = """
CREATE TABLE IF NOT EXISTS retiring (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    PRIMARY KEY (job, step)
);
"""
# Schema 4: each save's parent, the step its state descends from (NULL: not recorded), so
# retention follows the job's live line (docs/concepts.md, Rollbacks and the live line).
PARENT_COLUMN = "ALTER TABLE saves ADD COLUMN parent INTEGER"
# Schema 5: shard reports one row a batch (a node's, or one rank's), keyed by the batch's
# first rank, its reports a JSON list of [rank, report]: rows grow with nodes, not ranks.
# Rows of the per-rank `reports` table (schema 1-4, a save in flight across an upgrade)
# are still read; nothing writes them now.
BATCH_REPORTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_reports (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    first_rank INTEGER NOT NULL,
    reports TEXT NOT NULL,
    PRIMARY KEY (job, step, generation, first_rank)
);
"""
SCHEMA_VERSION = 5


class CatalogError(CkptError):
    pass


class CatalogUnavailable(CatalogError, CoordinatorUnavailable):
    """The catalog's database cannot be reached (or this coordinator no longer leads on
    it): the call is answered UNAVAILABLE, so a client tries its next address."""


@dataclasses.dataclass(frozen=True)
class Sql:
    sql: str
    args: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Replace:
    table: str
    keys: tuple[str, ...]
    row: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class InsertIgnore:
    table: str
    row: dict[str, Any]


Statement = Sql | Replace | InsertIgnore


class Backend(Protocol):
    """A catalog database. Call order: construct (opens and migrates, or the caller does,
    see the backend), then any number of `transact` (from one writer thread at a time) and
    `query` (from the event loop), then `close`."""

    # Where the catalog lives, for messages (a path, or a URL without its password).
    where: str
    # True when this open created the catalog (then the coordinator rebuilds it from storage).
    created: bool

    def transact(self, statements: Sequence[Statement]) -> None:
        """Run the statements as one durable transaction (all or none); raise CatalogError
        (CatalogUnavailable when the database cannot be reached)."""

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of a read (SQLite's spelling, as Sql)."""
        ...

    def close(self) -> None: ...


_TYPES = {"INTEGER": "BIGINT", "REAL": "DOUBLE PRECISION", "TEXT": 'TEXT COLLATE "C"'}
_TYPE_WORD = re.compile(r"\b(INTEGER|REAL|TEXT)\b")


def is_postgres_url(target: str) -> bool:
    """Whether a --catalog names a PostgreSQL database (else it is a SQLite file)."""
    return target.startswith(("postgresql://", "postgres://"))


def postgres_ddl(ddl: str) -> str:
    """SQLite's DDL in PostgreSQL's types: 64-bit integers (steps, generations and byte
    counts exceed 32 bits), double-precision times, and text that compares bytewise
    (SQLite's BINARY collation), so listings come back in the same order."""
    return _TYPE_WORD.sub(lambda m: _TYPES[m.group(1)], ddl)
