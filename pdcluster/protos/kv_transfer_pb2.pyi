from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChallengeRequest(_message.Message):
    __slots__ = ("consumer_engine_id",)
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_engine_id: str
    def __init__(self, consumer_engine_id: _Optional[str] = ...) -> None: ...

class ChallengeResponse(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class AuthenticateRequest(_message.Message):
    __slots__ = ("nonce", "client_nonce", "consumer_engine_id", "proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    client_nonce: bytes
    consumer_engine_id: str
    proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., client_nonce: _Optional[bytes] = ..., consumer_engine_id: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class AuthenticateResponse(_message.Message):
    __slots__ = ("session", "server_proof")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_PROOF_FIELD_NUMBER: _ClassVar[int]
    session: str
    server_proof: bytes
    def __init__(self, session: _Optional[str] = ..., server_proof: _Optional[bytes] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("name", "block_shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., block_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model", "block_size", "layers", "tp_size", "tp_rank")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    tp_size: int
    tp_rank: int
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "engine_id", "layout")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    engine_id: str
    layout: KVLayout
    def __init__(self, protocol_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "engine_id", "layout", "error", "node_id", "device_kind", "offers", "shm_socket", "mooncake_session", "mooncake_layer_addresses", "mooncake_staging")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SESSION_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_LAYER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_STAGING_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    engine_id: str
    layout: KVLayout
    error: str
    node_id: str
    device_kind: str
    offers: _containers.RepeatedScalarFieldContainer[str]
    shm_socket: str
    mooncake_session: str
    mooncake_layer_addresses: _containers.RepeatedScalarFieldContainer[int]
    mooncake_staging: bool
    def __init__(self, protocol_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., error: _Optional[str] = ..., node_id: _Optional[str] = ..., device_kind: _Optional[str] = ..., offers: _Optional[_Iterable[str]] = ..., shm_socket: _Optional[str] = ..., mooncake_session: _Optional[str] = ..., mooncake_layer_addresses: _Optional[_Iterable[int]] = ..., mooncake_staging: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("protocol_version", "request_id", "block_ids", "consumer_engine_id", "max_chunk_bytes", "layout_digest")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    consumer_engine_id: str
    max_chunk_bytes: int
    layout_digest: int
    def __init__(self, protocol_version: _Optional[int] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., consumer_engine_id: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., layout_digest: _Optional[int] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("layer_index", "first_block", "num_blocks")
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layer_index: int
    first_block: int
    num_blocks: int
    def __init__(self, layer_index: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "transferred", "consumer_engine_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transferred: bool
    consumer_engine_id: str
    def __init__(self, request_id: _Optional[str] = ..., transferred: _Optional[bool] = ..., consumer_engine_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("request_ids", "consumer_engine_id")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    consumer_engine_id: str
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., consumer_engine_id: _Optional[str] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("renewed",)
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    renewed: int
    def __init__(self, renewed: _Optional[int] = ...) -> None: ...

class HandoutsRequest(_message.Message):
    __slots__ = ("keys", "consumer_engine_id", "wait_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    consumer_engine_id: str
    wait_ms: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., consumer_engine_id: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class Handout(_message.Message):
    __slots__ = ("key", "params_json", "first_token")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    key: str
    params_json: str
    first_token: int
    def __init__(self, key: _Optional[str] = ..., params_json: _Optional[str] = ..., first_token: _Optional[int] = ...) -> None: ...

class HandoutsResponse(_message.Message):
    __slots__ = ("handouts",)
    HANDOUTS_FIELD_NUMBER: _ClassVar[int]
    handouts: _containers.RepeatedCompositeFieldContainer[Handout]
    def __init__(self, handouts: _Optional[_Iterable[_Union[Handout, _Mapping]]] = ...) -> None: ...

class ShmPullRequest(_message.Message):
    __slots__ = ("pull", "consumed", "direct", "pid", "block_ids", "registration", "deadline_ms")
    PULL_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    consumed: int
    direct: bool
    pid: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    registration: str
    deadline_ms: int
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., consumed: _Optional[int] = ..., direct: _Optional[bool] = ..., pid: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., registration: _Optional[str] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("address", "nbytes", "row_bytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    address: int
    nbytes: int
    row_bytes: int
    def __init__(self, address: _Optional[int] = ..., nbytes: _Optional[int] = ..., row_bytes: _Optional[int] = ...) -> None: ...

class ShmRegisterRequest(_message.Message):
    __slots__ = ("token", "pid", "regions")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    token: str
    pid: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, token: _Optional[str] = ..., pid: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class ShmRegisterResponse(_message.Message):
    __slots__ = ("registration",)
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    registration: str
    def __init__(self, registration: _Optional[str] = ...) -> None: ...

class ShmChunk(_message.Message):
    __slots__ = ("header", "segment", "segment_bytes", "offset", "pid", "layer_addresses", "push_from_layer", "pushed", "pushed_layers")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LAYER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PUSH_FROM_LAYER_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    PUSHED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    segment: str
    segment_bytes: int
    offset: int
    pid: int
    layer_addresses: _containers.RepeatedScalarFieldContainer[int]
    push_from_layer: int
    pushed: bool
    pushed_layers: int
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., segment: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., pid: _Optional[int] = ..., layer_addresses: _Optional[_Iterable[int]] = ..., push_from_layer: _Optional[int] = ..., pushed: _Optional[bool] = ..., pushed_layers: _Optional[int] = ...) -> None: ...

class CollectiveOpenRequest(_message.Message):
    __slots__ = ("consumer_engine_id", "backend", "device_kind")
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    consumer_engine_id: str
    backend: str
    device_kind: str
    def __init__(self, consumer_engine_id: _Optional[str] = ..., backend: _Optional[str] = ..., device_kind: _Optional[str] = ...) -> None: ...

class CollectiveOpenResponse(_message.Message):
    __slots__ = ("group_key", "backend", "error")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    group_key: str
    backend: str
    error: str
    def __init__(self, group_key: _Optional[str] = ..., backend: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class CollectivePullRequest(_message.Message):
    __slots__ = ("pull", "group_key", "tag")
    PULL_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    group_key: str
    tag: int
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., group_key: _Optional[str] = ..., tag: _Optional[int] = ...) -> None: ...

class CollectiveProgress(_message.Message):
    __slots__ = ("num_chunks", "chunk_bytes", "bytes_sent", "done")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    chunk_bytes: int
    bytes_sent: int
    done: bool
    def __init__(self, num_chunks: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class CollectiveStoreRequest(_message.Message):
    __slots__ = ("group_key", "op", "key", "value", "timeout_ms")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    group_key: str
    op: str
    key: str
    value: bytes
    timeout_ms: int
    def __init__(self, group_key: _Optional[str] = ..., op: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class CollectiveStoreResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class MooncakeReadRequest(_message.Message):
    __slots__ = ("pull", "done", "bytes_read", "error", "staged", "chunk_read")
    PULL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_READ_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    done: bool
    bytes_read: int
    error: str
    staged: bool
    chunk_read: bool
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., done: _Optional[bool] = ..., bytes_read: _Optional[int] = ..., error: _Optional[str] = ..., staged: _Optional[bool] = ..., chunk_read: _Optional[bool] = ...) -> None: ...

class MooncakeReadProgress(_message.Message):
    __slots__ = ("ready", "done", "chunk", "chunk_address")
    READY_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    done: bool
    chunk: ChunkHeader
    chunk_address: int
    def __init__(self, ready: _Optional[bool] = ..., done: _Optional[bool] = ..., chunk: _Optional[_Union[ChunkHeader, _Mapping]] = ..., chunk_address: _Optional[int] = ...) -> None: ...
