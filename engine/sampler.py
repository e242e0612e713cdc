"""Batched sampling on the logits' device: min_tokens' bans, logit_bias, allowed_token_ids and the presence /
frequency / repetition penalties on the logits of their rows; greedy rows in one argmax; temperature / top-k / min_p /
top-p rows together,
each drawn with its uniform numbers (one, or a device top-p draw's `rounds`) from its request's own seeded generator
(on that device) or the sampler's.

One implementation for every device: every op runs where the logits are, in whole-batch tensor ops, and the step's
tokens come back to the host in one copy (a sampled row whose logits are not finite comes back as -1 and fails
alone; a greedy row's argmax counts a NaN as the maximum, as the CPU kernels do). Top-p
rows: a backend may hand in a device draw with no host sync (`top_p_draw`: the CUDA backend's Triton kernel); else a
few syncs per step decide whether a flat row needs the exact nucleus search, none per row. A seeded row's draw
depends only on its own generator, whatever else is in the batch. A backend may hand in faster host paths
(`argmax`, `draw`: the CPU kernels').

The sampler reads requests and never changes them; the seeded RNGs and the penalized requests' token counts
(`PenaltyCounts`) are its own, keyed by request id (`release` drops them when its request ends)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from core.request import Request
from core.sampling import GREEDY_BELOW, MAX_LOGPROBS
from engine.backends.base import to_device
from engine.json_mode import JsonStates, choose

# top-p looks for the kept tokens among each row's most likely ones, this many first, then more, then in the whole
# row (`_nucleus_keys`): `topk` of a few candidates costs a small part of a sort of the whole vocabulary
TOP_P_CANDIDATES = (64, 1024)
NOT_FINITE = "sampling: the probabilities are not finite"  # a row whose logits held a NaN or +inf fails alone
PROMPT_ROWS = 256  # prompt logprobs' rows a pass takes (their logits, float32 copy and log-softmax each)


def _top_ks(reqs: list[Request], width: int) -> list[int]:
    """Each request's top-k over `width` logits: 0 (off) where it keeps them all (0, -1, or width and more: a
    client's k may be any integer, the kernels take an int64 below the width)."""
    return [k if (k := r.params.top_k) and 0 < k < width else 0 for r in reqs]


