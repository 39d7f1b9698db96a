from tandem.rpc import common_pb2 as _common_pb2
from tandem.rpc import prefill_pb2 as _prefill_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "params", "speculative", "prefill_endpoint", "prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    params: _common_pb2.SamplingParams
    speculative: _common_pb2.SpeculativeParams
    prefill_endpoint: str
    prefill: _prefill_pb2.PrefillRequest
    def __init__(self, request_id: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeParams, _Mapping]] = ..., prefill_endpoint: _Optional[str] = ..., prefill: _Optional[_Union[_prefill_pb2.PrefillRequest, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "num_drafted", "num_accepted", "num_verify_steps")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finished: bool
    finish_reason: str
    num_drafted: int
    num_accepted: int
    num_verify_steps: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finished: bool = ..., finish_reason: _Optional[str] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., num_verify_steps: _Optional[int] = ...) -> None: ...
