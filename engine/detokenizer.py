"""Incremental detokenization: exact for multi-byte UTF-8 split across tokens, linear in output length."""
from __future__ import annotations

import json

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


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's pieces (GPT-2's, Llama 3's, Qwen's): each byte stands as a printable character, those of
    printable Latin-1 as themselves and the rest from U+0100 up, in byte order. Character -> its byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shown, extra = {}, 0
    for b in range(256):
        if b in kept:
            shown[chr(b)] = b
        else:
            shown[chr(256 + extra)] = b
            extra += 1
    return shown


_BYTE_OF = _byte_alphabet()


def _decoder_kinds(hf_tokenizer) -> set[str]:
    """The kinds of the tokenizer's decoders (a Sequence's parts too), from its backend's JSON; empty where it has
    none to read (a slow tokenizer)."""
    try:
        spec = json.loads(hf_tokenizer.backend_tokenizer.to_str()).get("decoder")
    except Exception:  # noqa: BLE001 - no backend tokenizer: no decoder known
        return set()
    kinds, todo = set(), [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            kinds.add(d.get("type"))
            todo.extend(d.get("decoders") or ())
    return kinds


class TokenBytes:
    """Each token's bytes, for guided decoding (`core.json_grammar.feed`): a character's UTF-8 may be split between
    tokens, whose texts alone say only U+FFFD. A byte-level BPE's piece mapped back to its bytes, a SentencePiece
    byte piece (`<0xE6>`) as its byte, an added token as its text's UTF-8 (a special one as none: it writes no
    text), and any other token as its text's UTF-8 (`TokenTexts`), or as none where that text holds a U+FFFD its
    piece does not (bytes this class cannot know: the token never fits). Cached by id. Called with an id."""

    __slots__ = ("_hf", "_texts", "_bytes", "_byte_level", "_byte_pieces", "_special", "_added", "_first")

    def __init__(self, hf_tokenizer) -> None:
        self._hf = hf_tokenizer
        self._texts = TokenTexts(hf_tokenizer, skip_special_tokens=True)
        self._bytes: dict[int, bytes] = {}
        kinds = _decoder_kinds(hf_tokenizer)
        self._byte_level = "ByteLevel" in kinds
        self._byte_pieces = "ByteFallback" in kinds
        added = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
        self._special = {i for i, t in added.items() if getattr(t, "special", False)} \
            | set(getattr(hf_tokenizer, "all_special_ids", None) or ())
        self._added = {i: str(getattr(t, "content", t)) for i, t in added.items()}
        self._first: dict[int, object] = {}

    def first_bytes(self, width: int):
        """A LongTensor [width, 2]: each token's first two bytes, 256 for one it has not (a special token, an id past
        the tokenizer's: none); computed once per width (a pass over the vocabulary)."""
        got = self._first.get(width)
        if got is None:
            import torch

            firsts = []
            for t in range(width):
                try:
                    b = self(t)
                except Exception:  # noqa: BLE001 - an id the tokenizer cannot name: no bytes
                    b = b""
                firsts.append((b[0] if b else 256, b[1] if len(b) > 1 else 256))
            got = self._first[width] = torch.tensor(firsts, dtype=torch.long).reshape(width, 2)
        return got

    def __call__(self, token_id: int) -> bytes:
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = self._of(token_id)
        return got

    def _of(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece:
            if self._byte_level and all(c in _BYTE_OF for c in piece):
                return bytes(_BYTE_OF[c] for c in piece)
            if self._byte_pieces and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        text = self._texts(token_id)
        if "\ufffd" in text and not (isinstance(piece, str) and "\ufffd" in piece):
            return b""
        return text.encode("utf-8")


PRIME_MIN, PRIME_MAX = 4, 24  # the prompt's last tokens a reply's decoding starts after (vLLM's: 4 to 23)


class IncrementalDetokenizer:
    """A reply's text token by token, decoded after the prompt's last tokens (`prompt_ids`), as vLLM's: a
    SentencePiece decoder (Llama 2's, Mistral's) strips the space of a sequence's first word, so a reply decoded on
    its own would lose the space before its first word (`"Paris."` after "The capital of France is", not
    `" Paris."`). The shortest suffix of PRIME_MIN to PRIME_MAX tokens whose text is whole (no U+FFFD: no character
    cut at its start) is fed first and its text dropped; where none is, the last PRIME_MAX tokens (a prompt that ends
    inside a character, whose rest the reply's first tokens bring, or one that holds a U+FFFD)."""

    __slots__ = ("_hf", "_tok", "_stream", "_pending", "_skip")

    def __init__(self, hf_tokenizer, skip_special_tokens: bool = True, prompt_ids=()) -> None:
        self._hf = hf_tokenizer
        self._tok = hf_tokenizer.backend_tokenizer
        self._skip = skip_special_tokens  # special tokens (a chat template's markers) left out of the text
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # ids whose bytes do not yet form a complete character
        try:
            for t in self._prime(prompt_ids):
                self._stream.step(self._tok, t)
        except Exception:  # noqa: BLE001 - (as `step`'s): no priming then
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _prime(self, prompt_ids) -> list[int]:
        ids = list(prompt_ids[-PRIME_MAX:])
        for n in range(min(PRIME_MIN, len(ids)), len(ids) + 1):
            suffix = ids[-n:]
            if "\ufffd" not in self._tok.decode(suffix, skip_special_tokens=self._skip):
                return suffix
        # (none whole: a prompt of token ids that ends inside a character, or a U+FFFD the prompt holds. Its last
        # tokens still say where the reply's text starts, and the reply's first tokens complete a cut character)
        return ids

    def step(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete). Where tokenizers' DecodeStream
        raises (a ByteFallback decoder's, Llama 2's or Mistral's, on a run of bytes that turns invalid: "Invalid
        prefix encountered"), the stream starts over from this token, as vLLM's does: the text out stays out."""
        try:
            text = self._stream.step(self._tok, token_id)
        except Exception:  # noqa: BLE001 - the Rust side's error (a plain Exception), or an id it cannot decode
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            self._pending.clear()
            try:
                text = self._stream.step(self._tok, token_id)
            except Exception:  # noqa: BLE001 - not even alone: its text is left out
                return ""
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
