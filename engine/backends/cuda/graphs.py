"""CUDA graphs for steps of our decoder (`engine.decoder.KairosDecoder`): decode-only steps (`DecodeGraphs`), and
steps with prefill rows up to a token count (`MixedGraphs`).

At start, one graph is captured per batch size of a ladder up to `max_num_seqs` (1, 2, 4, 8, then every 16, as
nano-vllm does), largest first, all sharing one memory pool. Each graph reads persistent input buffers: token ids,
positions, cache slots, block tables [B, window / block_size], context lengths, and writes the last hidden states of
its B rows; the final norm and the LM head run after the replay, on the step's n rows only (as vLLM's and nano-vllm's:
logits [B, vocab] kept per captured size would hold memory of the card, a vocabulary's width per row, that the KV
cache's sizing never counted). A step of n decodes replays the smallest graph of at least n rows: the host fills
pinned staging buffers (two sets, in turn), one non-blocking copy each moves them to the device, placeholder token
ids (overlap scheduling) are read from the previous step's tokens on the device, and the padding rows (token 0,
position 0, the cache's scratch slot, context length 0) write their K/V into the scratch block and attend to nothing.
The split-K count of each graph's decode attention is fixed from shapes at capture, with its own preallocated
workspace. Without a captured graph (`replay` before `capture`, or on a CPU device) the same buffers run eagerly: how
the CPU checks this path under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import logging
import time

import torch

from core.request import Request
from engine.backends.base import pack, resolve_placeholders
from engine.backends.cuda.backend import CudaAttnMetadata

log = logging.getLogger("kairos.cuda")


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the warm-up runs before each capture, kept for the process: cuBLAS holds a
    workspace per (handle, stream) that emptying the cache does not free, so a new stream per engine start would
    leave one behind each time."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _STREAMS:
        _STREAMS[i] = torch.cuda.Stream(device)
    return _STREAMS[i]


def ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, backend, decoder, cache, max_batch: int, max_model_len: int) -> None:
        self.backend, self.decoder, self.cache = backend, decoder, cache
        self.device = backend.device
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // cache.block_size)
        dev, B, W = self.device, max_batch, self.width
        # device buffers the graphs read
        self.ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.full((B,), cache.scratch_slot, dtype=torch.long, device=dev)
        self.tables = torch.zeros(B, W, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(B, dtype=torch.int32, device=dev)
        # pinned host staging, one copy per buffer per step; two sets, used in turn, so that a step's host work
        # never waits for the copies of the step before (overlap scheduling launches a step while that one runs)
        pin = dev.type == "cuda"
        self.h_ids = torch.zeros(2, B, dtype=torch.long, pin_memory=pin)
        self.h_pos = torch.zeros(2, B, dtype=torch.long, pin_memory=pin)
        self.h_slots = torch.zeros(2, B, dtype=torch.long, pin_memory=pin)
        self.h_lens = torch.zeros(2, B, dtype=torch.int32, pin_memory=pin)
        self.h_tables = torch.zeros(2, B, W, dtype=torch.int32, pin_memory=pin)
        self._set = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = ladder(max_batch)
        self.pool = None
        self._metas: dict[int, CudaAttnMetadata] = {}
        self._workspaces: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each staging set's last copies
        # what each staging row of each set's block tables holds: (the request, its preemptions, blocks written). A
        # request that keeps its row (the usual case: the running batch changes little) gets only its new blocks
        # written: a running request's table only grows, and a preemption (which gives it new blocks) changes the key
        self._rows: list[list[tuple[Request, int, int] | None]] = [[None] * max_batch, [None] * max_batch]

    def _meta(self, b: int) -> CudaAttnMetadata:
        if b not in self._metas:
            ops = self.backend.ops
            kvh, hd = self.cache.num_kv_heads, self.cache.head_dim
            heads = self.decoder.num_heads
            splits = ops.choose_num_splits(b, kvh, self.width * self.cache.block_size, ops.num_sms_of(self.device))
            ws = ops.alloc_decode_workspace(b, heads, hd, splits, self.device)
            self._workspaces.append(ws)
            self._metas[b] = CudaAttnMetadata(self.backend, self.cache, self.slots[:b], self.max_model_len - 1,
                                              decode_start=0, decode_tables=self.tables[:b],
                                              decode_lens=self.lens[:b], num_splits=splits, workspace_splits=ws)
        return self._metas[b]

    def _forward(self, b: int) -> torch.Tensor:
        """The last hidden states [b, hidden] of a batch of b (the LM head runs after, on the step's rows only)."""
        return self.decoder(self.ids[:b], self.pos[:b], None, self._meta(b))

    @torch.inference_mode()
    def capture(self) -> dict:
        t0 = time.perf_counter()
        sizes = self.sizes
        stream = _side_stream(self.device)
        for b in reversed(sizes):
            # compile the kernels for this shape (and let the allocator settle) before capture
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(b)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        report = {"graphs": len(sizes), "max_batch": self.max_batch, "capture_s": round(time.perf_counter() - t0, 2)}
        log.info("captured decode graphs: %s", report)
        return report

    def replay(self, decode: list[Request], prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        n = len(decode)
        b = next(s for s in self.sizes if s >= n)
        k = self._set
        self._set ^= 1
        if self._copied[k] is not None:  # this set is free once its copies (two steps ago) are done
            self._copied[k].synchronize()
        h_ids, h_pos, h_slots, h_lens, h_tables = (self.h_ids[k], self.h_pos[k], self.h_slots[k], self.h_lens[k],
                                                   self.h_tables[k])
        rows = self._rows[k]
        bs = self.cache.block_size
        ids, pos, slots, lens = [], [], [], []
        tables = h_tables.numpy()
        for i, r in enumerate(decode):
            p = r.num_tokens - 1
            table = r.block_table
            ids.append(r.token_ids[-1])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            lens.append(r.num_tokens)
            nb = p // bs + 1
            held = rows[i]
            done = held[2] if held is not None and held[0] is r and held[1] == r.num_preemptions else 0
            if done < nb:
                tables[i, done:nb] = table[done:nb]
                rows[i] = (r, r.num_preemptions, nb)
        pad = b - n
        if pad:
            ids += [0] * pad
            pos += [0] * pad
            slots += [self.cache.scratch_slot] * pad
            lens += [0] * pad
        h_ids[:b] = torch.tensor(ids, dtype=torch.long)
        h_pos[:b] = torch.tensor(pos, dtype=torch.long)
        h_slots[:b] = torch.tensor(slots, dtype=torch.long)
        h_lens[:b] = torch.tensor(lens, dtype=torch.int32)
        nbk = self.device.type != "cpu"
        self.ids[:b].copy_(h_ids[:b], non_blocking=nbk)
        self.pos[:b].copy_(h_pos[:b], non_blocking=nbk)
        self.slots[:b].copy_(h_slots[:b], non_blocking=nbk)
        self.lens[:b].copy_(h_lens[:b], non_blocking=nbk)
        self.tables[:n].copy_(h_tables[:n], non_blocking=nbk)  # whole rows: one contiguous copy
        if prev_tokens is not None:  # overlap scheduling: the last step's tokens, still on the device
            self.ids[:b].copy_(resolve_placeholders(self.ids[:b], prev_tokens))
        if self.device.type == "cuda":
            self._copied[k] = torch.cuda.Event()
            self._copied[k].record()
        if b in self.graphs:
            graph, hidden = self.graphs[b]
            graph.replay()
        else:
            hidden = self._forward(b)
        return self.decoder.head(hidden[:n])

    def release(self) -> None:
        self.graphs.clear()
        self._rows = [[None] * self.max_batch, [None] * self.max_batch]
        self._copied = [None, None]
        self._metas.clear()
        self._workspaces.clear()
        self.pool = None


# token counts the mixed graphs are captured at (steps of 64 above 256: a step pads by under a quarter)
MIXED_SIZES = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
MIXED_MAX_PROMPTS = 32  # prompts (and chunks) a mixed step may hold; a step with more runs eagerly
MIXED_SPLIT_SEQS = 16  # the decode kernel's split count in a mixed graph: that of a batch of this many decodes


def mixed_ladder(max_tokens: int) -> list[int]:
    """The token counts of the mixed graphs: those of `MIXED_SIZES` below `max_tokens`, then `max_tokens` (none for
    0)."""
    if max_tokens <= 0:
        return []
    return [t for t in MIXED_SIZES if t < max_tokens] + [max_tokens]


class MixedGraphs:
    """CUDA graphs for steps with prefill rows (prompts, prefill chunks, and the decodes riding with them), up to
    `max_tokens` tokens, where an eager forward costs more host time (a Python op and a launch per layer and op)
    than the GPU spends on its tokens.

    One graph per token count of `mixed_ladder`, captured at start after the decode graphs and into their memory
    pool; a step of n tokens replays the smallest graph of at least n. A graph of t tokens lays out the step as:
    rows [0, B) its B decodes, then its prompt chunks, then padding rows (token 0, position 0, the scratch slot, in
    no sequence). Everything is written to the cache first (the fused RoPE + cache write), then attention runs
    over the cache in two fixed-grid calls: the decode kernel over `seqs_of(t)` entries at rows [0, seqs_of(t))
    (its split count fixed at capture, `MIXED_SPLIT_SEQS`; the entries past B have context 0 and write zeros into
    their rows), then the paged prefill kernel over up to `prompts_of(t)` chunks (the unused ones have no query
    tokens; their programs exit at once), which writes the chunks' rows after. The graph ends at the last hidden
    states of its t rows; the final norm and the LM head run after the replay on the step's sampled rows only (in
    `prefill + decode` order).

    Without a captured graph (`run` before `capture`, or on a CPU device) the same buffers and metadata run eagerly:
    how the CPU checks this path under TRITON_INTERPRET=1."""

    def __init__(self, backend, decoder, cache, max_tokens: int, max_seqs: int, max_model_len: int) -> None:
        if not cache.scratch_blocks:
            raise ValueError("mixed graphs need a scratch block in the cache for their padding rows")
        self.backend, self.decoder, self.cache = backend, decoder, cache
        self.device = backend.device
        self.sizes = mixed_ladder(max_tokens)
        self.max_tokens = self.sizes[-1] if self.sizes else 0
        self.max_seqs = max(1, max_seqs)
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // cache.block_size)
        T = max(1, self.max_tokens)
        dev, S, P, W = self.device, self.seqs_of(T), self.prompts_of(T), self.width
        self.ids = torch.zeros(T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(T, dtype=torch.long, device=dev)
        self.slots = torch.full((T,), cache.scratch_slot, dtype=torch.long, device=dev)
        self.rows = torch.zeros(S, dtype=torch.long, device=dev)  # the sampled rows (read after the replay)
        self.d_lens = torch.zeros(S, dtype=torch.int32, device=dev)  # each decode's context (0: no decode)
        self.d_tables = torch.zeros(S, W, dtype=torch.int32, device=dev)
        self.starts = torch.zeros(P + 1, dtype=torch.int32, device=dev)  # each chunk's first row, then the end
        self.lens = torch.zeros(P, dtype=torch.int32, device=dev)  # each chunk's sequence's tokens in the cache
        self.tables = torch.zeros(P, W, dtype=torch.int32, device=dev)
        pin = self.device.type == "cuda"
        # pinned host staging, two sets used in turn (as `DecodeGraphs`)
        self.h_tok = torch.zeros(2, 3, T, dtype=torch.long, pin_memory=pin)  # ids, positions, slots
        self.h_rows = torch.zeros(2, S, dtype=torch.long, pin_memory=pin)
        self.h_int = torch.zeros(2, S + 2 * P + 1, dtype=torch.int32, pin_memory=pin)  # d_lens, starts, lens
        self.h_dtables = torch.zeros(2, S, W, dtype=torch.int32, pin_memory=pin)
        self.h_tables = torch.zeros(2, P, W, dtype=torch.int32, pin_memory=pin)
        self._set = 0
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._metas: dict[int, CudaAttnMetadata] = {}
        self._workspace: torch.Tensor | None = None

    def seqs_of(self, t: int) -> int:
        """Requests a graph of t tokens holds (each has at least one token); also its decode entries."""
        return min(t, self.max_seqs)

    def prompts_of(self, t: int) -> int:
        """Prompt chunks a graph of t tokens holds."""
        return min(self.seqs_of(t), MIXED_MAX_PROMPTS)

    def fits(self, num_tokens: int, num_prompts: int, num_decodes: int) -> bool:
        return (0 < num_tokens <= self.max_tokens and num_prompts <= self.prompts_of(self.max_tokens)
                and num_prompts + num_decodes <= self.seqs_of(self.max_tokens))

    def _meta(self, t: int) -> CudaAttnMetadata:
        if t not in self._metas:
            s, p = self.seqs_of(t), self.prompts_of(t)
            ops, cache = self.backend.ops, self.cache
            heads, hd = self.decoder.num_heads, cache.head_dim
            # split-K as for a batch of at most MIXED_SPLIT_SEQS decodes: the step's decodes may be few (a burst's
            # first steps) where the size holds hundreds, and each long context would run in one program a head
            splits = ops.choose_num_splits(min(s, MIXED_SPLIT_SEQS), cache.num_kv_heads,
                                           self.width * cache.block_size, ops.num_sms_of(self.device))
            # one split-K workspace for every size (they never run at once): the first size met (the largest, in
            # `capture`) allocates it
            if self._workspace is None or self._workspace.numel() < ops.decode_workspace_numel(s, heads, hd, splits):
                self._workspace = ops.alloc_decode_workspace(s, heads, hd, splits, self.device)
            ws = self._workspace
            self._metas[t] = CudaAttnMetadata(
                self.backend, cache, self.slots[:t], self.max_model_len - 1, workspace=self.backend.workspace,
                decode_start=0, decode_tables=self.d_tables[:s], decode_lens=self.d_lens[:s], num_splits=splits,
                workspace_splits=ws, paged_start=0, paged_end=t, paged_tables=self.tables[:p],
                paged_query_start=self.starts[:p + 1], paged_seq_lens=self.lens[:p], paged_max_query=t)
        return self._metas[t]

    def _forward(self, t: int) -> torch.Tensor:
        """The step's last hidden states [t, hidden] (the LM head runs after, on the sampled rows only)."""
        return self.decoder(self.ids[:t], self.pos[:t], None, self._meta(t))

    @torch.inference_mode()
    def capture(self, pool=None) -> dict:
        t0 = time.perf_counter()
        stream = _side_stream(self.device)
        for t in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # compile this size's kernels, let the allocator settle
                self._forward(t)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(t)
            if pool is None:
                pool = graph.pool()
            self.graphs[t] = (graph, out)
        torch.cuda.synchronize(self.device)
        report = {"mixed_graphs": len(self.sizes), "mixed_max_tokens": self.max_tokens,
                  "mixed_capture_s": round(time.perf_counter() - t0, 2)}
        log.info("captured mixed graphs: %s", report)
        return report

    @torch.inference_mode()
    def run(self, step, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the step's sampled rows (`prefill + decode` order): the step laid into the buffers of the
        smallest size that holds it, then that size's graph replayed (run eagerly where none was captured). The
        caller checked `fits`."""
        bs = self.cache.block_size
        decode, prefill = step.decode, step.prefill
        p = pack(step, bs, decodes_first=True)  # rows [0, B) the decodes, then each chunk's rows
        B, P, n, sampled = len(decode), len(prefill), len(p.tokens), p.rows
        t = next(s for s in self.sizes if s >= n)
        s_cap, p_cap = self.seqs_of(t), self.prompts_of(t)
        k = self._set
        self._set ^= 1
        if self._copied[k] is not None:  # this set is free once its copies (two steps ago) are done
            self._copied[k].synchronize()
        d_tables, tables = self.h_dtables[k].numpy(), self.h_tables[k].numpy()
        for i, r in enumerate(decode):
            nb = -(-r.num_tokens // bs)
            d_tables[i, :nb] = r.block_table[:nb]
        for j, (i, _, _, end) in enumerate(p.spans):
            nb = -(-end // bs)
            tables[j, :nb] = prefill[i].block_table[:nb]
        pad = t - n
        h_tok, h_int = self.h_tok[k], self.h_int[k]
        h_tok[0, :t] = torch.tensor(p.tokens + [0] * pad, dtype=torch.long)
        h_tok[1, :t] = torch.tensor(p.positions + [0] * pad, dtype=torch.long)
        h_tok[2, :t] = torch.tensor(p.slots + [self.cache.scratch_slot] * pad, dtype=torch.long)
        self.h_rows[k, :len(sampled)] = torch.tensor(sampled, dtype=torch.long)
        h_int[:s_cap + 2 * p_cap + 1] = torch.tensor(
            [r.num_tokens for r in decode] + [0] * (s_cap - B)  # decode contexts
            + [q_start for _, q_start, _, _ in p.spans] + [n] * (p_cap + 1 - P)  # chunk starts, then the end
            + [end for *_, end in p.spans] + [0] * (p_cap - P), dtype=torch.int32)  # chunk sequence lengths
        nbk = self.device.type != "cpu"
        self.ids[:t].copy_(h_tok[0, :t], non_blocking=nbk)
        self.pos[:t].copy_(h_tok[1, :t], non_blocking=nbk)
        self.slots[:t].copy_(h_tok[2, :t], non_blocking=nbk)
        self.rows[:len(sampled)].copy_(self.h_rows[k, :len(sampled)], non_blocking=nbk)
        self.d_lens[:s_cap].copy_(h_int[:s_cap], non_blocking=nbk)
        self.starts[:p_cap + 1].copy_(h_int[s_cap:s_cap + p_cap + 1], non_blocking=nbk)
        self.lens[:p_cap].copy_(h_int[s_cap + p_cap + 1:s_cap + 2 * p_cap + 1], non_blocking=nbk)
        if B:
            self.d_tables[:B].copy_(self.h_dtables[k, :B], non_blocking=nbk)  # whole rows: one contiguous copy
        if P:
            self.tables[:P].copy_(self.h_tables[k, :P], non_blocking=nbk)
        if prev_tokens is not None:  # overlap scheduling: the last step's tokens, still on the device
            self.ids[:t].copy_(resolve_placeholders(self.ids[:t], prev_tokens))
        if self.device.type == "cuda":
            self._copied[k] = torch.cuda.Event()
            self._copied[k].record()
        if t in self.graphs:
            graph, hidden = self.graphs[t]
            graph.replay()
        else:
            hidden = self._forward(t)
        return self.decoder.head(hidden.index_select(0, self.rows[:len(sampled)]))

    def release(self) -> None:
        self.graphs.clear()
        self._metas.clear()
        self._workspace = None
        self._copied = [None, None]
