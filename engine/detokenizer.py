"""Incremental detokenization: exact for multi-byte UTF-8 split across tokens, linear in output length."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class TokenTexts:
    """Each token's text alone, as vLLM's logprobs name it (`decode([id])`; with `skip_special_tokens` a special
    token's is ""), with the leading spaces a SentencePiece decode strips from a piece that starts with its word
    marker put back; cached by id. Called with an id."""

    __slots__ = ("_hf", "_skip", "_texts")

    def __init__(self, hf_tokenizer, skip_special_tokens: bool = False) -> None:
        self._hf = hf_tokenizer
        self._skip = skip_special_tokens
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._hf.decode([token_id], skip_special_tokens=self._skip) or ""
            piece = self._hf.convert_ids_to_tokens(token_id)
            if text and isinstance(piece, str) and piece.startswith("\u2581"):
                marks = len(piece) - len(piece.lstrip("\u2581"))
                missing = marks - (len(text) - len(text.lstrip(" ")))
                if missing > 0:
                    text = " " * missing + text
            self._texts[token_id] = text
        return text


class IncrementalDetokenizer:
    __slots__ = ("_hf", "_tok", "_stream", "_pending", "_skip")

    def __init__(self, hf_tokenizer, skip_special_tokens: bool = True) -> None:
        self._hf = hf_tokenizer
        self._tok = hf_tokenizer.backend_tokenizer
        self._skip = skip_special_tokens  # special tokens (a chat template's markers) left out of the text
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # ids whose bytes do not yet form a complete character

    def step(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        text = self._stream.step(self._tok, token_id)
        if text:
            self._pending.clear()
            return text
        self._pending.append(token_id)
        return ""

    def flush(self) -> str:
        """At the end of a request: render a dangling partial character the way a one-shot decode does."""
        if not self._pending:
            return ""
        text = self._hf.decode(self._pending, skip_special_tokens=self._skip)
        self._pending.clear()
        return text
