"""Incremental detokenization for streaming, with stop strings, plus per-token strings for logprobs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

from engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into safe-to-show text deltas.

    Why a window: decoding only the tokens since the last clean character boundary keeps each step
    O(1) instead of re-decoding the whole output. Text ending in U+FFFD is held back because
    byte-level BPE splits multi-byte characters over tokens; the next token usually completes it.
    While stop strings are set, the last ``max(len(stop)) - 1`` characters are also held back, since
    they might be the start of a stop string (text once sent cannot be taken back).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # window start: a clean character boundary
        self._read = 0  # tokens already turned into text
        self.text = ""
        """All output text decoded so far, cut before the first stop string once one matched."""
        self._sent = 0  # characters of ``text`` already returned
        self.stopped = False
        """A stop string matched: the caller must stop the request (finish_reason 'stop')."""

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; returns the text that became safe to show (maybe empty)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._append(self._decode_new(final=False))
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """End of generation: returns everything still held back (incomplete characters included)."""
        if not self.stopped:
            self._append(self._decode_new(final=True))
        return self._take(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(prefix_text) and not final:
            return ""  # e.g. only a skipped special token so far
        if full.endswith(_REPLACEMENT) and not final:
            return ""  # incomplete UTF-8 sequence: wait for the rest
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(prefix_text) :]

    def _append(self, delta: str) -> None:
        if not delta:
            return
        # A stop string may straddle the old end of the text; matches wholly before it were seen already.
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-level alphabet (bytes_to_unicode), used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The raw bytes of one token (OpenAI's logprobs ``bytes``), also for tokens that are half a character."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if _REPLACEMENT not in text:
        return text.encode("utf-8")
    # Partial character: recover the bytes from the vocabulary entry (byte-level BPE or SentencePiece byte
    # fallback). ``_tok`` is the wrapped HF tokenizer; the wrapper does not expose id_to_token.
    raw = getattr(tokenizer, "_tok", None)
    piece = raw.id_to_token(token_id) if raw is not None else None
    if piece:
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        table = _unicode_to_byte()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
    return text.encode("utf-8")


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's string for logprobs; tokens that are not valid UTF-8 alone read ``bytes:\\xe4\\xb8``."""
    b = token_bytes(tokenizer, token_id)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)
