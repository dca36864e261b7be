from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[Status]
    OPEN: _ClassVar[Status]
    COMMITTING: _ClassVar[Status]
    COMMITTED: _ClassVar[Status]
    ABORTED: _ClassVar[Status]
    QUARANTINED: _ClassVar[Status]
STATUS_UNSPECIFIED: Status
OPEN: Status
COMMITTING: Status
COMMITTED: Status
ABORTED: Status
QUARANTINED: Status

class NodeCall(_message.Message):
    __slots__ = ("id", "begin_save", "keep_alive", "report_shards", "await_commit")
    ID_FIELD_NUMBER: _ClassVar[int]
    BEGIN_SAVE_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    REPORT_SHARDS_FIELD_NUMBER: _ClassVar[int]
    AWAIT_COMMIT_FIELD_NUMBER: _ClassVar[int]
    id: int
    begin_save: NodeBeginSaveRequest
    keep_alive: NodeKeepAliveRequest
    report_shards: NodeReportRequest
    await_commit: AwaitCommitRequest
    def __init__(self, id: _Optional[int] = ..., begin_save: _Optional[_Union[NodeBeginSaveRequest, _Mapping]] = ..., keep_alive: _Optional[_Union[NodeKeepAliveRequest, _Mapping]] = ..., report_shards: _Optional[_Union[NodeReportRequest, _Mapping]] = ..., await_commit: _Optional[_Union[AwaitCommitRequest, _Mapping]] = ...) -> None: ...

class NodeError(_message.Message):
    __slots__ = ("code", "details", "trailers")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailers: _containers.RepeatedCompositeFieldContainer[NodeErrorTrailer]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailers: _Optional[_Iterable[_Union[NodeErrorTrailer, _Mapping]]] = ...) -> None: ...

class NodeErrorTrailer(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class NodeAnswer(_message.Message):
    __slots__ = ("id", "begin_save", "statuses", "status", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    BEGIN_SAVE_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    begin_save: NodeBeginSaveResponse
    statuses: NodeStatusResponse
    status: SaveStatus
    error: NodeError
    def __init__(self, id: _Optional[int] = ..., begin_save: _Optional[_Union[NodeBeginSaveResponse, _Mapping]] = ..., statuses: _Optional[_Union[NodeStatusResponse, _Mapping]] = ..., status: _Optional[_Union[SaveStatus, _Mapping]] = ..., error: _Optional[_Union[NodeError, _Mapping]] = ...) -> None: ...

class NodeBeginSaveRequest(_message.Message):
    __slots__ = ("node", "ranks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    node: str
    ranks: _containers.RepeatedCompositeFieldContainer[BeginSaveRequest]
    def __init__(self, node: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[BeginSaveRequest, _Mapping]]] = ...) -> None: ...

class NodeBeginSaveResponse(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[BeginSaveResponse]
    def __init__(self, ranks: _Optional[_Iterable[_Union[BeginSaveResponse, _Mapping]]] = ...) -> None: ...

class NodeKeepAliveRequest(_message.Message):
    __slots__ = ("node", "ranks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    node: str
    ranks: _containers.RepeatedCompositeFieldContainer[KeepAliveRequest]
    def __init__(self, node: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[KeepAliveRequest, _Mapping]]] = ...) -> None: ...

class NodeReportRequest(_message.Message):
    __slots__ = ("node", "ranks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    node: str
    ranks: _containers.RepeatedCompositeFieldContainer[ReportShardRequest]
    def __init__(self, node: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[ReportShardRequest, _Mapping]]] = ...) -> None: ...

