from tandem.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_KIND_UNSPECIFIED: _ClassVar[StateKind]
    RECURRENT: _ClassVar[StateKind]
    CONV: _ClassVar[StateKind]
STATE_KIND_UNSPECIFIED: StateKind
RECURRENT: StateKind
CONV: StateKind

class LanePullRequest(_message.Message):
    __slots__ = ("request_id", "lane")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lane: int
    def __init__(self, request_id: _Optional[str] = ..., lane: _Optional[int] = ...) -> None: ...

class StagePullRequest(_message.Message):
    __slots__ = ("request_id", "stage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stage: int
    def __init__(self, request_id: _Optional[str] = ..., stage: _Optional[int] = ...) -> None: ...

class StageStream(_message.Message):
    __slots__ = ("stage", "endpoint", "layers")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    endpoint: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage: _Optional[int] = ..., endpoint: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "consumer_fingerprint", "speculative", "max_message_bytes", "cache_salt", "aux_layer_ids", "lanes", "socket_lanes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    SOCKET_LANES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    consumer_fingerprint: _common_pb2.Fingerprint
    speculative: _common_pb2.SpeculativeParams
    max_message_bytes: int
    cache_salt: str
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    lanes: int
    socket_lanes: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., consumer_fingerprint: _Optional[_Union[_common_pb2.Fingerprint, _Mapping]] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeParams, _Mapping]] = ..., max_message_bytes: _Optional[int] = ..., cache_salt: _Optional[str] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ..., lanes: _Optional[int] = ..., socket_lanes: bool = ...) -> None: ...

class HandoffChunk(_message.Message):
    __slots__ = ("header", "kv", "state", "block_hashes", "first_token", "end", "aux_hidden")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    AUX_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    header: HandoffHeader
    kv: KVPagePart
    state: StatePart
    block_hashes: BlockHashes
    first_token: FirstToken
    end: HandoffEnd
    aux_hidden: AuxHidden
    def __init__(self, header: _Optional[_Union[HandoffHeader, _Mapping]] = ..., kv: _Optional[_Union[KVPagePart, _Mapping]] = ..., state: _Optional[_Union[StatePart, _Mapping]] = ..., block_hashes: _Optional[_Union[BlockHashes, _Mapping]] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., end: _Optional[_Union[HandoffEnd, _Mapping]] = ..., aux_hidden: _Optional[_Union[AuxHidden, _Mapping]] = ...) -> None: ...

class AuxHidden(_message.Message):
    __slots__ = ("layer_ids", "tensor")
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    tensor: TensorBytes
    def __init__(self, layer_ids: _Optional[_Iterable[int]] = ..., tensor: _Optional[_Union[TensorBytes, _Mapping]] = ...) -> None: ...

class HandoffHeader(_message.Message):
    __slots__ = ("producer_fingerprint", "num_prompt_tokens", "page_size", "attention_layers", "kda_layers", "stage_streams", "lanes", "data_endpoint")
    PRODUCER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KDA_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STAGE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    producer_fingerprint: _common_pb2.Fingerprint
    num_prompt_tokens: int
    page_size: int
    attention_layers: _containers.RepeatedScalarFieldContainer[int]
    kda_layers: _containers.RepeatedScalarFieldContainer[int]
    stage_streams: _containers.RepeatedCompositeFieldContainer[StageStream]
    lanes: int
    data_endpoint: str
    def __init__(self, producer_fingerprint: _Optional[_Union[_common_pb2.Fingerprint, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., attention_layers: _Optional[_Iterable[int]] = ..., kda_layers: _Optional[_Iterable[int]] = ..., stage_streams: _Optional[_Iterable[_Union[StageStream, _Mapping]]] = ..., lanes: _Optional[int] = ..., data_endpoint: _Optional[str] = ...) -> None: ...

class TensorBytes(_message.Message):
    __slots__ = ("dtype", "shape", "offset", "total_bytes", "data", "crc32")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    data: bytes
    crc32: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class KVPagePart(_message.Message):
    __slots__ = ("layer", "page_index", "num_tokens", "tensor")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    layer: int
    page_index: int
    num_tokens: int
    tensor: TensorBytes
    def __init__(self, layer: _Optional[int] = ..., page_index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., tensor: _Optional[_Union[TensorBytes, _Mapping]] = ...) -> None: ...

class StatePart(_message.Message):
    __slots__ = ("layer", "kind", "tensor")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kind: StateKind
    tensor: TensorBytes
    def __init__(self, layer: _Optional[int] = ..., kind: _Optional[_Union[StateKind, str]] = ..., tensor: _Optional[_Union[TensorBytes, _Mapping]] = ...) -> None: ...

class BlockHashes(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token", "has_logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.TokenLogprob
    has_logprob: bool
    def __init__(self, token: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., has_logprob: bool = ...) -> None: ...

class HandoffEnd(_message.Message):
    __slots__ = ("num_messages", "payload_bytes", "num_kv_parts", "num_state_tensors")
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PARTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    num_messages: int
    payload_bytes: int
    num_kv_parts: int
    num_state_tensors: int
    def __init__(self, num_messages: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., num_kv_parts: _Optional[int] = ..., num_state_tensors: _Optional[int] = ...) -> None: ...
