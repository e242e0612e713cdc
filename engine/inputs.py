"""Turns what a caller sends (text, token ids or chat turns) into a validated `Request`: the only place a
prompt is tokenized. Chat uses the tokenizer's own template; models without one get `Role: content` lines
followed by `Assistant:`. A text prompt gets the tokenizer's special tokens (a BOS) unless told otherwise, a chat
prompt only where asked (its template writes them): `PromptOptions`."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from core.messages import ChatTurn, ContextLengthExceeded, PromptOptions, PromptTooLong
from core.request import SLO, LoraSource, Request
from core.sampling import MAX_LOGPROBS, SamplingParams, is_int64, max_logprobs_of
from engine.lora import LoraError, LoraServing, LoraSpec, check_adapter

Prompt = str | Sequence[int]
MAX_BAD_WORD_TOKENS = 64  # a bad word's tokens (each step compares a row's last tokens with every word's)
THINK_TAIL_TOKENS = 64  # the prompt's last tokens read for an opened or closed <think> (`prompt_thinking`)
LONG_TEXT_CHARS = 32_768  # a prompt text longer than this is tokenized off the caller's thread where it has an event
# loop (`deployments.replica`), through a call that lets that thread run meanwhile (`prompt_encoder`)


def prompt_encoder(tokenizer, add_special_tokens: bool = False) -> Callable[[str], list[int]]:
    """text -> ids, as `tokenizer.encode(text, add_special_tokens=...)`. A fast tokenizer's Rust backend is
    called directly: the same ids without the Python wrapper, which was most of add_request's own cost. A long text
    goes through its batch call, which lets other threads run meanwhile (its single call holds the interpreter: a
    text of a megabyte, a second, stalled every thread of the process, a replica's event loop too)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return lambda text: tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode(text: str) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return encode


def render_plain_chat(messages: Sequence[ChatTurn], options: PromptOptions = PromptOptions()) -> str:
    """The fallback chat format: one `Role: content` line per message, then `Assistant:` (with
    add_generation_prompt; with continue_final_message the last message's line is the end, left open)."""
    lines = [f"{m.role.capitalize()}: {m.content}" for m in messages]
    return "\n".join(lines + (["Assistant:"] if options.add_generation_prompt else []))


def render_chat(tokenizer: Any, messages: Sequence[ChatTurn], options: PromptOptions = PromptOptions()) -> str:
    """A conversation as the prompt a chat request becomes: the request's own chat template or the tokenizer's (with
    the assistant's turn opened, or its last message continued, as `options` say, and their template variables),
    else
    `render_plain_chat`. ValueError where the template refuses the conversation (its roles, a last message it cannot
    continue, ...)."""
    options.check()
    if not options.chat_template and not getattr(tokenizer, "chat_template", None):
        return render_plain_chat(messages, options)
    turns = _as_template_reads(options.chat_template or tokenizer.chat_template, [_turn(m) for m in messages])
    tools = json.loads(options.tools) if options.tools else None
    documents = {"documents": json.loads(options.documents)} if options.documents else {}
    own = {"chat_template": options.chat_template} if options.chat_template else {}
    try:
        return tokenizer.apply_chat_template(
            turns, tools=tools, tokenize=False, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **own, **documents,
            **(options.chat_template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - the template's own refusal (jinja's raise_exception, a bad variable)
        raise ValueError(f"the chat template cannot render these messages: {e}") from None


def _as_template_reads(template: Any, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's: where a template never names the `developer` role (OpenAI's newer name for the system's), developer
    messages are system messages, and the system messages are then one, first (their texts joined by a blank line),
    as templates that take a system message only first need."""
    if not any(t["role"] == "developer" for t in turns) or "'developer'" in str(template) \
            or '"developer"' in str(template):
        return turns
    turns = [{**t, "role": "system"} if t["role"] == "developer" else t for t in turns]
    systems = [i for i, t in enumerate(turns) if t["role"] == "system"]
    if systems == [0]:
        return turns
    text = "\n\n".join(turns[i]["content"] for i in systems if turns[i]["content"])
    return [{"role": "system", "content": text}, *(t for t in turns if t["role"] != "system")]


def _turn(m: ChatTurn) -> dict[str, Any]:
    """A message as a chat template reads it: an assistant's tool calls with their arguments as objects (templates
    write them out as JSON: vLLM parses the OpenAI arguments' JSON text likewise), a tool reply's call id, and the
    message's `name` where it has one (as vLLM passes it: a template may show who speaks, or a tool's name)."""
    turn: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = json.loads(m.tool_calls)
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else None
                except ValueError:
                    pass  # (not JSON: the template gets the text)
            if isinstance(fn, dict) and fn.get("arguments", None) is None:  # none (a call of no arguments sent
                fn["arguments"] = {}  # back as "", null or "null"): an empty object, as vLLM gives templates
        turn["tool_calls"] = calls
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        turn["name"] = m.name
    if m.reasoning is not None:  # (under both names a template may read, as vLLM passes it: Qwen3's shows it)
        turn["reasoning_content"] = turn["reasoning"] = m.reasoning
    return turn


def check_priority(priority: object) -> None:
    """ValueError unless `priority` is an integer (an int64, vLLM's)."""
    if not is_int64(priority):
        raise ValueError(f"priority must be an integer in [-2**63, 2**63), got {priority!r}")


class InputProcessor:
    def __init__(self, tokenizer, vocab_limit: int, eos_token_ids: Sequence[int], max_model_len: int,
                 kv_capacity_tokens: int, reject_max_tokens_over_context: bool = False,
                 lora: LoraServing | None = None, priority_scheduling: bool = False,
                 default_max_tokens: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> None:
        """`reject_max_tokens_over_context`: a max_tokens beyond the context left is a `ContextLengthExceeded` (an
        OpenAI server's 400, as vLLM's), else the reply just ends at the window (an in-process engine's way).
        `lora`: the LoRA adapters the engine serves (None: none). `priority_scheduling`: the scheduler ranks requests
        by their `priority` (SchedulerConfig.scheduling_policy); else every request is of priority 0 (a client's is
        accepted and has no effect, as vLLM's). `default_max_tokens`: the model's cap on a reply whose request sets
        none (its generation_config's max_new_tokens, vLLM's --generation-config auto), within the context left.
        `max_logprobs`: the most likely tokens a request may ask the log-probabilities of (vLLM's; -1: the
        vocabulary)."""
        self.lora = lora
        self.default_max_tokens = default_max_tokens
        self.priority_scheduling = priority_scheduling
        self.tokenizer = tokenizer
        self.encode = prompt_encoder(tokenizer)
        self.encode_special = prompt_encoder(tokenizer, add_special_tokens=True)
        self.vocab_limit = vocab_limit
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self.reject_max_tokens_over_context = reject_max_tokens_over_context
        self.max_logprobs = max_logprobs_of(max_logprobs, vocab_limit)

    def check_lora(self, name: str, path: str) -> int:
        """Whether the folder `path` holds an adapter this engine can serve as `name` (vLLM's /v1/load_lora_adapter
        asks before it registers one): its rank, else LoraError saying why. Reads its config and its tensors'
        shapes, on the caller's thread."""
        if self.lora is None:
            raise LoraError("this engine was not started to serve LoRA adapters (enable_lora)")
        return check_adapter(LoraSpec(name, path), self.lora.shape, self.lora.max_rank)

    def render_chat(self, messages: Sequence[ChatTurn], options: PromptOptions = PromptOptions()) -> str:
        return render_chat(self.tokenizer, messages, options)

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens unless told not to), or token ids checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            try:
                ids = (self.encode_special if add_special_tokens else self.encode)(prompt)
            except (TypeError, UnicodeError) as e:  # e.g. lone surrogates
                raise ValueError(f"prompt is not valid text: {e}") from None
            # a tokenizer with tokens the checkpoint has no rows for: on CUDA, an embedding read past its rows
            # would end the device context, and with it every request's
            if ids and max(ids) >= self.vocab_limit:
                raise ValueError(f"prompt has token id {max(ids)}, beyond the model's {self.vocab_limit} "
                                 "embedding rows (the tokenizer has tokens the checkpoint lacks)")
            return ids or [self.eos_token_ids[0]]
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        self._check_ids(prompt, "prompt token ids")
        return list(prompt)

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        """ValueError unless every one of `ids` is a token id of the model's vocabulary."""
        vocab = self.vocab_limit
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"{what} must be integers in [0, {vocab})")

    def prompt_ids(self, prompt: Prompt | None, messages: Sequence[ChatTurn] | None = None,
                   options: PromptOptions | None = None, empty: bool = False) -> list[int]:
        """The token ids a generation would take for this prompt or chat (`process`'s), for vLLM's /tokenize;
        ValueError on bad input. With `truncate_prompt_tokens`, its last k (-1: as many as the context window takes
        with a token of reply). With `empty`, an empty text prompt is the tokenizer's own ids alone (/tokenize's, as
        vLLM's)."""
        return self.prompt_ids_and_text(prompt, messages, options, empty)[0]

    def prompt_ids_and_text(self, prompt: Prompt | None, messages: Sequence[ChatTurn] | None,
                            options: PromptOptions | None, empty: bool = False) -> tuple[list[int], str | None]:
        """`prompt_ids`' ids, and a chat's prompt as its template rendered it (else None)."""
        options = (options or PromptOptions()).check()
        k = options.truncate_prompt_tokens
        if k is not None and k > self.max_model_len:  # (vLLM's 400)
            raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                             f"({self.max_model_len}); select a smaller truncation size")
        special = options.add_special_tokens
        if messages is not None:
            if special is None:  # (a chat template writes its own; the plain fallback none: the tokenizer's)
                special = not options.chat_template and not getattr(self.tokenizer, "chat_template", None)
            prompt = self.render_chat(messages, options)
        else:
            special = special is not False
        if empty and messages is None and prompt == "":  # (/tokenize's: the tokenizer's own ids; a generation refuses)
            ids = (self.encode_special if special else self.encode)("")
        else:
            ids = self.tokenize(prompt, add_special_tokens=special)
        if k is not None:
            keep = self.max_model_len - 1 if k == -1 else k
            ids = ids[-keep:] if len(ids) > keep else ids
        return ids, (prompt if messages is not None else None)  # type: ignore[return-value]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids (special tokens kept, as vLLM's /detokenize); ValueError for ids outside the
        vocabulary."""
        self._check_ids(ids, "tokens")
        return self.tokenizer.decode(list(ids))

    def bad_words_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token ids: each word as at the text's start, and after a space where that makes as
        many tokens with a different first one (vLLM's rule), so that a word is banned at the start and mid-text.
        ValueError for a word of more than `MAX_BAD_WORD_TOKENS` tokens or of tokens past the model's vocabulary."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.encode(word.lstrip()))
            spaced = tuple(self.encode(" " + word.lstrip()))
            for ids in (bare, spaced) if len(spaced) == len(bare) and spaced[:1] != bare[:1] else (bare,):
                if len(ids) > MAX_BAD_WORD_TOKENS or any(t >= self.vocab_limit for t in ids):
                    raise ValueError(f"bad_words: {word[:40]!r} is more than {MAX_BAD_WORD_TOKENS} tokens, or has "
                                     "tokens past the model's vocabulary")
                if ids:
                    out.append(ids)
        return tuple(dict.fromkeys(out))

    def prompt_thinking(self, ids: Sequence[int], messages: Sequence[ChatTurn] | None = None,
                        options: PromptOptions | None = None, rendered: str | None = None) -> str | None:
        """Where the prompt's end leaves a reasoning model's thinking (`RequestOutput.prompt_thinking`): "closed"
        (`</think>` last: a template that switched the thinking off), "open" (`<think>` last: the reply starts
        inside it), else None. Of a chat's prompt whose template opens the assistant's turn (`messages`, `options`;
        `rendered`: the prompt as rendered, else rendered here), only what the template writes to open it counts
        (the conversation rendered with and without that turn: a user may name the tags, and the turn a template
        opens may follow from an earlier message, as SmolLM3's system prompt's /no_think); else the prompt's last
        tokens (a message the reply goes on from is its own)."""
        tail = None
        if rendered is not None and "think>" not in rendered:  # (neither tag: none in what opens the turn either)
            return None
        if messages and options is not None and options.add_generation_prompt and not options.continue_final_message:
            try:
                opened = rendered if rendered is not None else self.render_chat(messages, options)
                bare = self.render_chat(messages, dataclasses.replace(options, add_generation_prompt=False))
                # (a template that writes nothing to open the turn, or writes it whatever it is asked: the tokens)
                tail = opened[len(bare):] if opened.startswith(bare) and len(opened) > len(bare) else None
            except (ValueError, TypeError):
                tail = None
        if tail is None:
            tail = self.tokenizer.decode(list(ids[-THINK_TAIL_TOKENS:]))
        opened, closed = tail.rfind("<think>"), tail.rfind("</think>")
        if closed > opened:
            return "closed"
        return "open" if opened >= 0 else None

    def process(self, prompt: Prompt | None, params: SamplingParams | None, slo: SLO | None,
                request_id: str | None, messages: Sequence[ChatTurn] | None = None,
                options: PromptOptions | None = None, lora: str | None = None,
                cache_salt: str | None = None, lora_source: LoraSource | None = None, priority: int = 0,
                read_thinking: bool = False) -> Request:
        """Validate and tokenize; ValueError with a client-facing message on bad input. The request arrives when
        this is called: its TTFT SLO counts the time its prompt takes to render and tokenize (a long one's, ms)."""
        arrival_s = time.monotonic()
        options = options or PromptOptions()
        if lora is not None and (self.lora is None or (lora_source is None and not self.lora.serves(lora))):
            names = sorted(self.lora.names) if self.lora is not None else []
            raise ValueError(f"no LoRA adapter named {lora!r} is served here"
                             + (f" (these are: {', '.join(names)})" if names else ""))
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        check_priority(priority)
        params = (params or SamplingParams()).validate()
        for name in ("logprobs", "prompt_logprobs"):  # (vLLM's 400)
            if (n := getattr(params, name)) is not None and n > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs} (the server's max_logprobs), got {n}")
        if any(t >= self.vocab_limit for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.vocab_limit}")
        if any(t >= self.vocab_limit for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {self.vocab_limit}")
        if any(t >= self.vocab_limit for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be below the vocabulary size {self.vocab_limit}")
        slo = (slo or SLO()).validate()
        ids, rendered = self.prompt_ids_and_text(prompt, messages, options)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise PromptTooLong(len(ids), limit)
        if len(ids) + 1 > self.kv_capacity_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the KV cache capacity of "
                             f"{self.kv_capacity_tokens} tokens")
        if self.reject_max_tokens_over_context and params.max_tokens is not None \
                and len(ids) + params.max_tokens > limit:  # a 400 naming the limit, as vLLM
            raise ContextLengthExceeded(params.max_tokens, limit, len(ids))
        rest = max(1, limit - len(ids))
        if params.max_tokens is None and params.min_tokens > rest:  # as vLLM, whose cap is then the context left
            raise ValueError(f"min_tokens must be at most the context left for the reply, {rest} tokens (this "
                             f"model's maximum context length is {limit} tokens and the prompt has {len(ids)}), "
                             f"got {params.min_tokens}")
        if params.max_tokens is None and self.default_max_tokens:  # (the model's; a min_tokens above it wins)
            params = dataclasses.replace(params, max_tokens=min(rest, max(self.default_max_tokens, params.min_tokens)))
        if params.max_tokens is None or params.max_tokens > rest:
            # None: OpenAI's chat default, the rest of the context window. Beyond it (max_tokens_over_context=clamp):
            # the reply ends at the window, so that is its cap, and the scheduler plans with the cap it will meet
            params = dataclasses.replace(params, max_tokens=rest, min_tokens=min(params.min_tokens, rest))
        # where the prompt leaves the thinking: asked for its stream, and a guided reply's as the prompt leaves it
        # (closed already: the format holds from the first token; open: the reply starts inside it; else as asked)
        state = self.prompt_thinking(ids, messages, options, rendered) \
            if read_thinking or params.thinking is not None else None
        if params.thinking is not None and state is not None:
            params = dataclasses.replace(params, thinking=None if state == "closed" else "open")
        if params.min_tokens and params.allowed_token_ids and \
                set(params.allowed_token_ids) <= {*self.eos_token_ids, *params.stop_token_ids}:
            raise ValueError("min_tokens bans the stop tokens below it, and allowed_token_ids allows nothing else")
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        bad = self.bad_words_ids(params.bad_words)
        if params.allowed_token_ids and set(params.allowed_token_ids) <= {w[0] for w in bad if len(w) == 1}:
            raise ValueError("bad_words ban every token allowed_token_ids allows")
        if params.min_tokens and params.allowed_token_ids and set(params.allowed_token_ids) <= {
                *self.eos_token_ids, *params.stop_token_ids, *(w[0] for w in bad if len(w) == 1)}:
            raise ValueError("bad_words and min_tokens (which bans the stop tokens below it) ban every token "
                             "allowed_token_ids allows")
        req = Request(rid, ids, params, slo, arrival_s=arrival_s, bad_words_ids=bad, lora=lora, cache_salt=cache_salt,
                      lora_source=lora_source if lora is not None else None,
                      priority=priority if self.priority_scheduling else 0)
        req.prompt_thinking = state if read_thinking else None
        if messages is not None:  # the length predictor reads the question, not the template around it
            last = next((m.content for m in reversed(messages) if m.role == "user" and m.content), None)
            if last:
                try:
                    req.question_ids = self.encode(last) or None
                except (TypeError, UnicodeError):
                    pass  # the prompt it is part of tokenized: the prompt stands in
        return req
