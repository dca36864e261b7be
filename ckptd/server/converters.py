"""Protobuf <-> coordinator-core types, in one place (the servicers only call these)."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from ckptd.coordinator import types
from ckptd.coordinator.catalog import SaveRecord
from ckptd.coordinator.planning import ChunkPlan
from ckptd.errors import InvalidRequest
from ckptd.format import values
from ckptd.v1 import coordinator_pb2 as pb

MAX_JSON_BYTES = 4 << 20

STATUS_TO_PB = {
    types.OPEN: pb.OPEN,
    types.COMMITTING: pb.COMMITTING,
    types.COMMITTED: pb.COMMITTED,
    types.ABORTED: pb.ABORTED,
    types.QUARANTINED: pb.QUARANTINED,
}
STATUS_FROM_PB = {v: k for k, v in STATUS_TO_PB.items()}


def ref_from_pb(ref: pb.SaveRef) -> types.SaveRef:
    return types.SaveRef(ref.job, ref.step, ref.generation, ref.rank, ref.world_size)


def ref_to_pb(ref: types.SaveRef) -> pb.SaveRef:
    return pb.SaveRef(
        job=ref.job,
        step=ref.step,
        generation=ref.generation,
        rank=ref.rank,
        world_size=ref.world_size,
    )


def chunk_from_pb(c: pb.Chunk) -> ChunkPlan:
    return ChunkPlan(
        key=c.key,
        dtype=c.dtype,
        shape=tuple(c.shape),
        chunk_offsets=tuple(c.chunk_offsets),
        chunk_sizes=tuple(c.chunk_sizes),
        length=c.length,
        # Raw on the wire, hex in the plan (its messages and the indexes show hex); a
        # digest of the wrong length stays one, for check_chunk to refuse with the key.
        blake3=c.digest.hex(),
    )


def chunk_to_pb(c: ChunkPlan) -> pb.Chunk:
    return pb.Chunk(
        key=c.key,
        dtype=c.dtype,
        shape=c.shape,
        chunk_offsets=c.chunk_offsets,
        chunk_sizes=c.chunk_sizes,
        length=c.length,
        digest=bytes.fromhex(c.blake3),
    )


def json_field(data: bytes, what: str) -> Any:
    """A JSON field of a request, parsed strictly. Equal bytes give one shared object (a
    save's ranks send one state tree and one metadata object: parsed once, and the core
    checks and merges the tree once); callers never mutate what they get."""
    if not data:
        return None
    if len(data) > MAX_JSON_BYTES:
        raise InvalidRequest(
            f"{what} is {len(data)} bytes of JSON, over the {MAX_JSON_BYTES}-byte limit: keep "
            "large values in tensors or numpy arrays (they go to the shards), not in plain values"
        )
    try:
        return _parse_json(bytes(data))
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(
            f"{what} is not valid JSON (strict: no NaN or Infinity): {str(e)[:200]}"
        ) from None


@functools.lru_cache(maxsize=16)  # a few saves of a few jobs in flight; errors not kept
def _parse_json(data: bytes) -> Any:
    # 1e999 parses to inf without a constant: the manifest could not be written.
    return json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"non-finite number {text[:40]}")
    return v


def state_fields(state: Any) -> tuple[bytes, bytes]:
    """A rank's state tree as BeginSave sends it: (the tree with its per-rank nodes
    emptied, equal on every rank; the rank's own per-rank entries, b"" for none)."""
    shared, mine = values.split_per_rank(state)
    compact = (",", ":")
    return (
        json.dumps(shared, separators=compact).encode(),
        json.dumps(mine, separators=compact).encode() if mine else b"",
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def status_to_pb(r: types.StatusResult) -> pb.SaveStatus:
    return pb.SaveStatus(
        status=STATUS_TO_PB.get(r.status, pb.STATUS_UNSPECIFIED),
        reason=r.reason,
        manifest_blake3=r.manifest_blake3,
        error=r.error,
    )


def status_from_pb(s: pb.SaveStatus) -> types.StatusResult:
    return types.StatusResult(
        STATUS_FROM_PB.get(s.status, "UNSPECIFIED"), s.reason, s.manifest_blake3, s.error
    )


def record_to_pb(r: SaveRecord) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        job=r.job,
        step=r.step,
        generation=r.generation,
        world_size=r.world_size,
        status=STATUS_TO_PB.get(r.status, pb.STATUS_UNSPECIFIED),
        reason=r.reason,
        bytes=r.bytes,
        created_unix=r.created_unix,
        committed_unix=r.committed_unix,
        manifest_blake3=r.manifest_blake3,
    )


def report_from_pb(req: pb.ReportShardRequest) -> types.ShardReport:
    return types.ShardReport(
        req.shard_path,
        req.size,
        req.index_path,
        req.index_size,
        req.index_blake3,
        req.verify,
        tuple(req.borrows),
        req.index_version,
        staging_s=req.staging_s,
        persist_s=req.persist_s,
        write_s=req.write_s,
        verify_s=req.verify_s,
    )


def report_to_pb(ref: pb.SaveRef, r: types.ShardReport) -> pb.ReportShardRequest:
    return pb.ReportShardRequest(
        ref=ref,
        shard_path=r.shard_path,
        size=r.size,
        index_path=r.index_path,
        index_size=r.index_size,
        index_blake3=r.index_blake3,
        verify=r.verify,
        borrows=list(r.borrows),
        index_version=r.index_version,
        staging_s=r.staging_s,
        persist_s=r.persist_s,
        write_s=r.write_s,
        verify_s=r.verify_s,
    )


def record_from_pb(i: pb.CheckpointInfo) -> SaveRecord:
    return SaveRecord(
        job=i.job,
        step=i.step,
        generation=i.generation,
        world_size=i.world_size,
        status=STATUS_FROM_PB.get(i.status, "UNSPECIFIED"),
        reason=i.reason,
        bytes=i.bytes,
        created_unix=i.created_unix,
        committed_unix=i.committed_unix,
        manifest_blake3=i.manifest_blake3,
    )


def parent_from_pb(r: pb.BeginSaveRequest) -> int | None:
    """A BeginSave's parent step: None when the client recorded none (the field unset)."""
    return int(r.parent) if r.HasField("parent") else None


def begin_to_pb(r: types.BeginResult) -> pb.BeginSaveResponse:
    return pb.BeginSaveResponse(
        shard_path=r.shard_path,
        index_path=r.index_path,
        write=r.write,
        lease_ms=int(r.lease_s * 1000),
        warnings=r.warnings,
        complete=r.complete,
    )


def begin_from_pb(r: pb.BeginSaveResponse) -> types.BeginResult:
    return types.BeginResult(
        r.shard_path, r.index_path, list(r.write), r.lease_ms / 1000, list(r.warnings), r.complete
    )
