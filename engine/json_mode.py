"""Guided decoding in the sampler (`SamplingParams.guided`: OpenAI's `response_format` json_object or json_schema,
vLLM's guided_regex, guided_choice and guided_grammar): a row's token is one whose text keeps the reply a prefix of a
JSON object, of a value of its schema (`core.json_grammar`), of a match of its regex (`core.regex_grammar`) or of a
text of its grammar (`core.ebnf_grammar`), and a stop token (the EOS, a stop token id) only once the value has ended
(the regex matches, the grammar's root is complete). Tokens are checked by their bytes (`engine.detokenizer.TokenBytes`,
`core.json_grammar.feed`): a character whose UTF-8 is split between tokens (a CJK character, an emoji, in most
byte-level vocabularies) is written a token at a time, each token's first bytes only where the character they begin
can still come, and a stop only once no character is left begun.

The row's own distribution decides among the tokens that fit: greedy, the likeliest that fits; sampled, a draw among
those that fit of its most likely `CANDIDATES` (after temperature, top-k, min_p and top-p; the rest renormalized),
or, where none of them fits, among all tokens that fit; a sampled row's draw checks the tokens it lands on, one at a
time, before it checks the rest. Tokens are checked on the host, likeliest first, so a step
pays for a few checks where the model already writes JSON and for a scan of the vocabulary where it does not. A row
where no token fits (a stop token banned by min_tokens once the object has ended) keeps the token drawn without the
constraint.

`JsonStates` is the sampler's: each JSON request's automaton state after the reply tokens it has seen (`Guided`: with
the bytes of a character begun), so that a step feeds only the tokens new since."""
from __future__ import annotations

import hashlib
import itertools
import math
import struct
from typing import Callable, Iterator

import torch

from core.json_grammar import START, State, compile_schema, complete, feed, start, start_pattern, thinking_first
from core.ebnf_grammar import compile_grammar
from core.regex_grammar import compile_regex
from core.sampling import SamplingParams

CANDIDATES = 256  # a sampled row's most likely tokens looked at first
GREEDY_CANDIDATES = 64  # a greedy row's
MAX_REDRAWS = 16  # a sampled row's draws among its likeliest that each check one token; then the rest checked at once
WEIGHT_SPAN = 40.0  # a fallback draw weighs tokens down to e^-40 of the likeliest that fits (below: nothing)
# a fallback draw (none of a sampled row's likeliest fit) is among at most this many fitting tokens, the likeliest,
# found by checking at most FALLBACK_CHECKS tokens more once one fits (a format most tokens fit, its likeliest pushed
# out by a logit_bias, walked the whole vocabulary in Python for every row of every step, the engine's thread stalled)
FALLBACK_FITS = CANDIDATES
FALLBACK_CHECKS = 4096
PAIRED_BYTES = 8  # a whole scan picks its tokens by their first two bytes where at most this many first bytes may come
Guided = tuple[State, bytes]  # an automaton's state, and the first bytes of a character a token began (b"": none)


class JsonStates:
    """Per guided request: (reply tokens fed, the automaton's state after them).
    A request's state is kept from its first plan (`hold`, on the engine's thread) to its `release`: a draw that
    lands after the release (overlap scheduling on the host stream: a step in flight when its request ended) keeps
    nothing."""

    def __init__(self) -> None:
        self._at: dict[str, tuple[int, Guided | None]] = {}
        self._live: set[str] = set()

    def hold(self, request_id: str) -> None:
        self._live.add(request_id)

    def origin(self, params: SamplingParams) -> State:
        """The state before a reply: any object (json_object), a value of its schema, or a match of its regex; after
        a reasoning model's thinking (`params.thinking`)."""
        if params.regex is not None:  # (each compiled once for the requests that share it: the compilers' own caches)
            st = start_pattern(compile_regex(params.regex))
        elif params.grammar is not None:  # (a grammar steps as a regex does)
            st = start_pattern(compile_grammar(params.grammar))
        elif params.json_schema is None:
            st = START
        else:
            st = start(compile_schema(params.json_schema))
        return st if params.thinking is None else thinking_first(st, params.thinking == "open")

    def state(self, request_id: str, params: SamplingParams, reply: list[int], token_bytes: Callable[[int], bytes],
              stops: frozenset[int] = frozenset()) -> Guided | None:
        """The state after `reply` (the reply's tokens, none a placeholder), feeding only what is new since the
        last call (from the start where the reply is shorter: a step re-run); None where the reply is no JSON
        prefix (a token drawn without the constraint, where none fitted). A stop token (`stops`) after a whole value
        leaves it as it is: one that did not end the reply (ignore_eos) writes nothing."""
        n, g = self._at.get(request_id, (0, None))
        if g is None and n == 0 or n > len(reply):
            n, g = 0, (self.origin(params), b"")
        for t in reply[n:]:
            if g is not None and t in stops and not g[1] and complete(g[0]):
                continue
            g = feed(g[0], g[1], token_bytes(t)) if g is not None else None
        if request_id in self._live:
            self._at[request_id] = (len(reply), g)
        return g

    def release(self, request_id: str) -> None:
        self._live.discard(request_id)
        self._at.pop(request_id, None)

    def drop(self) -> None:
        self._live.clear()
        self._at.clear()