def _to(values: list, dev: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on `dev` (`to_device`: no wait for the step in flight on a GPU)."""
    return to_device(torch.tensor(values, dtype=dtype), dev)


def _first_max(logits: torch.Tensor) -> torch.Tensor:
    # max(dim).indices, like argmax, is the first maximum; on CPU it vectorises where argmax does not
    return logits.max(dim=-1).indices


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's index whose cumulative probability first exceeds u x the row's total (inverse CDF: a token is
    drawn with its probability; zero-probability tokens never). probs [n, m] >= 0, u [n] in [0, 1)."""
    c = torch.cumsum(probs, dim=-1)
    j = torch.searchsorted(c, (u * c[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return j.clamp_(max=probs.shape[-1] - 1)


def _nucleus_keys(p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's nucleus threshold without sorting: probabilities >= 0 order like their float bits, so a bisection
    over the 31-bit keys finds, for every row at once, the largest key K whose tokens (key >= K) hold top_p of the
    mass. Ties at the last kept probability stay in. p [n, m] (rows sum to ~1), top_p [n]; returns K [n, 1]."""
    keys = p.view(torch.int32)
    need = torch.minimum(top_p.double(), p.double().sum(-1))  # rounding: the whole row always qualifies
    lo = torch.zeros(p.shape[0], dtype=torch.int32, device=p.device)  # mass(lo) >= need
    hi = keys.max(dim=-1).values + 1  # mass(hi) = 0 < need
    pd = p.double()
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        mass = torch.where(keys >= mid.unsqueeze(-1), pd, 0.0).sum(-1)
        up = mass >= need
        lo = torch.where(up, mid, lo)
        hi = torch.where(up, hi, mid)
    return lo.unsqueeze(-1)


def _nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's nucleus as a mask (`_nucleus_keys`)."""
    k = _nucleus_keys(p.unsqueeze(0), torch.tensor([top_p], device=p.device))
    return p.view(torch.int32) >= k[0]


def _top_p_draw(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw from each row's smallest set of most likely tokens whose mass reaches its top_p (the nucleus), in
    proportion to their probabilities. The nucleus is looked for among the row's `TOP_P_CANDIDATES` most likely
    tokens first (one sync to see which rows found it); rows whose candidates do not reach top_p (a flat distribution)
    find it with the bisection of `_nucleus_keys`, all together."""
    n, width = probs.shape
    out = torch.empty(n, dtype=torch.long, device=probs.device)
    todo = None  # rows still to draw: None = all
    for k in TOP_P_CANDIDATES:
        k = min(k, width)
        p_rows = probs if todo is None else probs[todo]
        tp, uu = (top_p, u) if todo is None else (top_p[todo], u[todo])
        vals, idx = torch.topk(p_rows, k, dim=-1)  # sorted, most likely first
        cum = torch.cumsum(vals, dim=-1)
        reached = (cum[:, -1] >= tp) | (k == width)
        kept = vals.masked_fill((cum - vals) > tp.unsqueeze(-1), 0.0)  # the smallest prefix whose mass reaches top_p
        tok = idx.gather(-1, _draw(kept, uu).unsqueeze(-1)).squeeze(-1)
        if todo is None:
            out.copy_(tok)
            todo_all = torch.arange(n, device=probs.device)
        else:
            out[todo] = tok
            todo_all = todo
        if bool(reached.all()):  # the one sync of the common case
            return out
        todo = todo_all[~reached]
    p_rows = probs[todo]
    kept = torch.where(p_rows.view(torch.int32) >= _nucleus_keys(p_rows, top_p[todo]), p_rows, 0.0)
    out[todo] = _draw(kept, u[todo])
    return out


# (logits, rows, temperatures, top-ks, top-ps, uniforms) -> a token per row (-1: the row's logits are not finite),
# or None where it cannot run on these logits: `CpuKernels.sample_rows`
DrawRows = Callable[[torch.Tensor, list[int], list[float], list[int], list[float], torch.Tensor], list[int] | None]
# (probs [n, V], top_p [n], uniforms [n, rounds], row sums [n]) -> a token per row from its nucleus, on the device
# with no host sync: the CUDA backend's `sampling.top_p_draw`
TopPDraw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# a row's log-probabilities: (its token's (the drawn one, or the prompt's next), the token's rank (1: the likeliest),
# the most likely tokens' as (id, log-probability) pairs, likeliest first)
RowLogprobs = tuple[float, int, tuple[tuple[int, float], ...]]
# a request's prompt rows in a step (`engine.backends.base.prompt_spans`), as read when the step was planned: (its
# id, its first position, the prompt tokens those positions predict (positions + 1), its top count)
PromptSpan = tuple[str, int, list[int], int]


def generator_seed(seed: int) -> int:
    """The seed a request's generator gets for its `seed` (a signed 64-bit integer, as vLLM's API takes): itself
    in [0, 2**32), else a mix of all 64 bits into that range. Torch's CPU generator keys its stream on the seed's low
    32 bits only, so -1 and 2**63 - 1, or s and s + 2**32, drew the same tokens; mixed, different seeds collide only
    as any two do in 2**32 streams. Seeds a client is likely to choose keep the streams they always had."""
    if 0 <= seed < 1 << 32:
        return seed
    x = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF  # splitmix64's finalizer over the seed's two's complement
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0xFFFFFFFF


@dataclass(slots=True)
class Draws:
    """A step's sampling as planned when it was launched (`Sampler.plan`): its rows' requests (only their frozen
    `params` are read later), the rows below min_tokens with the ids they may not draw, those with a logit_bias, the
    rows that sample and their uniform numbers [n, rounds], and the rows whose generator failed."""
    reqs: list[Request]
    banned: list[tuple[int, tuple[int, ...]]]
    biased: list[tuple[int, tuple[tuple[int, float], ...]]]
    sampled: list[int]
    u: torch.Tensor | None
    failed: dict[int, Exception]
    penalized: list["PenaltyRow"] = field(default_factory=list)
    # the tokens of the step before (overlap scheduling), where a penalized row's last token is still a placeholder
    prev: "SampledTokens | None" = None
    logprobs: list[tuple[int, int]] = field(default_factory=list)  # (row, its top count) of the rows with logprobs
    allowed: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # rows with allowed_token_ids, theirs
    # JSON-mode rows and their reply's tokens when planned (the last may be a placeholder: `prev` has it)
    json: list[tuple[int, list[int]]] = field(default_factory=list)
    # rows with bad words: theirs (`Request.bad_words_ids`) and the reply's last tokens when planned (placeholders too)
    bad: list[tuple[int, tuple[tuple[int, ...], ...], list[int]]] = field(default_factory=list)

    def row(self, i: int) -> "Draws":
        """Row `i`'s draw alone (a step re-run request by request draws each row with the numbers planned for it)."""
        j = self.sampled.index(i) if i in self.sampled else -1
        return Draws([self.reqs[i]], [(0, ids) for k, ids in self.banned if k == i],
                     [(0, b) for k, b in self.biased if k == i], [0] if j >= 0 else [],
                     self.u[j:j + 1] if j >= 0 and self.u is not None else None,
                     {0: self.failed[i]} if i in self.failed else {},
                     [replace(pr, row=0) for pr in self.penalized if pr.row == i], self.prev,
                     [(0, k) for r, k in self.logprobs if r == i], [(0, a) for r, a in self.allowed if r == i],
                     [(0, reply) for r, reply in self.json if r == i], [(0, w, t) for r, w, t in self.bad if r == i])


@dataclass(frozen=True, slots=True)
class PenaltyRow:
    """A penalized row of a step as planned (`Sampler.plan`): its request's slot in the sampler's token counts and
    the slot's lease (the request it was given to), the reply's tokens the plan saw from output position `start` on
    (those the counts may lack), the prompt's ids where the slot may not hold them yet, and the placeholder of a
    token still on its way (overlap scheduling: its row among the step before's tokens), if any."""
    row: int
    slot: int
    lease: int
    start: int
    tokens: tuple[int, ...]
    prompt: tuple[int, ...] | None
    pending_row: int | None


class PenaltyCounts:
    """Each penalized request's token counts, for OpenAI's presence and frequency penalties and vLLM's (and HF's)
    repetition penalty: in a slot of two [slots, vocab] tensors on the logits' device, its reply's counts and its
    prompt's tokens (a mask), kept across steps so that a step sends the device only the tokens new since.

    Planned on the engine thread (`plan_row`: which slot, what the slot may lack), applied by the step's draw,
    which may run on another thread but in the order the steps were planned (`apply`). Whatever a plan read may be
    stale: a draw adds only the tokens its slot lacks (by position) and resets a slot whose lease (the request it
    was given to) is not the plan's, so a draw that never ran (a step that failed) loses nothing and a step drawn
    again (request by request) counts nothing twice."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._slot: dict[str, tuple[int, int]] = {}  # request id -> (slot, lease): the engine thread's
        self._free: list[int] = []
        self._size = 0  # slots handed out so far
        self._leases = 0
        # the draws' state (written by draws only): per slot, (lease, reply tokens counted)
        self._held: dict[int, tuple[int, int]] = {}
        self.counts: torch.Tensor | None = None  # [slots, vocab] float32: the reply's tokens
        self.prompt: torch.Tensor | None = None  # [slots, vocab] bool: the prompt's tokens
        # the penalties on the tokens seen alone (`_apply_sparse`), or on whole rows; None: alone on a CPU
        self.sparse: bool | None = None

    def plan_row(self, row: int, req: Request) -> PenaltyRow:
        """Row `row` of a step, request `req` penalized: its slot (given now if it had none) and what to count."""
        got = self._slot.get(req.request_id)
        if got is None:
            self._leases += 1
            if self._free:
                slot = self._free.pop()
            else:
                slot, self._size = self._size, self._size + 1
            got = self._slot[req.request_id] = (slot, self._leases)
        slot, lease = got
        held = self._held.get(slot)
        fresh = held is None or held[0] != lease
        start = 0 if fresh else held[1]
        ids, n0 = req.token_ids, len(req.prompt_token_ids)
        pending = None
        end = len(ids) - n0  # reply tokens
        if end > 0 and ids[-1] < 0:  # its last token is the step before's, still on the device: -(its row + 1)
            pending, end = -ids[-1] - 1, end - 1
        tokens = tuple(ids[n0 + start:n0 + end]) if start < end else ()  # only what the slot may lack
        prompt = tuple(req.prompt_token_ids) if fresh else None
        return PenaltyRow(row, slot, lease, start, tokens, prompt, pending)

    def release(self, request_id: str) -> None:
        got = self._slot.pop(request_id, None)
        if got is not None:
            self._free.append(got[0])

    def drop(self) -> None:
        """Free the tensors (no request holds a slot: after the warm-up, at shutdown); the next draw makes them anew."""
        self.counts = self.prompt = None
        self._held.clear()

    def _reserve(self, slots: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors, with at least `slots` slots on `dev` (grown by doubling, their contents kept)."""
        counts, prompt = self.counts, self.prompt
        if counts is None or counts.device != dev:
            counts = torch.zeros(0, self.vocab, dtype=torch.float32, device=dev)
            prompt = torch.zeros(0, self.vocab, dtype=torch.bool, device=dev)
            self._held.clear()
        if counts.shape[0] < slots:
            n = max(slots, 2 * counts.shape[0], 8)
            grown = torch.zeros(n, self.vocab, dtype=torch.float32, device=dev)
            grown_prompt = torch.zeros(n, self.vocab, dtype=torch.bool, device=dev)
            grown[: counts.shape[0]] = counts
            grown_prompt[: prompt.shape[0]] = prompt
            counts, prompt = grown, grown_prompt
        self.counts, self.prompt = counts, prompt
        return counts, prompt

    def apply(self, logits: torch.Tensor, reqs: list[Request], rows: list[PenaltyRow],
              prev: "SampledTokens | None") -> None:
        """Penalize `rows` of `logits` (float32, [R, width], in place), vLLM's way: a logit of a token in the prompt
        or the reply so far is divided by the repetition penalty where positive, multiplied by it where not; then
        each token's logit loses frequency_penalty x its count in the reply, and presence_penalty once if it is
        there at all. Tokens at or past the logits' width count for nothing."""
        dev, width = logits.device, min(logits.shape[-1], self.vocab)
        counts, prompt = self._reserve(max(pr.slot for pr in rows) + 1, dev)
        reset: list[int] = []
        p_rows: list[int] = []
        p_cols: list[int] = []
        c_rows: list[int] = []
        c_cols: list[int] = []
        held: dict[int, tuple[int, int]] = {}  # what the slots hold once the writes below are done
        for pr in rows:
            was = held.get(pr.slot) or self._held.get(pr.slot)
            counted = was[1] if was is not None and was[0] == pr.lease else None
            if counted is None:  # the slot is this request's from now on: its prompt, and no reply yet
                reset.append(pr.slot)
                ids = {t for t in pr.prompt or () if 0 <= t < self.vocab}
                p_rows.extend([pr.slot] * len(ids))
                p_cols.extend(ids)
                counted = 0
            new = [t for t in pr.tokens[max(0, counted - pr.start):] if 0 <= t < self.vocab]
            c_rows.extend([pr.slot] * len(new))
            c_cols.extend(new)
            held[pr.slot] = (pr.lease, max(counted, pr.start + len(pr.tokens)))
        if reset:
            at = _to(reset, dev)
            counts.index_fill_(0, at, 0.0)
            prompt.index_fill_(0, at, False)
        if p_rows:
            prompt[_to(p_rows, dev), _to(p_cols, dev)] = True
        if c_rows:
            counts.index_put_((_to(c_rows, dev), _to(c_cols, dev)), torch.ones(len(c_rows), device=dev),
                              accumulate=True)
        self._held.update(held)  # (after the writes: a draw that failed in them counts its tokens when drawn again)
        slots = _to([pr.slot for pr in rows], dev)
        c = counts.index_select(0, slots)[:, :width]
        waiting = [(j, pr.pending_row) for j, pr in enumerate(rows) if pr.pending_row is not None]
        if waiting:  # a last token still on its way: from the step before's tokens on the device, or the host's
            if prev is not None:
                toks = prev.device_tokens(dev).index_select(0, _to([r for _, r in waiting], dev))
            else:
                toks = _to([reqs[rows[j].row].token_ids[-1] for j, _ in waiting], dev, torch.long)
            ok = (toks >= 0) & (toks < width)
            c.index_put_((_to([j for j, _ in waiting], dev), toks.clamp(0, width - 1)), ok.float(), accumulate=True)
        params = [reqs[pr.row].params for pr in rows]
        reps = [p.repetition_penalty for p in params]
        freqs = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        if (dev.type == "cpu" if self.sparse is None else self.sparse):
            self._apply_sparse(logits, rows, c, prompt, slots, width, reps, freqs, pres)
            return
        whole = len(rows) == logits.shape[0] and all(pr.row == j for j, pr in enumerate(rows))
        at = None if whole else _to([pr.row for pr in rows], dev)
        x = logits[:, :width] if whole else logits.index_select(0, at)[:, :width]
        # each penalty only where some row has it (a batch's requests mostly use one kind, or the model's default)
        if any(r != 1.0 for r in reps):
            seen = (c > 0) | prompt.index_select(0, slots)[:, :width]
            rep = _to(reps, dev, torch.float32).unsqueeze(-1)
            x = torch.where(seen, torch.where(x > 0, (x / rep).clamp_(max=_FINITE), x * rep), x)
        if any(f != 0.0 for f in freqs):
            x = x.sub_(c * _to(freqs, dev, torch.float32).unsqueeze(-1))
        if any(q != 0.0 for q in pres):
            x = x.sub_(c.clamp(max=1.0).mul_(_to(pres, dev, torch.float32).unsqueeze(-1)))  # (counts: whole numbers)
        if at is not None:
            logits[at, :width] = x
        elif x.data_ptr() != logits.data_ptr():
            logits[:, :width] = x

    @staticmethod
    def _apply_sparse(logits: torch.Tensor, rows: list[PenaltyRow], c: torch.Tensor, prompt: torch.Tensor,
                      slots: torch.Tensor, width: int, reps: list[float], freqs: list[float], pres: list[float]
                      ) -> None:
        """`apply`'s penalties on the logits of the tokens seen alone (those in a reply, and with a repetition
        penalty in a prompt): a few hundred of a row's tens of thousands, found with one `nonzero`, which a CPU
        can afford (on a GPU it would wait for the device)."""
        dev = logits.device
        seen = c > 0
        if any(r != 1.0 for r in reps):
            seen |= prompt.index_select(0, slots)[:, :width]
        j, tok = seen.nonzero(as_tuple=True)
        if not len(j):
            return
        at = _to([pr.row for pr in rows], dev).index_select(0, j)
        v = logits[at, tok]
        n = c[j, tok]
        rep = _to(reps, dev, torch.float32).index_select(0, j)
        v = torch.where(v > 0, (v / rep).clamp_(max=_FINITE), v * rep)  # (a penalty of 1: the same logit)
        v -= _to(freqs, dev, torch.float32).index_select(0, j) * n
        v -= _to(pres, dev, torch.float32).index_select(0, j) * (n > 0)
        logits[at, tok] = v


def _bad_words_bans(d: "Draws") -> list[tuple[int, tuple[int, ...]]]:
    """Each bad-words row's banned tokens: a one-token word's always, a longer word's last where the reply ends
    with the rest of it (a last token still on its way read from the step before's tokens, as JSON rows read it).
    A row whose allowed_token_ids the bans would leave empty keeps them (its draw needs a token)."""
    prev = d.prev.result() if d.prev is not None and any(t < 0 for _, _, tail in d.bad for t in tail) else None
    allowed = dict(d.allowed)
    out = []
    for i, words, tail in d.bad:
        if any(t < 0 for t in tail):
            tail = [prev[-t - 1] if t < 0 and prev is not None else t for t in tail]
        ban = tuple(w[-1] for w in words if len(w) == 1 or (len(tail) >= len(w) - 1
                                                               and tuple(tail[len(tail) - len(w) + 1:]) == w[:-1]))
        if ban and not (i in allowed and set(allowed[i]) <= set(ban)):
            out.append((i, ban))
    return out


# the largest logit a penalty leaves: a positive logit divided by a penalty near 0 stays finite (an infinite one would
# make the row's probabilities NaN) once divided by the smallest temperature drawn too, the likeliest there is
_FINITE = torch.finfo(torch.float32).max * GREEDY_BELOW / 2


class Sampler:
    def __init__(self, vocab_limit: int, eos_token_ids: list[int], device: torch.device,
                 argmax: Callable[[torch.Tensor], list[int]] | None = None, draw: DrawRows | None = None,
                 top_p_draw: TopPDraw | None = None, rounds: int = 1) -> None:
        """`argmax`: each row's first maximum as a list (the CPU kernels' `argmax_rows`), else torch's on the
        logits' device. `draw`: the sampled rows in one host call (the CPU kernels' `sample_rows`: each row touches
        its logits once), else the torch ops below, on the logits' device. `top_p_draw`: the nucleus rows' draw on
        the device, with `rounds` uniform numbers a row (else `_top_p_draw`, which syncs to learn which rows its
        candidates covered)."""
        self.vocab_limit = vocab_limit
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.argmax = argmax
        self.draw_rows = draw
        self.top_p_draw = top_p_draw
        self.rounds = rounds if top_p_draw is not None else 1
        self._generators: dict[str, torch.Generator] = {}
        self._penalties = PenaltyCounts(vocab_limit)
        self._json = JsonStates()
        # a token's bytes, special tokens' none (the engine's `TokenBytes`): what guided decoding checks
        self.token_bytes: Callable[[int], bytes] | None = None

    def _generator(self, req: Request, device: torch.device) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None or gen.device != device:
            gen = torch.Generator(device=device)
            gen.manual_seed(generator_seed(req.params.seed))
            self._generators[req.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._penalties.release(request_id)
        self._json.release(request_id)

    def drop_state(self) -> None:
        """Free what the sampler keeps on the device for penalized requests (none running: after the warm-up, at
        shutdown)."""
        self._penalties.drop()
        self._json.drop()

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int | Exception]:
        """One token per request; a request whose own sampling fails gets its exception instead. The logits are
        the sampler's to change (a step's fresh output)."""
        return self.sample_async(logits, reqs).result()

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, reqs: list[Request]) -> "SampledTokens":
        """`sample` without waiting for the device: the tokens stay on the logits' device (where the next step can
        read them) and are on their way to the host; `result()` waits for them."""
        return self.draw(logits, self.plan(reqs, logits.device))

    def plan(self, reqs: list[Request], device: torch.device | None = None,
             prev: "SampledTokens | None" = None) -> "Draws":
        """What a step's draw reads of its requests' state, taken now (each row's uniform numbers come from its
        generator here): a step drawn later on another thread (`draw`) draws what it would have drawn now, whatever
        the requests have become since. Only `params` (frozen) is read later. `prev`: the step before's tokens, where
        they may not have reached the requests yet (overlap scheduling; also settable on the plan until its draw)."""
        dev = device if device is not None else self.device
        # one pass over the rows: those below min_tokens, with a logit_bias, penalized, that sample (not greedy)
        banned: list[tuple[int, tuple[int, ...]]] = []
        biased: list[tuple[int, tuple[tuple[int, float], ...]]] = []
        penalized: list[PenaltyRow] = []
        sampled: list[int] = []
        logprobs: list[tuple[int, int]] = []
        allowed: list[tuple[int, tuple[int, ...]]] = []
        json_rows: list[tuple[int, list[int]]] = []
        bad: list[tuple[int, tuple[tuple[int, ...], ...], list[int]]] = []
        for i, r in enumerate(reqs):
            p = r.params
            if p.min_tokens and r.num_output_tokens < p.min_tokens:
                banned.append((i, (*self.eos_token_ids, *p.stop_token_ids)))
            if p.logit_bias:
                biased.append((i, p.logit_bias))
            if p.penalized:
                penalized.append(self._penalties.plan_row(i, r))
            if not p.greedy:
                sampled.append(i)
            if p.logprobs is not None:
                logprobs.append((i, p.logprobs))
            if p.allowed_token_ids:
                allowed.append((i, p.allowed_token_ids))
            if p.guided:
                json_rows.append((i, r.token_ids[r.num_prompt_tokens:]))
                self._json.hold(r.request_id)
            if r.bad_words_ids:
                k = max(len(w) for w in r.bad_words_ids) - 1
                bad.append((i, r.bad_words_ids, r.token_ids[max(r.num_prompt_tokens, len(r.token_ids) - k):]
                            if k else []))
        failed: dict[int, Exception] = {}
        u = self._uniforms(reqs, sampled, dev, failed) if sampled else None
        if failed:  # a row whose own generator failed is left out; the others go on
            keep = [j for j, i in enumerate(sampled) if i not in failed]
            sampled = [sampled[j] for j in keep]
            u = u[_to(keep, dev, torch.long)]
        return Draws(reqs, banned, biased, sampled, u, failed, penalized, prev, logprobs, allowed, json_rows, bad)

    @torch.inference_mode()
    def prompt_logprobs(self, rows: Callable[[int, int], torch.Tensor], spans: list["PromptSpan"]
                        ) -> dict[str, tuple[int, list[RowLogprobs]]]:
        """Prompt logprobs (`SamplingParams.prompt_logprobs`) from a step's prompt rows: `rows(a, b)` the logits of
        rows [a, b) of them, each span's rows in turn (`PromptSpan`), made `PROMPT_ROWS` at a time. By request id:
        (the span's first position, one `RowLogprobs` per position: the next prompt token's log-probability, its
        rank and the span's top k). On the host (a wait for the device: only steps with such rows pay it)."""
        targets = [t for _, _, tokens, _ in spans for t in tokens]
        k = max(k for *_, k in spans)
        # fewer rows a pass where k is above vLLM's default cap (a server's max_logprobs may be the vocabulary): a
        # pass's top tokens stay as many as PROMPT_ROWS rows of that cap's
        per = max(1, min(PROMPT_ROWS, PROMPT_ROWS * (MAX_LOGPROBS + 1) // (k + 1)))
        vals: list[list[float]] = []
        ids: list[list[int]] = []
        for a in range(0, len(targets), per):
            # over every row of the model's head (vLLM's, a padded vocabulary's too), the tokens beyond the
            # tokenizer's never named
            raw = torch.log_softmax(rows(a, min(a + per, len(targets))).float(), dim=-1)[:, : self.vocab_limit]
            v, i = _logprob_columns(raw, _to(targets[a:a + per], raw.device, torch.long), k)
            vals.extend(v.tolist())
            ids.extend(i.tolist())
        out: dict[str, tuple[int, list[RowLogprobs]]] = {}
        j = 0
        for rid, start, tokens, kk in spans:
            out[rid] = (start, [(vals[n][0], int(ids[n][0]), tuple(zip(ids[n][1:kk + 1], vals[n][1:kk + 1])))
                                for n in range(j, j + len(tokens))])
            j += len(tokens)
        return out

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, d: "Draws") -> "SampledTokens":
        """The step's tokens from its logits (the sampler's to change) and its `plan`."""
        # the rows' log-probabilities as the model gave them (vLLM's raw_logprobs), before any change below: over
        # every row of its head (vLLM's, a padded vocabulary's too), the tokens beyond the tokenizer's never named
        raw = _log_softmax_rows(logits, [i for i, _ in d.logprobs])[:, : self.vocab_limit] if d.logprobs else None
        if logits.shape[-1] > self.vocab_limit:  # rows the tokenizer cannot decode are never sampled
            logits = logits[:, : self.vocab_limit]
        logits = self._processed(logits, d)
        # the JSON rows' logits as processed, a copy (the draw below may change them in place: temperature, top-k)
        json_logits = logits[_to([i for i, _ in d.json], logits.device)] \
            if d.json and self.token_bytes is not None else None
        tokens = self._pick(logits, d)
        if json_logits is not None:
            tokens = self._json_rows(json_logits, d, tokens)
        return tokens if raw is None else tokens.with_logprobs(raw, d.logprobs)

    def _processed(self, logits: torch.Tensor, d: "Draws") -> torch.Tensor:
        """The logits after min_tokens' bans, logit_bias, allowed_token_ids and the penalties (in place where their
        dtype allows; float32 where a bias or a penalty needs it)."""
        dev = logits.device
        width = logits.shape[-1]
        reqs, sampled, u, width = d.reqs, d.sampled, d.u, logits.shape[-1]
        banned = d.banned + _bad_words_bans(d) if d.bad else d.banned
        if banned:  # below min_tokens, EOS and the stop token ids cannot be drawn (EOS even with ignore_eos, as in
            # vLLM), nor a bad word's last token: one masked write for the whole batch, in place
            rows: list[int] = []
            cols: list[int] = []
            for i, ids in banned:
                ban = {t for t in ids if 0 <= t < width}
                rows.extend([i] * len(ban))
                cols.extend(ban)
            if rows:
                logits[_to(rows, dev), _to(cols, dev)] = float("-inf")
        if d.biased:  # logit_bias: one accumulating write for the whole batch, before every path (greedy too)
            rows = [i for i, bias in d.biased for t, _ in bias if t < width]
            cols = [t for _, bias in d.biased for t, _ in bias if t < width]
            vals = [b for _, bias in d.biased for t, b in bias if t < width]
            if rows:
                if logits.dtype != torch.float32:  # bf16 logits (a GPU's): a bias under their step would vanish
                    logits = logits.float()
                logits.index_put_((_to(rows, dev), _to(cols, dev)), _to(vals, dev, logits.dtype), accumulate=True)
        if d.allowed:  # allowed_token_ids: every other token of the row out, before every path (greedy too)
            keep = torch.zeros(len(d.allowed), width, dtype=torch.bool)
            for j, (_, ids) in enumerate(d.allowed):
                keep[j, [t for t in ids if t < width]] = True
            rows_t = _to([i for i, _ in d.allowed], dev)
            logits[rows_t] = logits[rows_t].masked_fill(~to_device(keep, dev), float("-inf"))
        if d.penalized:  # presence, frequency and repetition penalties, after the bias (vLLM's order), greedy too
            if logits.dtype != torch.float32:
                logits = logits.float()
            self._penalties.apply(logits, d.reqs, d.penalized, d.prev)
        return logits

    def _pick(self, logits: torch.Tensor, d: "Draws") -> "SampledTokens":
        """Each row's token from its processed logits: greedy rows' maximum, sampled rows' draw."""
        dev = logits.device
        reqs, sampled, u = d.reqs, d.sampled, d.u
        failed = dict(d.failed)
        if not sampled and not failed:  # a greedy batch draws no numbers
            if self.argmax is not None:
                return SampledTokens(self.argmax(logits), failed)
            return SampledTokens.on_device(_first_max(logits), failed)
        if u is not None and u.device != dev:
            u = u.to(dev)
        greedy = len(sampled) + len(failed) < len(reqs)
        if self.argmax is not None or self.draw_rows is not None:
            return SampledTokens(self._host_paths(logits, reqs, sampled, u, greedy), failed)
        return SampledTokens.on_device(self._device_paths(logits, reqs, sampled, u, greedy), failed)

    def _json_rows(self, logits: torch.Tensor, d: "Draws", tokens: "SampledTokens") -> "SampledTokens":
        """The JSON-mode rows' tokens in place of those drawn without the constraint (`engine.json_mode`), on the
        host, from their processed logits (`logits`, one row each in `d.json`'s order): each row's reply so far (its
        placeholder read from the step before's tokens) brings its automaton up to date, and its token is one that
        fits, by the row's own distribution (greedy, or its planned number)."""
        toks = tokens.result()
        prev = d.prev.result() if d.prev is not None and any(t < 0 for _, reply in d.json for t in reply) else None
        drawn = {i: j for j, i in enumerate(d.sampled)}
        eos = frozenset(self.eos_token_ids)
        for k, (i, reply) in enumerate(d.json):
            if isinstance(toks[i], Exception):
                continue
            if any(t < 0 for t in reply):
                if prev is None:
                    continue
                reply = [prev[-t - 1] if t < 0 else t for t in reply]
                if any(isinstance(t, Exception) for t in reply):
                    continue
            r = d.reqs[i]
            p = r.params
            # (the EOS fits once the value is whole with ignore_eos too: it then writes nothing and the reply goes on to
            # its cap, as vLLM's; without it nothing fitted there and the reply left its format)
            stops = frozenset(p.stop_token_ids) | eos
            g = self._json.state(r.request_id, p, reply, self.token_bytes, stops)
            if g is None:  # a token that did not fit went before (none did): no constraint left to keep
                continue
            u = float(d.u[drawn[i], 0]) if i in drawn and d.u is not None else None
            t = choose(logits[k], p, u, g, stops, self.token_bytes)
            if t is not None:
                toks[i] = t
        return SampledTokens.of(toks)

    def _uniforms(self, reqs: list[Request], rows: list[int], dev: torch.device,
                  failed: dict[int, Exception]) -> torch.Tensor:
        """`rounds` uniform numbers per sampled row (`rows`) [n, rounds], on the logits' device: a seeded row's from its
        own generator. A row whose generator cannot be made goes into `failed`."""
        k = self.rounds
        u = torch.rand(len(rows), k, device=dev)
        for j, i in enumerate(rows):
            try:
                gen = self._generator(reqs[i], dev)
                if gen is not None:
                    u[j] = torch.rand(k, generator=gen, device=dev)
            except Exception as e:  # noqa: BLE001 - this row fails alone
                failed[i] = e
        return u

    def _host_paths(self, logits: torch.Tensor, reqs: list[Request], sampled: list[int], u: torch.Tensor,
                    greedy: bool) -> list[int]:
        """The backend's host calls (CPU kernels), each falling back to the torch ops where it cannot run."""
        if greedy:
            out: list[int] = self.argmax(logits) if self.argmax is not None else _first_max(logits).tolist()
        else:
            out = [0] * len(reqs)
        if sampled:
            # each row by its own parameters, whatever its neighbours' (a seeded row draws the same token in any
            # batch): the kernel draws the rows it can (no min_p), the torch ops the others
            sreqs = [reqs[i] for i in sampled]
            got: dict[int, int] = {}
            kernel = [j for j, r in enumerate(sreqs) if r.params.min_p <= 0.0] if self.draw_rows is not None else []
            if kernel:
                ks = [sreqs[j] for j in kernel]
                drawn = self.draw_rows(logits, [sampled[j] for j in kernel], [r.params.temperature for r in ks],
                                       _top_ks(ks, logits.shape[-1]), [r.params.top_p for r in ks], u[kernel, 0])
                if drawn is not None:
                    got.update(zip(kernel, drawn))
            rest = [j for j in range(len(sreqs)) if j not in got]
            if rest:
                drawn = self._sample_rows(logits, [sreqs[j] for j in rest], [sampled[j] for j in rest], u[rest])
                got.update(zip(rest, drawn.tolist()))
            for j, i in enumerate(sampled):
                out[i] = got[j]
        return out

    def _device_paths(self, logits: torch.Tensor, reqs: list[Request], sampled: list[int], u: torch.Tensor,
                      greedy: bool) -> torch.Tensor:
        """Greedy and sampled rows on the logits' device: the tokens [R] there (-1: a row that failed)."""
        dev = logits.device
        if greedy:
            tokens = _first_max(logits)
        else:
            tokens = torch.zeros(len(reqs), dtype=torch.long, device=dev)
        if sampled:
            drawn = self._sample_rows(logits, [reqs[i] for i in sampled], sampled, u)
            if len(sampled) == len(reqs):
                tokens = drawn
            else:
                tokens[_to(sampled, dev)] = drawn
        return tokens

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request], rows: list[int], u: torch.Tensor) -> torch.Tensor:
        """The sampled rows together, on the logits' device: temperature, top-k, softmax, top-p, then each row's
        draw with its uniform numbers (u [n, rounds]). -1 for a row whose probabilities are not finite."""
        dev = logits.device
        n = len(reqs)
        x = (logits if len(rows) == logits.shape[0] else logits[_to(rows, dev)]).float()
        x.div_(_to([r.params.temperature for r in reqs], dev).unsqueeze(-1))
        width = x.shape[-1]
        ks = _top_ks(reqs, width)
        kmax = max(ks)
        if kmax:
            kt = _to(ks, dev)
            kth = torch.topk(x, kmax, dim=-1).values.gather(-1, (kt - 1).clamp_(min=0).unsqueeze(-1))
            x.masked_fill_((x < kth) & (kt > 0).unsqueeze(-1), float("-inf"))
        min_ps = [r.params.min_p for r in reqs]
        if any(m > 0.0 for m in min_ps):  # min_p: a token at least min_p x the likeliest one's probability, i.e. a
            # logit at least the largest + log(min_p) (after temperature; top-k keeps the largest, so in any order)
            floor = torch.log(_to(min_ps, dev, torch.float32)).unsqueeze(-1)  # log(0) = -inf: no floor
            x.masked_fill_(x < x.max(dim=-1, keepdim=True).values + floor, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        total = probs.sum(dim=-1)  # NaN where a row's logits held one: that row fails alone
        ok = torch.isfinite(total) & (total > 0)
        probs = torch.where(ok.unsqueeze(-1), probs, 1.0)  # a failed row draws from anything finite, then is dropped
        top_ps = [r.params.top_p for r in reqs]
        nucleus = [j for j, p in enumerate(top_ps) if p < 1.0]
        if not nucleus:
            tokens = _draw(probs, u[:, 0])
        elif len(nucleus) == n:
            tokens = self._nucleus_draw(probs, _to(top_ps, dev), u, total, ok)
        else:
            tokens = _draw(probs, u[:, 0])
            sel = _to(nucleus, dev)
            tokens[sel] = self._nucleus_draw(probs[sel], _to([top_ps[j] for j in nucleus], dev),
                                             u[sel], total[sel], ok[sel])
        return torch.where(ok, tokens, -1)

    def _nucleus_draw(self, probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, total: torch.Tensor,
                      ok: torch.Tensor) -> torch.Tensor:
        if self.top_p_draw is None:
            return _top_p_draw(probs, top_p, u[:, 0])
        return self.top_p_draw(probs, top_p, u, torch.where(ok, total, float(probs.shape[-1])))


def _logprob_columns(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of log-probabilities `raw` [n, V], each row's `tokens` entry and the k largest: values [n, 1 + k] (the
    token's first) and ids [n, 1 + k] (the token's rank first: how many tokens are at least as likely, itself and
    those it ties counted, as vLLM ranks; then the k ids). A token at or past V (an id the tokenizer does not have)
    is -inf, ranked below all (V + 1)."""
    width = raw.shape[-1]
    chosen = raw.gather(-1, tokens.clamp(max=width - 1).unsqueeze(-1))
    past = (tokens >= width).unsqueeze(-1)
    chosen.masked_fill_(past, float("-inf"))
    rank = torch.where(past, width + 1, (raw >= chosen).sum(dim=-1, keepdim=True))
    k = min(k, width)
    if not k:
        return chosen, rank
    top = torch.topk(raw, k, dim=-1)
    return torch.cat((chosen, top.values), dim=-1), torch.cat((rank, top.indices), dim=-1)


def _log_softmax_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The log-probabilities of `rows` of the logits, in float32 (a new tensor: the draw changes the logits next)."""
    x = logits if len(rows) == logits.shape[0] else logits[_to(rows, logits.device)]
    return torch.log_softmax(x.float(), dim=-1)


class SampledTokens:
    """A step's sampled tokens: on the device where they were drawn (`device_tokens`: the next step's inputs read them
    there) and, once `result()` has waited for its copy, on the host. -1 marks a row whose probabilities were not
    finite; `failed` holds the rows whose own sampling raised. Rows that asked for them carry their log-probabilities
    (`with_logprobs`, `logprobs()`), copied with the tokens."""

    __slots__ = ("_host", "_device", "_ready", "_failed", "_lp", "prompt")

    def __init__(self, host: list[int] | torch.Tensor, failed: dict[int, Exception] | None = None,
                 device: torch.Tensor | None = None, ready: "torch.cuda.Event | None" = None) -> None:
        self._host = host
        self._device = device
        self._ready = ready
        self._failed = failed or {}
        # rows' log-probabilities: as tensors until read ((row, top count) pairs, values [m, 1 + k], ids [m, 1 + k]:
        # the drawn token's and its rank first), then as `RowLogprobs` by row
        self._lp: tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor] | dict[int, RowLogprobs] | None = None
        # the step's prompt logprobs by request id (`Sampler.prompt_logprobs`), where it computed some
        self.prompt: dict[str, tuple[int, list[RowLogprobs]]] | None = None

    @classmethod
    def of(cls, tokens: list[int | Exception], logprobs: dict[int, RowLogprobs] | None = None) -> "SampledTokens":
        """Tokens already on the host (an exception for a row that failed), and the log-probabilities of rows that
        have them."""
        failed = {i: t for i, t in enumerate(tokens) if isinstance(t, Exception)}
        out = cls([0 if isinstance(t, Exception) else t for t in tokens], failed)
        out._lp = logprobs or None
        return out

    def with_logprobs(self, raw: torch.Tensor, rows: list[tuple[int, int]]) -> "SampledTokens":
        """These tokens with the log-probabilities of `rows` ((row, top count) pairs): `raw` [len(rows), V] holds
        their log-softmax, on the device the tokens were drawn on. The drawn token's log-probability and rank and
        the top ones are picked there and copied to the host with the tokens (CUDA: one wait for both)."""
        dev = raw.device
        picked = self.device_tokens(dev)
        if len(rows) != picked.shape[0]:
            picked = picked[_to([i for i, _ in rows], dev, torch.long)]
        # (a failed row's -1 reads token 0: the row is dropped)
        vals, ids = _logprob_columns(raw, picked.clamp(min=0), max(k for _, k in rows))
        if dev.type == "cuda":
            vals_h = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
            ids_h = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            vals_h.copy_(vals, non_blocking=True)
            ids_h.copy_(ids, non_blocking=True)
            vals, ids = vals_h, ids_h
            self._ready = torch.cuda.Event()  # after the tokens' copy too: one wait for all
            self._ready.record()
        self._lp = (rows, vals, ids)
        return self

    def logprobs(self) -> dict[int, RowLogprobs]:
        """The log-probabilities of the rows that have them, by row (waits for the device)."""
        if isinstance(self._lp, tuple):
            if self._ready is not None:
                self._ready.synchronize()
                self._ready = None
            rows, vals, ids = self._lp
            self._lp = {i: (v[0], int(r[0]), tuple(zip(r[1:k + 1], v[1:k + 1])))
                        for (i, k), v, r in zip(rows, vals.tolist(), ids.tolist())}
        return self._lp or {}

    @classmethod
    def on_device(cls, tokens: torch.Tensor, failed: dict[int, Exception]) -> "SampledTokens":
        """Tokens drawn on `tokens.device`: a CUDA device's start a non-blocking copy into pinned host memory now."""
        if tokens.device.type != "cuda":
            return cls(tokens, failed, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(host, failed, tokens, ready)

    def device_tokens(self, device: torch.device) -> torch.Tensor:
        """The tokens as a long tensor where they were drawn, or on `device` if they were drawn on the host (the next
        step's inputs resolve their placeholders from it)."""
        if self._device is None:  # drawn on the host (the CPU kernels' paths)
            host = self._host if isinstance(self._host, torch.Tensor) else torch.tensor(self._host, dtype=torch.long)
            self._device = host.to(device)
        return self._device

    def result(self) -> list[int | Exception]:
        """One token per row (waits for the device): the exception of a row that failed."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        toks = self._host.tolist() if isinstance(self._host, torch.Tensor) else self._host
        out: list[int | Exception] = [t if t >= 0 else RuntimeError(NOT_FINITE) for t in toks]
        for i, e in self._failed.items():
            out[i] = e
        return out
