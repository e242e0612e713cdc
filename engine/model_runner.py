"""Runs one step (any mix of prefills and decodes) as a single packed forward over the paged cache."""
from __future__ import annotations

import torch

from engine.attention import AttnMetadata, Workspace
from engine.kv.cache import KVCache
from engine.request import Request


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        self.workspace = Workspace()

    def _slots(self, req: Request, start: int, end: int) -> list[int]:
        bs, table = self.block_size, req.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, prefill: list[Request], decode: list[Request]) -> tuple[dict, AttnMetadata]:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_idx: list[int] = []
        prefills = []
        dev = self.device
        for r in prefill:
            start, end = r.num_computed_tokens, r.num_tokens
            q_start = len(tokens)
            tokens.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(r, start, end))
            last_idx.append(len(tokens) - 1)
            blocks = None
            if start > 0:  # cached prefix: attend over the cache
                nblk = -(-end // self.block_size)
                blocks = torch.tensor(r.block_table[:nblk], dtype=torch.long, device=dev)
            prefills.append((q_start, end - start, end, blocks))
        decode_start = len(tokens)
        bs = self.block_size
        if decode:
            nb = max(-(-r.num_tokens // bs) for r in decode)
            flat: list[int] = []
            ctx: list[int] = []
            for r in decode:
                p = r.num_tokens - 1
                tokens.append(r.token_ids[-1])
                positions.append(p)
                table = r.block_table
                slots.append(table[p // bs] * bs + p % bs)
                need = -(-r.num_tokens // bs)
                flat.extend(table[:need])
                flat.extend([0] * (nb - need))
                ctx.append(r.num_tokens)
            last_idx.extend(range(decode_start, len(tokens)))
            ctx_t = torch.tensor(ctx, device=dev)
            mask = (torch.arange(nb * bs, device=dev)[None, :] < ctx_t[:, None]).view(len(decode), 1, 1, nb * bs)
            decode_blocks = torch.tensor(flat, dtype=torch.long, device=dev)
        else:
            nb, mask, decode_blocks = 0, None, None
        meta = AttnMetadata(
            cache=self.cache, workspace=self.workspace,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=prefills, decode_start=decode_start, num_decode=len(decode),
            decode_blocks=decode_blocks, decode_nb=nb, decode_mask=mask,
        )
        inputs = {
            "input_ids": torch.tensor([tokens], dtype=torch.long, device=dev),
            "position_ids": torch.tensor([positions], dtype=torch.long, device=dev),
            "logits_to_keep": torch.tensor(last_idx, dtype=torch.long, device=dev),
        }
        return inputs, meta

    @torch.inference_mode()
    def forward(self, inputs: dict, meta: AttnMetadata) -> torch.Tensor:
        """Logits [n_requests, vocab] for the last token of each request, prefills first."""
        out = self.model(**inputs, use_cache=False, kairos=meta)
        return out.logits[0]

    def execute(self, prefill: list[Request], decode: list[Request]) -> torch.Tensor:
        inputs, meta = self.prepare(prefill, decode)
        return self.forward(inputs, meta)
