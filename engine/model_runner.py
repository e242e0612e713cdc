"""Runs one step (any mix of prefills and decodes) as a single packed forward over the paged cache."""
from __future__ import annotations

import torch

from engine.attention import AttnMetadata, DecodeGroup, PagedTokens, Workspace
from engine.cpu_kernels import CpuKernels
from engine.decoder import KairosDecoder
from engine.kv_cache import KVCache
from core.request import Request


# A decode group costs a gather + SDPA call per layer; about this many blocks' worth of padded work. A longer
# request starts a new group once joining would pad the group's members by more than that in total.
GROUP_OVERHEAD_BLOCKS = 16
# With the CPU kernels, a prefill whose context (prefix included) is at most this many tokens attends through the
# paged decode kernel, one query row per token; a longer one through SDPA, which shares each K/V read among many
# queries. In fp32 SDPA's flash kernel is faster on long prompts (one prompt of 1,000 tokens on kairos-tiny: 120
# against 134 ms; 2,048 on SmolLM2: 3.6 against 4.4 s, with the packed fp32 GEMM; `python -m bench.step prefill`,
# bench/README.md).
PAGED_PREFILL_MAX = 256
# In bf16 where the kernels' attention and GEMMs run on AVX512-BF16's dot product without AMX (AMD Zen 4), the paged
# kernel, whose steps also run every layer in one call, beat SDPA at every length measured up to 4,096 tokens (1.03x
# there, 1.12-1.29x at 300-2,048). On AMX, SDPA may do better: not measured, so 256 there.
PAGED_PREFILL_MAX_AVX512_BF16 = 4096


def paged_prefill_max(kernels: CpuKernels | None, cache_dtype: torch.dtype) -> int:
    """The longest context (in tokens) whose prefill attends through the paged kernel (0: none, no kernels)."""
    if kernels is None:
        return 0
    if cache_dtype == torch.bfloat16 and kernels.packed_isa == "avx512_bf16":
        return PAGED_PREFILL_MAX_AVX512_BF16
    return PAGED_PREFILL_MAX