class NodeStatusResponse(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[SaveStatus]
    def __init__(self, ranks: _Optional[_Iterable[_Union[SaveStatus, _Mapping]]] = ...) -> None: ...

class OpenJobRequest(_message.Message):
    __slots__ = ("job", "attempt")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job: str
    attempt: str
    def __init__(self, job: _Optional[str] = ..., attempt: _Optional[str] = ...) -> None: ...

class OpenJobResponse(_message.Message):
    __slots__ = ("generation", "job")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    generation: int
    job: str
    def __init__(self, generation: _Optional[int] = ..., job: _Optional[str] = ...) -> None: ...

class SaveRef(_message.Message):
    __slots__ = ("job", "step", "generation", "rank", "world_size")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    generation: int
    rank: int
    world_size: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("key", "dtype", "shape", "chunk_offsets", "chunk_sizes", "length", "digest")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunk_offsets: _containers.RepeatedScalarFieldContainer[int]
    chunk_sizes: _containers.RepeatedScalarFieldContainer[int]
    length: int
    digest: bytes
    def __init__(self, key: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., chunk_offsets: _Optional[_Iterable[int]] = ..., chunk_sizes: _Optional[_Iterable[int]] = ..., length: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class BeginSaveRequest(_message.Message):
    __slots__ = ("ref", "chunks", "part", "parts", "state", "metadata", "allow_divergent_replicas", "keep_last", "timeout_ms", "parent", "layout_digest", "digests", "rank_state")
    REF_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DIVERGENT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    RANK_STATE_FIELD_NUMBER: _ClassVar[int]
    ref: SaveRef
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    part: int
    parts: int
    state: bytes
    metadata: bytes
    allow_divergent_replicas: bool
    keep_last: int
    timeout_ms: int
    parent: int
    layout_digest: bytes
    digests: bytes
    rank_state: bytes
    def __init__(self, ref: _Optional[_Union[SaveRef, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., state: _Optional[bytes] = ..., metadata: _Optional[bytes] = ..., allow_divergent_replicas: _Optional[bool] = ..., keep_last: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., parent: _Optional[int] = ..., layout_digest: _Optional[bytes] = ..., digests: _Optional[bytes] = ..., rank_state: _Optional[bytes] = ...) -> None: ...

class BeginSaveResponse(_message.Message):
    __slots__ = ("shard_path", "index_path", "write", "lease_ms", "warnings", "complete")
    SHARD_PATH_FIELD_NUMBER: _ClassVar[int]
    INDEX_PATH_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    shard_path: str
    index_path: str
    write: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: int
    warnings: _containers.RepeatedScalarFieldContainer[str]
    complete: bool
    def __init__(self, shard_path: _Optional[str] = ..., index_path: _Optional[str] = ..., write: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[int] = ..., warnings: _Optional[_Iterable[str]] = ..., complete: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: SaveRef
    def __init__(self, ref: _Optional[_Union[SaveRef, _Mapping]] = ...) -> None: ...

class ReportShardRequest(_message.Message):
    __slots__ = ("ref", "shard_path", "size", "index_path", "index_size", "index_blake3", "verify", "staging_s", "persist_s", "write_s", "verify_s", "borrows", "index_version")
    REF_FIELD_NUMBER: _ClassVar[int]
    SHARD_PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    INDEX_PATH_FIELD_NUMBER: _ClassVar[int]
    INDEX_SIZE_FIELD_NUMBER: _ClassVar[int]
    INDEX_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    STAGING_S_FIELD_NUMBER: _ClassVar[int]
    PERSIST_S_FIELD_NUMBER: _ClassVar[int]
    WRITE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    BORROWS_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    ref: SaveRef
    shard_path: str
    size: int
    index_path: str
    index_size: int
    index_blake3: str
    verify: str
    staging_s: float
    persist_s: float
    write_s: float
    verify_s: float
    borrows: _containers.RepeatedScalarFieldContainer[int]
    index_version: int
    def __init__(self, ref: _Optional[_Union[SaveRef, _Mapping]] = ..., shard_path: _Optional[str] = ..., size: _Optional[int] = ..., index_path: _Optional[str] = ..., index_size: _Optional[int] = ..., index_blake3: _Optional[str] = ..., verify: _Optional[str] = ..., staging_s: _Optional[float] = ..., persist_s: _Optional[float] = ..., write_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., borrows: _Optional[_Iterable[int]] = ..., index_version: _Optional[int] = ...) -> None: ...

class AwaitCommitRequest(_message.Message):
    __slots__ = ("ref", "timeout_ms")
    REF_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ref: SaveRef
    timeout_ms: int
    def __init__(self, ref: _Optional[_Union[SaveRef, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class AbortSaveRequest(_message.Message):
    __slots__ = ("ref", "reason")
    REF_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ref: SaveRef
    reason: str
    def __init__(self, ref: _Optional[_Union[SaveRef, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class SaveStatus(_message.Message):
    __slots__ = ("status", "reason", "manifest_blake3", "error")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: str
    manifest_blake3: str
    error: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[str] = ..., manifest_blake3: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("job", "step", "generation", "world_size", "status", "reason", "bytes", "created_unix", "committed_unix", "manifest_blake3")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    generation: int
    world_size: int
    status: Status
    reason: str
    bytes: int
    created_unix: float
    committed_unix: float
    manifest_blake3: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., status: _Optional[_Union[Status, str]] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., committed_unix: _Optional[float] = ..., manifest_blake3: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("job", "step", "latest")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    latest: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., latest: _Optional[bool] = ...) -> None: ...

class QuarantineRequest(_message.Message):
    __slots__ = ("job", "step", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    reason: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RecordTierRequest(_message.Message):
    __slots__ = ("job", "step", "tier", "url", "status", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    tier: str
    url: str
    status: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., tier: _Optional[str] = ..., url: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RecordTierResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemorySaveRequest(_message.Message):
    __slots__ = ("ref", "phase", "report", "timeout_ms", "reason")
    REF_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ref: SaveRef
    phase: str
    report: bytes
    timeout_ms: int
    reason: str
    def __init__(self, ref: _Optional[_Union[SaveRef, _Mapping]] = ..., phase: _Optional[str] = ..., report: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class MemorySaveResponse(_message.Message):
    __slots__ = ("status", "manifest", "lease_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    status: SaveStatus
    manifest: bytes
    lease_ms: int
    def __init__(self, status: _Optional[_Union[SaveStatus, _Mapping]] = ..., manifest: _Optional[bytes] = ..., lease_ms: _Optional[int] = ...) -> None: ...
