"""The coordinator's shared vocabulary: save identities, reports, answers, statuses.

The core, the catalog, recovery, the observer, the servicers' converters and the clients
all speak these; they live apart from the core so each of them imports this module, not
the core (and not one another), and imports run one way.
"""

from __future__ import annotations

import dataclasses

from ckptd.format.manifest import ShardInfo

# What the catalog says of a save (table `saves`).
OPEN, COMMITTING, COMMITTED, ABORTED = "OPEN", "COMMITTING", "COMMITTED", "ABORTED"
QUARANTINED = "QUARANTINED"  # committed, then failed verification when loaded
# What a mirror tier holds of a step (catalog table `tiers`).
TIER_UPLOADING, TIER_HELD, TIER_FAILED, TIER_REMOVED = "UPLOADING", "HELD", "FAILED", "REMOVED"
TIER_STATUSES = frozenset({TIER_UPLOADING, TIER_HELD, TIER_FAILED})


@dataclasses.dataclass(frozen=True)
class SaveRef:
    """Who asks: one rank of one save (job, step) of one generation."""

    job: str
    step: int
    generation: int
    rank: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class ShardReport:
    """A rank's account of the shard it wrote (ReportShard), checked by the coordinator."""

    shard_path: str
    size: int
    index_path: str
    index_size: int
    index_blake3: str
    verify: str = "full"
    # The steps whose files the shard's index borrows entries from (an incremental save);
    # the manifest lists them (ShardInfo.borrows) and retention keeps them while it is kept.
    borrows: tuple[int, ...] = ()
    # The format version of the index (ShardInfo.index_version; 0: a client before it).
    index_version: int = 0
    # The rank's own timings (for metrics); not part of the report's identity, so a retried
    # report still matches.
    staging_s: float = dataclasses.field(default=0.0, compare=False)
    persist_s: float = dataclasses.field(default=0.0, compare=False)
    write_s: float = dataclasses.field(default=0.0, compare=False)
    verify_s: float = dataclasses.field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        # A report read back from the catalog's JSON has a list here.
        object.__setattr__(self, "borrows", tuple(self.borrows))

    @classmethod
    def of(cls, info: ShardInfo, verify: str, **timings: float) -> ShardReport:
        """The report of a written shard (ckptd.format.writer's ShardInfo)."""
        return cls(
            info.path,
            info.size,
            info.index,
            info.index_size,
            info.index_blake3,
            verify,
            tuple(info.borrows),
            info.index_version,
            **timings,
        )

    def shard_info(self, rank: int) -> ShardInfo:
        """The manifest's entry for this shard: the one way from a report to a ShardInfo."""
        return ShardInfo(
            rank,
            self.shard_path,
            self.size,
            self.index_path,
            self.index_size,
            self.index_blake3,
            list(self.borrows),
            self.index_version,
        )


@dataclasses.dataclass
class BeginResult:
    shard_path: str
    index_path: str
    write: list[int]
    lease_s: float
    warnings: list[str]
    complete: bool


@dataclasses.dataclass
class StatusResult:
    status: str
    reason: str = ""
    manifest_blake3: str = ""
    error: str = ""  # ABORTED: the ckptd.errors class that caused it ("" = SaveAborted)
