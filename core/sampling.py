"""Sampling parameters (plain, frozen data): the per-request knobs of an OpenAI/vLLM request."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # temperatures this small are greedy (dividing logits by them overflows)
# a positive temperature below this is raised to it, as vLLM's (`_MAX_TEMP`): 0 alone is greedy
MIN_TEMPERATURE = 1e-2
MAX_LOGIT_BIAS = 300  # tokens in one request's logit_bias (OpenAI's limit)
MAX_BAD_WORDS = 256  # words in one request's bad_words
MAX_STOP_STRINGS = 256  # stop strings in one request (OpenAI takes 4, vLLM any number; each is looked for per token)
MAX_STOP_CHARS = 16_384  # their characters in all: each token's look costs the worker about as many compares
# most likely tokens a request may ask the log-probabilities of per token: vLLM's default max_logprobs (an engine's
# own, `EngineConfig.max_logprobs`, is checked where it takes a request: `engine.inputs`)
MAX_LOGPROBS = 20


def max_logprobs_of(max_logprobs: int, vocab: int) -> int:
    """An engine's cap on a request's logprobs counts: its `max_logprobs` (-1: vLLM's, the vocabulary), at most the
    vocabulary's size."""
    return vocab if max_logprobs == -1 else min(max_logprobs, vocab)


def finite_number(v: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_int64(v: object) -> bool:
    """Whether `v` is an integer (not a bool) of a signed 64-bit integer's range: a seed's, a priority's."""
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: the rest of the context window (the engine resolves it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    # OpenAI's logit_bias: (token id, bias) pairs added to those tokens' logits before sampling (greedy too); a
    # mapping is accepted and kept as sorted pairs
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # OpenAI's: a token's logit loses presence_penalty once if it is in the reply so far, frequency_penalty x its count
    # there; vLLM's (and HF's): a logit of a token in the prompt or the reply is divided by repetition_penalty where
    # positive, multiplied by it where not. Greedy rows too
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # vLLM's: only tokens at least min_p x the likeliest one's probability (after temperature)
    # vLLM's: each output token comes with its log-probability under the model (its raw logits: before temperature,
    # penalties or any other change, vLLM's default `raw_logprobs`), its rank, and this many most likely tokens'
    # (0: the chosen token's alone); None: none
    logprobs: int | None = None
    # vLLM's: each prompt token's (the second on) log-probability under the model given the tokens before it, its
    # rank and this many most likely tokens' (0: its own alone), in the request's first item; None: none
    prompt_logprobs: int | None = None
    # vLLM's: only these tokens may be drawn (greedy rows too); empty: any
    allowed_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # vLLM's: words the reply may not write (each tokenized as at the text's start and after a space: the engine's
    # input processor, `Request.bad_words_ids`); a word's last token is banned where the reply holds the rest
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    skip_special_tokens: bool = True  # vLLM's: special tokens (a template's markers) are left out of the text
    include_stop_str_in_output: bool = False  # vLLM's: a stop string that ends the reply stays in its text
    # OpenAI's response_format json_object: the reply is a JSON object (each token one that keeps it one; a stop token
    # only once it has ended: `engine.json_mode`)
    json_object: bool = False
    # OpenAI's response_format json_schema (vLLM's guided_json): the reply is a JSON value of this schema (its JSON
    # text; `core.json_grammar.compile_schema` says what a schema may hold)
    json_schema: str | None = None
    # vLLM's guided_regex (and guided_choice, as `core.regex_grammar.choice_pattern` writes its texts): the whole
    # reply matches this regular expression (`core.regex_grammar` says what one may hold)
    regex: str | None = None
    # vLLM's guided_grammar (structured_outputs' grammar): the whole reply is a text of this EBNF grammar, from its
    # `root` rule (`core.ebnf_grammar` says what one may hold)
    grammar: str | None = None
    # a reasoning model's reply held to a format (json_object, json_schema, regex, grammar) thinks first, as vLLM's: the format
    # holds from the end of its thinking (`core.json_grammar.thinking_first`): "open", the reply starts inside it (its
    # template opened <think>); "tagged", only a reply that opens with <think> thinks; None: from the first token
    thinking: str | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, (int, float)) and not isinstance(t, bool) and 0.0 < t < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids or ()))
        bad = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
        object.__setattr__(self, "bad_words", tuple(bad or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        pairs = tuple((k, v) for k, v in bias)
        try:
            pairs = tuple(sorted(pairs))
        except TypeError:  # keys of mixed types: `validate` says what is wrong
            pass
        object.__setattr__(self, "logit_bias", pairs)

    def validate(self) -> "SamplingParams":
        """The one set of limits, wherever a request enters (HTTP or in-process)."""
        mt = self.max_tokens
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {mt!r}")
        if self.temperature is None or not (self.temperature >= 0.0):  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_p is None or not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if self.top_k is None or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k!r}")
        if self.seed is not None and not is_int64(self.seed):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.min_tokens < 0 or (mt is not None and self.min_tokens > mt):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if sum(len(s) for s in self.stop) > MAX_STOP_CHARS:
            raise ValueError(f"stop may hold at most {MAX_STOP_CHARS} characters in all, got "
                             f"{sum(len(s) for s in self.stop)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not finite_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not finite_number(rp) or not rp > 0.0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {rp!r}")
        if not finite_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {lp!r}")
        if self.json_object + (self.json_schema is not None) + (self.regex is not None) \
                + (self.grammar is not None) > 1:
            raise ValueError("a reply may be held to one of json_object, json_schema, regex and grammar, not several")
        if self.json_schema is not None:
            from core.json_grammar import compile_schema  # (a ValueError naming what it refuses)
            compile_schema(self.json_schema)
        if self.regex is not None:
            from core.regex_grammar import compile_regex
            compile_regex(self.regex)
        if self.grammar is not None:
            from core.ebnf_grammar import compile_grammar
            compile_grammar(self.grammar)
        if self.thinking not in (None, "open", "tagged"):
            raise ValueError(f'thinking must be "open", "tagged" or None, got {self.thinking!r}')
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be non-negative token ids")
        if len(self.bad_words) > MAX_BAD_WORDS or any(not isinstance(w, str) or not w.strip()
                                                      for w in self.bad_words):
            raise ValueError(f"bad_words must be at most {MAX_BAD_WORDS} words, none empty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens")
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        return self

    @property
    def runs_to_cap(self) -> bool:
        """Nothing but max_tokens ends the reply: ignore_eos with no stop strings or stop ids, or min_tokens up to
        max_tokens (EOS and stop ids are not drawn before min_tokens, nor do stop strings end a reply there). It
        will be max_tokens long, unless its client leaves first."""
        return (self.ignore_eos and not self.stop and not self.stop_token_ids) \
            or (self.max_tokens is not None and self.min_tokens >= self.max_tokens)

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty changes this request's logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def guided(self) -> bool:
        """Whether each token must keep the reply within a grammar (`engine.json_mode`): a JSON object
        (`json_object`), a value of a schema (`json_schema`), a match of a regular expression (`regex`) or a text of
        a grammar (`grammar`)."""
        return self.json_object or self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1 or self.top_p == 0.0  # top_p 0: the top token