def group_by_length(needs: list[int], overhead: int = GROUP_OVERHEAD_BLOCKS) -> list[tuple[int, int]]:
    """Split ascending block counts into contiguous [start, end) groups, each padded to its last (longest)."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(needs):
        if i > start and n * (i - start) - total > overhead:
            groups.append((start, i))
            start, total = i, 0
        total += n
    if needs:
        groups.append((start, len(needs)))
    return groups


class ModelRunner:
    """Runs a step with `KairosDecoder` when given one (Llama-family models), else with the HF forward."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device,
                 decoder: KairosDecoder | None = None, kernels: CpuKernels | None = None) -> None:
        self.model = model
        self.decoder = decoder
        self.kernels = kernels  # decode attention through the CPU kernel (no groups, no gather)
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        self.workspace = Workspace()
        # prefills of up to this many tokens of context attend through the paged kernel (benchmarks compare others)
        self.paged_prefill_max = paged_prefill_max(kernels, cache.dtype)

    def _slots(self, req: Request, start: int, end: int) -> list[int]:
        bs, table = self.block_size, req.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, prefill: list[Request], decode: list[Request], ends: list[int] | None = None
                ) -> tuple[dict, AttnMetadata]:
        """The step's inputs: each prefill computes its positions [num_computed_tokens, end) (`ends`, default its
        num_tokens) and has an output row only if it reaches its num_tokens; each decode its last token."""
        ends = ends if ends is not None else [r.num_tokens for r in prefill]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills = []
        dev = self.device
        bs = self.block_size
        # With the CPU kernels, prefills of up to `self.paged_prefill_max` tokens of context attend through the decode
        # kernel too, one query row per token (its context: the positions up to its own): one call for the step's
        # prompts and its decodes. Longer prompts keep SDPA.
        kernel_rows = self.kernels is not None
        paged_prefill = [end <= self.paged_prefill_max for end in ends]  # 0 without the kernels: none
        order_p = sorted(range(len(prefill)), key=paged_prefill.__getitem__)  # SDPA prefills first, then the rest
        last_idx: list[int | None] = [None] * len(prefill)
        row_tables: list[tuple[list[int], int]] = []  # per paged request: its blocks, and its rows in this step
        row_lens: list[int] = []  # per paged row: its context length
        paged_start = None
        for i in order_p:
            r = prefill[i]
            start, end = r.num_computed_tokens, ends[i]
            q_start = len(tokens)
            tokens.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(r, start, end))
            if end == r.num_tokens:  # a chunk that leaves prompt for later samples nothing
                last_idx[i] = len(tokens) - 1
            if paged_prefill[i]:
                paged_start = q_start if paged_start is None else paged_start
                row_tables.append((r.block_table[:-(-end // bs)], end - start))
                row_lens.extend(range(start + 1, end + 1))
                continue
            blocks = None
            if start > 0:  # cached prefix: attend over the cache
                nblk = -(-end // bs)
                blocks = torch.tensor(r.block_table[:nblk], dtype=torch.long, device=dev)
            prefills.append((q_start, end - start, end, blocks))
        need = [-(-r.num_tokens // bs) for r in decode]
        if kernel_rows:
            order = list(range(len(decode)))
        else:  # packed by length for the groups; logits keep request order
            order = sorted(range(len(decode)), key=need.__getitem__)
        decode_start = len(tokens)
        rank = [0] * len(decode)
        for pos, i in enumerate(order):
            r = decode[i]
            rank[i] = pos
            p = r.num_tokens - 1
            tokens.append(r.token_ids[-1])
            positions.append(p)
            slots.append(r.block_table[p // bs] * bs + p % bs)
        rows = [x for x in last_idx if x is not None]
        rows.extend(decode_start + rank[i] for i in range(len(decode)))
        groups = []
        paged = None
        if kernel_rows and (decode or row_lens):
            dec_tables = [r.block_table[:need[i]] for i, r in enumerate(decode)]
            row_lens.extend(r.num_tokens for r in decode)
            width = max([len(t) for t, _ in row_tables] + [len(t) for t in dec_tables])
            # a prompt's rows share its table: one padded row per prompt, repeated by torch (a 4,096-token prompt
            # has 4,096 rows of 256 blocks: 60 ms to build as Python lists, 2 ms this way); the decodes' rows in
            # one list, as one tensor
            parts = [torch.tensor(t + [0] * (width - len(t)), dtype=torch.int32).expand(n, width)
                     for t, n in row_tables]
            if dec_tables:
                flat: list[int] = []
                for t in dec_tables:
                    flat.extend(t)
                    flat.extend([0] * (width - len(t)))
                parts.append(torch.tensor(flat, dtype=torch.int32).view(len(dec_tables), width))
            tables = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
            lens = torch.tensor(row_lens, dtype=torch.int32)
            paged = PagedTokens(self.kernels, decode_start if paged_start is None else paged_start, tables, lens)
        for g0, g1 in ([] if paged else group_by_length([need[i] for i in order], GROUP_OVERHEAD_BLOCKS)):
            members = order[g0:g1]
            nb = need[members[-1]]
            flat: list[int] = []
            for i in members:
                flat.extend(decode[i].block_table[:need[i]])
                flat.extend([0] * (nb - need[i]))
            ctx_t = torch.tensor([decode[i].num_tokens for i in members], device=dev)
            mask = (torch.arange(nb * bs, device=dev)[None, :] < ctx_t[:, None]).view(len(members), 1, 1, nb * bs)
            groups.append(DecodeGroup(decode_start + g0, len(members), nb,
                                      torch.tensor(flat, dtype=torch.long, device=dev), mask))
        meta = AttnMetadata(
            cache=self.cache, workspace=self.workspace,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=prefills, decode_groups=groups, paged=paged, max_position=max(positions, default=0),
        )
        inputs = {
            "input_ids": torch.tensor([tokens], dtype=torch.long, device=dev),
            "position_ids": torch.tensor([positions], dtype=torch.long, device=dev),
            "logits_to_keep": torch.tensor(rows, dtype=torch.long, device=dev),
        }
        return inputs, meta

    @torch.inference_mode()
    def forward(self, inputs: dict, meta: AttnMetadata) -> torch.Tensor:
        """Logits [n_requests, vocab] for the last token of each request, in `prefill + decode` order."""
        if self.decoder is not None:
            return self.decoder(inputs["input_ids"][0], inputs["position_ids"][0], inputs["logits_to_keep"], meta)
        out = self.model(**inputs, use_cache=False, kairos=meta)
        return out.logits[0]

    def execute(self, prefill: list[Request], decode: list[Request], ends: list[int] | None = None) -> torch.Tensor:
        inputs, meta = self.prepare(prefill, decode, ends)
        return self.forward(inputs, meta)