def _row_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """A sampled row's probabilities [V] as the sampler draws them: temperature, top-k, min_p, then top-p (float32)."""
    y = x.float() / p.temperature
    width = y.shape[-1]
    if p.top_k and 0 < p.top_k < width:
        y = y.masked_fill(y < torch.topk(y, p.top_k).values[-1], float("-inf"))
    if p.min_p > 0.0:
        y = y.masked_fill(y < y.max() + math.log(p.min_p), float("-inf"))
    probs = torch.softmax(y, dim=-1)
    if p.top_p < 1.0:
        vals, idx = torch.sort(probs, descending=True)
        drop = (torch.cumsum(vals, dim=-1) - vals) > p.top_p  # past the smallest prefix that reaches top_p
        probs = probs.index_put((idx[drop],), torch.zeros((), dtype=probs.dtype, device=probs.device))
    return probs


def _may_fit(g: Guided, token_bytes: Callable[[int], bytes], width: int, stops: frozenset[int], done: bool
             ) -> torch.Tensor | None:
    """[width] bool (on the CPU): the tokens that may fit at `g`, by their first byte (one that may come next) and,
    where few first bytes may, their first two, and the stop tokens where the value has ended; None where
    `token_bytes` does not tell its tokens' first bytes. A whole scan of the vocabulary checks only these (each check
    steps the automaton in Python: tens of thousands, most of them words after a space, stalled the whole batch)."""
    first = getattr(token_bytes, "first_bytes", None)
    if first is None:
        return None
    st, pending = g
    firsts = first(width)
    ones = [b for b in range(256) if feed(st, pending, bytes([b])) is not None]
    if len(ones) <= PAIRED_BYTES:
        pairs = torch.zeros(257 * 257, dtype=torch.bool)
        for b in ones:
            pairs[b * 257 + 256] = True  # (a token of that byte alone)
            pairs[b * 257: b * 257 + 256] = torch.tensor(
                [feed(st, pending, bytes([b, c])) is not None for c in range(256)])
        mask = pairs[firsts[:, 0] * 257 + firsts[:, 1]]
    else:
        may = torch.zeros(257, dtype=torch.bool)
        may[ones] = True
        mask = may[firsts[:, 0]]
    ids = [t for t in stops if 0 <= t < width]
    if ids:
        mask[ids] = done
    return mask


def _in_order(y: torch.Tensor, fits: Callable[[int], bool], mask: Callable[[], torch.Tensor | None],
              span: float = math.inf, unfit: frozenset[int] = frozenset(), checks: float = math.inf
              ) -> Iterator[tuple[int, float]]:
    """The tokens that fit with their scores in `y` [V], likeliest first, down to `span` below the first: in widening
    top-k rounds (a sort of the whole vocabulary only as the last), from the second round only among those `mask()`
    keeps (their first bytes may come). `unfit`: tokens known not to fit (not checked again); `checks`: once one has
    fit, at most this many checks more."""
    checked: set[int] = set(unfit)
    floor = -math.inf
    first: int | None = None  # the checks made when the first token fit
    k = GREEDY_CANDIDATES
    while True:
        if k == GREEDY_CANDIDATES * 8:
            keep = mask()
            if keep is not None:
                y = y.masked_fill(~keep.to(y.device), float("-inf"))
        k = min(k, y.shape[-1])
        vals, idx = torch.topk(y, k)
        for v, t in zip(vals.tolist(), idx.tolist()):
            if v == float("-inf") or v < floor:
                return
            if t not in checked:
                if first is not None and len(checked) - first >= checks:
                    return
                checked.add(t)
                if fits(t):
                    first = len(checked) if first is None else first
                    floor = max(floor, v - span)
                    yield t, v
        if k == y.shape[-1]:
            return
        k *= 8


