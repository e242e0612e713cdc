"""Batched sampling: greedy rows in one argmax; temperature / top-k / top-p rows together, each drawn with one
uniform number from its request's own seeded generator (or the sampler's).

The sampler reads requests and never changes them; the seeded RNGs are its own, keyed by request id
(`release` drops one when its request ends)."""
from __future__ import annotations

from typing import Callable

import torch

from core.request import Request

# top-p looks for the kept tokens among each row's most likely ones, this many first, then more, then in the whole
# row (`_nucleus`): `topk` of a few candidates costs a small part of a sort of the whole vocabulary
TOP_P_CANDIDATES = (64, 1024)
NOT_FINITE = "sampling: the probabilities are not finite"  # a row whose logits held a NaN or +inf fails alone


def _first_max(logits: torch.Tensor) -> list[int]:
    # max(dim).indices, like argmax, is the first maximum; on CPU it is 2-4x faster than argmax over a
    # [32, 49k] bf16 or fp32 batch (argmax there does not vectorise)
    return logits.max(dim=-1).indices.tolist()


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's index whose cumulative probability first exceeds u x the row's total (inverse CDF: a token is
    drawn with its probability; zero-probability tokens never). probs [n, m] >= 0, u [n] in [0, 1)."""
    c = torch.cumsum(probs, dim=-1)
    j = torch.searchsorted(c, (u * c[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return j.clamp_(max=probs.shape[-1] - 1)


def _nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's nucleus as a mask, without sorting the row: the probabilities' float bits order them, so the mass
    per bucket of their top 16 bits (sign, exponent, 7 bits of mantissa) finds the bucket where the mass from the
    top reaches top_p, and only that bucket's tokens (within 1% of each other) are sorted. Ties at the last kept
    probability stay in."""
    bucket = p.view(torch.int32) >> 16  # p >= 0: the bits grow with the value
    mass = torch.bincount(bucket, weights=p.double(), minlength=1 << 15)
    above = mass.flip(0).cumsum(0).flip(0) - mass  # mass of the buckets above each one
    reach = above + mass >= top_p  # the buckets from the top down to each one hold top_p
    b = int(torch.nonzero(reach).max()) if bool(reach.any()) else 0
    inside = torch.sort(p[bucket == b], descending=True).values
    need = top_p - float(above[b])  # what the boundary bucket must add
    cum = torch.cumsum(inside.double(), 0)
    last = int(torch.searchsorted(cum, torch.tensor([need], dtype=cum.dtype)).clamp(max=inside.numel() - 1))
    return (bucket > b) | ((bucket == b) & (p >= inside[last]))


