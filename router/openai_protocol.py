"""OpenAI wire format: request bodies -> GenerationRequest (validated), and response/chunk dicts.

Covers /v1/completions and /v1/chat/completions with the fields documented in parse_completion /
parse_chat. Unknown fields are ignored (clients send extras); known-but-unsupported ones that would
change the result (n > 1, penalties, logit_bias, tools...) are rejected rather than silently dropped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.request import TokenLogprobs
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.tokenizer import Tokenizer
from router.backend import GenerationRequest, SpeculativeParams
from router.detokenizer import token_bytes, token_text

MAX_STOP_STRINGS = 4
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
Kind = Literal["completion", "chat"]


class InvalidRequest(Exception):
    """A request the client must fix. ``code`` is the HTTP status; ``error_code`` OpenAI's string code."""

    def __init__(self, message: str, param: str | None = None, code: int = 400, error_code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.error_code = error_code


def error_body(message: str, status: int, param: str | None = None, error_code: str | None = None) -> dict[str, Any]:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": error_code}}


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request plus the output options the response needs."""

    kind: Kind
    model: str
    gen: GenerationRequest
    stream: bool = False
    include_usage: bool = False
    echo_text: str | None = None
    """Completions ``echo``: the prompt text that prefixes the output."""
    logprobs: int | None = None
    """None: no logprobs; else this many top alternatives per token."""
    stop: tuple[str, ...] = ()
    created: int = 0

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.gen.prompt_token_ids)


# ---- typed field access (every error names the field) ----


def _tname(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict[str, Any], key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise InvalidRequest(f"'{key}' must be an integer, got {_tname(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise InvalidRequest(f"'{key}' must be {rng}, got {v}", key)
    return v


def _opt_float(body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidRequest(f"'{key}' must be a number, got {_tname(v)}", key)
    ok = (lo < v if lo_open else lo <= v) and v <= hi  # also rejects NaN
    if not ok:
        raise InvalidRequest(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def _opt_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{key}' must be a boolean, got {_tname(v)}", key)
    return v


def _unsupported(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param, error_code="unsupported_parameter")


def _check_unsupported(body: dict[str, Any]) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v is not None and v != 0:
            raise _unsupported(f"'{key}' is not supported (only 0)", key)
    if body.get("best_of") not in (None, 1):
        raise _unsupported("'best_of' is not supported (only 1)", "best_of")
    if body.get("logit_bias"):
        raise _unsupported("'logit_bias' is not supported", "logit_bias")


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' accepts at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(dict.fromkeys(stops))


def _token_ids(v: Any, key: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise InvalidRequest(f"'{key}' must be a list of integer token ids", key)
    if bad := [t for t in v if not 0 <= t < vocab_size]:
        raise InvalidRequest(f"'{key}' has token ids outside [0, {vocab_size}): {bad[:5]}", key)
    return list(v)


def _common_head(body: Any, model_name: str, required: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object")
    for key in ("model", required):
        if body.get(key) is None:
            raise InvalidRequest(f"Missing required parameter: '{key}'", key, error_code="missing_required_parameter")
    if not isinstance(body["model"], str):
        raise InvalidRequest(f"'model' must be a string, got {_tname(body['model'])}", "model")
    if body["model"] != model_name:
        raise InvalidRequest(
            f"The model `{body['model']}` does not exist (this server serves `{model_name}`)",
            "model",
            code=404,
            error_code="model_not_found",
        )
    n = _opt_int(body, "n")
    if n not in (None, 1):
        raise InvalidRequest(f"Only n=1 is supported, got n={n}", "n", error_code="unsupported_value")
    _check_unsupported(body)
    return body


def _build(
    kind: Kind,
    body: dict[str, Any],
    prompt_ids: list[int],
    prompt_param: str,
    tokenizer: Tokenizer,
    model_name: str,
    max_model_len: int,
    logprobs: int | None,
    echo_text: str | None = None,
) -> ParsedRequest:
    """Fields shared by both endpoints: lengths, sampling, stop, streaming, speculative decoding."""
    stream = _opt_bool(body, "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict):
            raise InvalidRequest(f"'stream_options' must be an object, got {_tname(opts)}", "stream_options")
        include_usage = _opt_bool(opts, "include_usage")

    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _opt_int(body, key, lo=1)
    n_prompt = len(prompt_ids)
    if n_prompt >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {n_prompt} "
            "tokens, which leaves no room for a completion. Please shorten the prompt.",
            prompt_param,
            error_code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = max_model_len - n_prompt  # the rest of the context window
    elif n_prompt + max_tokens > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the prompt or '{key}'.",
            key,
            error_code="context_length_exceeded",
        )

    stop_ids = body.get("stop_token_ids")
    seed = _opt_int(body, "seed", lo=-(2**63), hi=2**64 - 1)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_opt_float(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_opt_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            top_k=_opt_int(body, "top_k", lo=-1) or 0,
            seed=seed,
            stop_token_ids=tuple(_token_ids(stop_ids, "stop_token_ids", tokenizer.vocab_size)) if stop_ids else (),
            ignore_eos=_opt_bool(body, "ignore_eos"),
            logprobs=logprobs,
        )
    except ValueError as e:  # defence in depth: SamplingParams has its own checks
        raise InvalidRequest(str(e)) from None

    n_spec = _opt_int(body, "num_speculative_tokens", lo=0)
    salt = body.get("cache_salt", "")  # vLLM's extension: a separate prefix-cache namespace
    if not isinstance(salt, str):
        raise InvalidRequest(f"cache_salt must be a string, got {_tname(salt)}", "cache_salt")
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    gen = GenerationRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        params=params,
        speculative=SpeculativeParams(n_spec) if n_spec is not None else None,
        cache_salt=salt,
    )
    return ParsedRequest(
        kind=kind,
        model=model_name,
        gen=gen,
        stream=stream,
        include_usage=include_usage,
        echo_text=echo_text,
        logprobs=logprobs,
        stop=_stop_strings(body),
        created=int(time.time()),
    )


def _prompt_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """prompt: a string, a list of token ids, or a one-element batch of either."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > 1:
            raise InvalidRequest(
                f"Batched prompts are not supported ({len(prompt)} prompts); send one prompt per request",
                "prompt",
                error_code="unsupported_value",
            )
        return _prompt_ids(prompt[0], tokenizer)
    elif isinstance(prompt, list):
        ids = _token_ids(prompt, "prompt", tokenizer.vocab_size)
    else:
        raise InvalidRequest(f"'prompt' must be a string or a list of token ids, got {_tname(prompt)}", "prompt")
    if not ids:
        raise InvalidRequest("'prompt' must not be empty", "prompt")
    return ids


def parse_completion(body: Any, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> ParsedRequest:
    """POST /v1/completions body -> ParsedRequest. Raises InvalidRequest."""
    body = _common_head(body, model_name, "prompt")
    if body.get("suffix"):
        raise _unsupported("'suffix' is not supported", "suffix")
    logprobs = _opt_int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    echo = _opt_bool(body, "echo")
    if echo and logprobs is not None:
        raise _unsupported("'echo' together with 'logprobs' is not supported (no prompt logprobs)", "echo")
    ids = _prompt_ids(body["prompt"], tokenizer)
    echo_text = None
    if echo:
        p = body["prompt"][0] if isinstance(body["prompt"], list) and len(body["prompt"]) == 1 else body["prompt"]
        echo_text = p if isinstance(p, str) else tokenizer.decode(ids)
    return _build("completion", body, ids, "prompt", tokenizer, model_name, max_model_len, logprobs, echo_text)


def _message_content(m: dict[str, Any], where: str) -> str:
    content = m.get("content")
    if content is None:
        if m.get("role") == "assistant":
            return ""
        raise InvalidRequest(f"Missing required parameter: '{where}.content'", f"{where}.content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}.content' must be a string or a list of parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f'\'{where}.content[{j}]\' must be {{"type": "text", "text": ...}}; only text parts are supported',
                f"{where}.content",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def parse_chat(body: Any, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> ParsedRequest:
    """POST /v1/chat/completions body -> ParsedRequest (prompt from the tokenizer's chat template)."""
    body = _common_head(body, model_name, "messages")
    if body.get("tools"):
        raise _unsupported("'tools' are not supported", "tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _unsupported("only response_format {'type': 'text'} is supported", "response_format")
    raw = body["messages"]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list", "messages")
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"'{where}' must be an object, got {_tname(m)}", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"'{where}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        messages.append({"role": role, "content": _message_content(m, where)})

    want = _opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top and not want:
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # template errors (raise_exception, jinja) are the request's fault
        raise InvalidRequest(f"Could not apply the chat template: {e}", "messages") from None
    # Like HF apply_chat_template(tokenize=True): the template places BOS itself.
    ids = tokenizer.encode(text, add_special_tokens=False)
    logprobs = (top or 0) if want else None
    return _build("chat", body, ids, "messages", tokenizer, model_name, max_model_len, logprobs)


# ---- responses ----


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(tok: Tokenizer, lps: Sequence[TokenLogprobs], offsets: Sequence[int]) -> dict[str, Any]:
    """Legacy completions shape: parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""
    return {
        "tokens": [token_text(tok, lp.token_id) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(tok, t): p for t, p in lp.top} for lp in lps],
        "text_offset": list(offsets),
    }


def chat_logprobs(tok: Tokenizer, lps: Sequence[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tok, token_id), "logprob": logprob, "bytes": list(token_bytes(tok, token_id))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(*t) for t in lp.top]} for lp in lps]}


def _envelope(p: ParsedRequest, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": p.request_id,
        "object": obj,
        "created": p.created,
        "model": p.model,
        "system_fingerprint": None,
        "choices": choices,
    }


def full_response(
    p: ParsedRequest, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None, completion_tokens: int
) -> dict[str, Any]:
    """Non-streaming body: text_completion or chat.completion."""
    if p.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        body = _envelope(p, "text_completion", [choice])
    else:
        message = {"role": "assistant", "content": text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        body = _envelope(p, "chat.completion", [choice])
    body["usage"] = usage(p.prompt_tokens, completion_tokens)
    return body


def chunk(
    p: ParsedRequest,
    text: str | None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One streaming chunk. Chat: ``text=None`` gives an empty delta (the finish chunk); ``role`` adds
    role="assistant" (first chunk)."""
    if p.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        body = _envelope(p, "text_completion", [choice])
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        body = _envelope(p, "chat.completion.chunk", [choice])
    if p.include_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last when include_usage is set
    return body


def usage_chunk(p: ParsedRequest, completion_tokens: int) -> dict[str, Any]:
    """The extra last chunk for stream_options.include_usage: no choices, just usage."""
    obj = "text_completion" if p.kind == "completion" else "chat.completion.chunk"
    return {**_envelope(p, obj, []), "usage": usage(p.prompt_tokens, completion_tokens)}