def _fitting(y: torch.Tensor, fits: Callable[[int], bool], mask: Callable[[], torch.Tensor | None],
             unfit: frozenset[int] = frozenset()) -> list[tuple[int, float]]:
    """The tokens that fit, by a row's scaled logits `y` [V] (logits / temperature), each weighed as its probability
    over the likeliest of them, down to `WEIGHT_SPAN` below it (the rest weigh nothing a float could hold): the
    likeliest `FALLBACK_FITS` of them, among the `FALLBACK_CHECKS` tokens checked once one fits. Weighed against the
    likeliest that fits, not the row's own likeliest: at a low temperature or under a large logit_bias every other
    token's probability is 0.0 in a float, and the row must still get a token of its format. `unfit`: tokens known
    not to fit."""
    out = list(itertools.islice(_in_order(y, fits, mask, WEIGHT_SPAN, unfit, FALLBACK_CHECKS), FALLBACK_FITS))
    return [(t, math.exp(v - out[0][1])) for t, v in out]


def _again(u: float, k: int) -> float:
    """A uniform number in [0, 1) made from the draw `u` for its `k`-th redraw: a hash of its bits, uniform whatever
    interval `u` fell in, and the same for the same `u` (a seeded request's)."""
    digest = hashlib.blake2b(struct.pack("<dI", u, k), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def choose(x: torch.Tensor, p: SamplingParams, u: float | None, g: Guided, stops: frozenset[int],
           token_bytes: Callable[[int], bytes]) -> int | None:
    """A token for one JSON row from its logits `x` [V] (after bans, logit_bias and penalties) at state `g`: greedy
    (`u` None) the likeliest that fits; else the draw `u` in [0, 1) among those that fit. None where no token fits."""
    st, pending = g
    done = complete(st) and not pending

    def fits(t: int) -> bool:
        return done if t in stops else feed(st, pending, token_bytes(t)) is not None

    def mask() -> torch.Tensor | None:
        return _may_fit(g, token_bytes, x.shape[-1], stops, done)

    if u is None:  # the likeliest that fits
        return next(_in_order(x, fits, mask), (None, 0.0))[0]
    probs = _row_probs(x, p)
    vals, idx = torch.topk(probs, min(CANDIDATES, probs.shape[-1]))
    # (in token order, as the unconstrained draw walks its row: an order by probability swapped near-ties, and the
    # draw's token, where logits moved by a rounding)
    cands = sorted((t, v) for v, t in zip(vals.tolist(), idx.tolist()) if v > 0.0)
    # a draw among the likeliest, checked only once drawn: one that does not fit leaves the list and the draw goes on
    # with a uniform number of its own made from `u` (`_again`: apart from which token it fell on, and from the
    # logits: where `u` fell within the token's share was uniform too, but it read the probabilities' last bits, and
    # a neighbour in the batch that moved them by a rounding moved the token a seeded request drew), so that the token
    # drawn follows the row's distribution over those that fit, as a draw among the checked ones would, at a check or
    # two where the model already writes the format (each check steps the automaton in Python)
    tried: set[int] = set()  # (drawn and not fitting)
    for redraw in range(MAX_REDRAWS):
        total = sum(v for _, v in cands)
        if not cands or not total > 0.0:
            break
        at, acc, j = u * total, 0.0, len(cands) - 1
        for k, (_, v) in enumerate(cands):
            if acc + v > at:
                j = k
                break
            acc += v
        else:
            acc -= cands[j][1]  # (rounding past the end: the last)
        t, v = cands[j]
        if fits(t):
            return t
        u = _again(u, redraw)
        tried.add(t)
        del cands[j]
    unfit = frozenset(t for t, _ in cands if not fits(t)) | tried
    cands = [(t, v) for t, v in cands if t not in unfit]
    if not cands:  # none of its likeliest fit: those that do, by the row's distribution before truncation
        cands = sorted(_fitting(x.float() / p.temperature, fits, mask, unfit))
    if not cands:
        return None
    total = sum(v for _, v in cands)
    at, acc = u * total, 0.0
    for t, v in cands:
        acc += v
        if acc > at:
            return t
    return cands[-1][0]