def _top_p_draw(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw from each row's smallest set of most likely tokens whose mass reaches its top_p (the nucleus), in
    proportion to their probabilities. The nucleus is looked for among the row's `TOP_P_CANDIDATES` most likely
    tokens first; a row whose candidates do not reach top_p (a flat distribution) finds it with `_nucleus`."""
    out = torch.empty(probs.shape[0], dtype=torch.long)
    todo = torch.arange(probs.shape[0])
    for k in TOP_P_CANDIDATES:
        k = min(k, probs.shape[-1])
        vals, idx = torch.topk(probs[todo], k, dim=-1)  # sorted, most likely first
        cum = torch.cumsum(vals, dim=-1)
        p = top_p[todo]
        reached = (cum[:, -1] >= p) | (k == probs.shape[-1])
        kept = vals.masked_fill((cum - vals) > p.unsqueeze(-1), 0.0)  # the smallest prefix whose mass reaches top_p
        j = _draw(kept[reached], u[todo][reached])
        out[todo[reached]] = idx[reached].gather(-1, j.unsqueeze(-1)).squeeze(-1)
        todo = todo[~reached]
        if todo.numel() == 0:
            return out
    for i in todo.tolist():
        kept = probs[i].masked_fill(~_nucleus(probs[i], float(top_p[i])), 0.0)
        out[i] = _draw(kept.unsqueeze(0), u[i : i + 1])[0]
    return out


# (logits, rows, temperatures, top-ks, top-ps, uniforms) -> a token per row (-1: the row's logits are not finite),
# or None where it cannot run on these logits: `CpuKernels.sample_rows`
DrawRows = Callable[[torch.Tensor, list[int], list[float], list[int], list[float], torch.Tensor], list[int] | None]


class Sampler:
    def __init__(self, vocab_limit: int, eos_token_ids: list[int], device: torch.device,
                 argmax: Callable[[torch.Tensor], list[int]] | None = None, draw: DrawRows | None = None) -> None:
        """`argmax`: each row's first maximum as a list (`CpuKernels.argmax_rows` on CPU), else torch's. `draw`:
        the sampled rows in one call (`CpuKernels.sample_rows` on CPU: each row touches its logits once, instead
        of torch's softmax, cumsum and top-k over the whole batch), else the torch ops below."""
        self.vocab_limit = vocab_limit
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.argmax = argmax or _first_max
        self.draw = draw
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(req.params.seed)
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int | Exception]:
        """One token per request; a request whose own sampling fails gets its exception instead. The logits are
        the sampler's to change (a step's fresh output)."""
        if logits.shape[-1] > self.vocab_limit:  # rows the tokenizer cannot decode are never sampled
            logits = logits[:, : self.vocab_limit]
        # below min_tokens, EOS and the stop token ids cannot be drawn (EOS even with ignore_eos, as in vLLM): one
        # masked write for the whole batch, in place
        rows: list[int] = []
        cols: list[int] = []
        width = logits.shape[-1]
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens:
                ban = {t for t in (*self.eos_token_ids, *r.params.stop_token_ids) if 0 <= t < width}
                rows.extend([i] * len(ban))
                cols.extend(ban)
        if rows:
            dev = logits.device
            logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        out: list[int | Exception] = self.argmax(logits) if len(sampled) < len(reqs) else [0] * len(reqs)
        if sampled:
            for i, tok in zip(sampled, self._sample_rows(logits, [reqs[i] for i in sampled], sampled)):
                out[i] = tok
        return out

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> list[int | Exception]:
        """The sampled rows together: temperature, top-k (per row), softmax, then each row's draw, with one uniform
        number per row from its request's generator (seeded requests) or the default one."""
        u = torch.rand(len(reqs))
        for j, r in enumerate(reqs):
            gen = self._generator(r)
            if gen is not None:
                u[j] = torch.rand((), generator=gen)
        if self.draw is not None:
            drawn = self.draw(logits, rows, [r.params.temperature for r in reqs], [r.params.top_k or 0 for r in reqs],
                              [r.params.top_p for r in reqs], u)
            if drawn is not None:
                return [t if t >= 0 else RuntimeError(NOT_FINITE) for t in drawn]
        x = (logits if len(rows) == logits.shape[0] else logits[rows]).float()  # fp32; the logits are ours to change
        x.div_(torch.tensor([[r.params.temperature] for r in reqs]))
        for j, r in enumerate(reqs):
            k = r.params.top_k
            if k and 0 < k < x.shape[-1]:
                kth = torch.topk(x[j], k).values[-1]
                x[j].masked_fill_(x[j] < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        total = probs.sum(dim=-1)  # NaN where a row's logits held one: that row fails alone
        ok = torch.isfinite(total) & (total > 0)
        top_p = torch.tensor([r.params.top_p for r in reqs])
        nucleus = ok & (top_p < 1.0)
        plain = ok & ~nucleus
        if bool(plain.all()):  # the common case, without copies
            tokens = _draw(probs, u)
        else:
            tokens = torch.zeros(len(reqs), dtype=torch.long)
            if plain.any():
                tokens[plain] = _draw(probs[plain], u[plain])
            if nucleus.any():
                tokens[nucleus] = _top_p_draw(probs[nucleus], top_p[nucleus], u[nucleus])
        return [int(t) if good else RuntimeError(NOT_FINITE)
                for t, good in zip(tokens.tolist(), ok.tolist())]
