"""Prefix caching (vLLM's automatic prefix caching): the block manager's cached blocks, the scheduler's hits, and
the engine's replies over shared prefixes, token for token as HF computes them whole."""
import random
from dataclasses import dataclass, field

import pytest

from core.kv import BlockManager
from core.request import FinishReason, Request, Status
from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.testing import idle_stats
from scheduling.config import SchedulerConfig
from scheduling.predictor import LatencyModel
from scheduling.scheduler import Scheduler

from tests.test_engine import _hf_greedy


@dataclass
class Seq:
    block_table: list[int] = field(default_factory=list)


def _check(bm: BlockManager, held: list[Seq]) -> None:
    """Every block is exactly one of: free and uncached, cached and held by nobody (idle), or held; the holders'
    counts are the tables'; each cached block is its node's and its node hangs where its tokens say."""
    refs = [0] * bm.num_blocks
    for s in held:
        for b in s.block_table:
            refs[b] += 1
    assert refs == bm._refs
    free, idle = set(bm._free), set(bm._idle)
    assert len(free) == len(bm._free) and not free & idle
    assert all(refs[b] == 0 for b in free | idle) and all(b in bm._node for b in idle)
    assert all(b not in bm._node for b in free)
    assert free | idle | {b for b in range(bm.num_blocks) if refs[b]} == set(range(bm.num_blocks))
    assert bm.num_free == len(free) + len(idle)
    for b, node in bm._node.items():
        assert node.block == b and node.parent.children[node.tokens] is node


def test_a_registered_prefix_is_found_shared_and_kept_once_nobody_holds_it():
    bm = BlockManager(8, 4, caching=True)
    a = Seq()
    bm.ensure(a, 10)  # 3 blocks: [0, 1, 2]
    ids = list(range(100, 110))
    tail = bm.register(a, ids, 0, 2, bm.root)  # two full blocks
    assert [n.block for n in bm.lookup(ids, 9)] == [0, 1] and bm.num_cached == 2
    assert [n.block for n in bm.lookup(ids[:4] + [7, 7, 7, 7], 8)] == [0]  # the tokens decide, block by block
    assert bm.lookup(ids, 7) == bm.lookup(ids, 4)  # only whole blocks within the limit
    assert tail is bm.lookup(ids, 8)[-1]
    b = Seq()
    hits = bm.lookup(ids + [1, 2], 11)
    assert bm.blocks_to_share(hits) == 0  # a holds them: sharing takes no free block
    bm.share(b, hits)
    bm.ensure(b, 12)
    assert b.block_table[:2] == [0, 1] and bm._refs[0] == 2
    _check(bm, [a, b])
    bm.free(a)
    bm.free(b)
    _check(bm, [])
    assert bm.num_free == 8 and bm.num_cached == 2  # free, and still cached
    c = Seq()
    hits = bm.lookup(ids, 9)
    assert bm.blocks_to_share(hits) == 2
    bm.share(c, hits)
    _check(bm, [c])


def test_uncached_blocks_go_first_then_the_cached_least_recently_freed_with_what_follows_them():
    bm = BlockManager(6, 2, caching=True)
    a, b = Seq(), Seq()
    bm.ensure(a, 4)  # [0, 1]
    bm.ensure(b, 4)  # [2, 3]
    bm.register(a, [1, 2, 3, 4], 0, 2, bm.root)
    bm.register(b, [5, 6, 7, 8], 0, 2, bm.root)
    bm.free(a)  # its last block first: 1, then 0
    bm.free(b)  # 3, then 2
    assert list(bm._idle) == [1, 0, 3, 2]
    c = Seq()
    bm.ensure(c, 4)
    assert c.block_table == [4, 5] and bm.num_cached == 4  # the never-cached blocks first
    d = Seq()
    bm.ensure(d, 2)  # evicts 1 (a's second block): a's first stays cached
    assert d.block_table == [1] and [n.block for n in bm.lookup([1, 2, 3, 4], 4)] == [0]
    e = Seq()
    bm.ensure(e, 2)  # evicts 0
    assert e.block_table == [0] and bm.lookup([1, 2, 3, 4], 4) == []
    _check(bm, [c, d, e])
    # evicting a block evicts the cached blocks after it (nobody holds them: a holder holds all before)
    bm.free(c), bm.free(d), bm.free(e)
    f = Seq()
    bm.share(f, bm.lookup([5, 6, 7, 8], 4))  # revives 2, 3 (b's)
    bm.free(f)  # now 3, then 2, most recent
    g = Seq()
    bm.ensure(g, 12)  # every block: the uncached first, then 3 and 2
    assert sorted(g.block_table) == list(range(6)) and bm.num_cached == 0 and bm.lookup([5, 6, 7, 8], 4) == []
    _check(bm, [g])


def test_evicting_a_block_another_request_copied_leaves_that_requests_own_blocks_held():
    """Two requests computed the same first block each: the second's stays its own, its next block cached after the
    first's. When nobody holds the first's and it is evicted, the second's next block is uncached, not freed."""
    bm = BlockManager(5, 2, caching=True)
    a, b = Seq(), Seq()
    bm.ensure(a, 2)  # [0]
    bm.ensure(b, 4)  # [1, 2]
    bm.register(a, [1, 2], 0, 1, bm.root)
    tail = bm.register(b, [1, 2, 3, 4], 0, 2, bm.root)  # its block 1 is a copy of 0: 2 follows 0
    assert tail.block == 2 and tail.parent.block == 0 and 1 not in bm._node
    bm.free(a)
    c = Seq()
    bm.ensure(c, 6)  # 3, 4, then evicts 0 (and uncaches 2, which b holds)
    assert c.block_table == [3, 4, 0] and bm.num_cached == 0 and bm._refs[2] == 1
    _check(bm, [b, c])
    assert bm.register(b, [1, 2, 3, 4, 5, 6], 2, 3, tail) is None  # its chain broke off: it caches no more
    bm.free(b)
    _check(bm, [c])
    assert bm.num_free == 2


def test_a_failed_requests_own_blocks_leave_the_cache():
    bm = BlockManager(4, 2, caching=True)
    a, b = Seq(), Seq()
    bm.ensure(a, 4)
    bm.register(a, [1, 2, 3, 4], 0, 2, bm.root)
    bm.share(b, bm.lookup([1, 2, 3, 4, 5], 4))
    bm.free(a, keep_cached=False)  # b still holds both: they stay cached
    assert bm.num_cached == 2
    bm.free(b, keep_cached=False)
    assert bm.num_cached == 0 and bm.num_free == 4
    _check(bm, [])


def test_a_lookup_goes_on_from_an_earlier_ones_blocks_still_cached():
    bm = BlockManager(10, 2, caching=True)
    a = Seq()
    bm.ensure(a, 8)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    bm.register(a, ids, 0, 2, bm.root)
    early = bm.lookup(ids, 9)
    assert [n.block for n in early] == [0, 1]
    bm.register(a, ids, 2, 4, early[-1])  # more cached since: found from where it ended
    assert bm.lookup(ids, 9, early) == bm.lookup(ids, 9) and len(bm.lookup(ids, 9, early)) == 4
    later = bm.lookup(ids, 9)
    bm.free(a)  # idle: 3, 2, 1, 0 (its last first)
    b = Seq()
    bm.ensure(b, 14)  # the 6 uncached, then 3: its third and fourth blocks stay
    bm.ensure(b, 16)  # and 2
    assert [n.block for n in bm.lookup(ids, 9, later)] == [n.block for n in bm.lookup(ids, 9)] == [0, 1]
    with pytest.raises(AssertionError):
        bm.share(Seq(), later)  # (its last blocks were uncached)


def test_random_traffic_keeps_every_block_accounted_for():
    rng = random.Random(0)
    bm = BlockManager(40, 4, caching=True)
    live: list[tuple[Seq, list[int], object, int]] = []  # (seq, its tokens, cache tail, blocks registered)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    for step in range(3000):
        if live and (rng.random() < 0.45 or bm.num_free < 8):
            i = rng.randrange(len(live))
            seq = live.pop(i)[0]
            bm.free(seq, keep_cached=rng.random() < 0.9)
        else:
            ids = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            seq = Seq()
            hits = bm.lookup(ids, len(ids) - 1)
            if bm.extra_blocks_for(seq, len(ids)) - len(hits) + bm.blocks_to_share(hits) > bm.num_free:
                continue
            bm.share(seq, hits)
            for n, node in zip(ids[:len(hits) * 4:4], hits):  # a hit holds the very tokens
                assert node.tokens[0] == n
            bm.ensure(seq, len(ids))
            tail = hits[-1] if hits else bm.root
            live.append((seq, ids, tail, len(hits)))
        # some computed more of their tokens
        for k, (seq, ids, tail, done) in enumerate(live):
            full = len(ids) // 4
            if tail is not None and done < full and rng.random() < 0.5:
                live[k] = (seq, ids, bm.register(seq, ids, done, full, tail), full)
        _check(bm, [s for s, *_ in live])
        for seq, ids, _, done in live:  # whatever is cached of a request's tokens is those tokens
            for node in bm.lookup(ids, len(ids)):
                assert bm._node[node.block] is node


# --- the scheduler ---

def _sched(**kw):
    model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0))
    return Scheduler(SchedulerConfig(policy="fcfs", **kw), 64, 4, max_model_len=256, predictor=model)


def _step(s, plan):
    return s.postprocess(plan, [7] * len(plan.requests), 0.0)


def test_a_request_over_a_prefix_another_computed_starts_after_it_and_costs_only_the_rest():
    s = _sched()
    a = Request("a", list(range(1, 22)), SamplingParams(max_tokens=4))  # 21 tokens: 5 full blocks
    s.add(a)
    assert a.prefix_hit == 0
    _step(s, s.schedule(0.0))
    b = Request("b", list(range(1, 19)) + [50, 51, 52], SamplingParams(max_tokens=4))  # shares 4 blocks, then not
    s.add(b)
    assert b.prefix_hit == 16 and s._cost(b) == 5
    p = s.schedule(0.0)
    assert p.prefill == [b] and p.num_prefill_tokens == 5 and b.num_computed_tokens == 16
    assert b.block_table[:4] == a.block_table[:4] and b.num_cached_tokens == 16
    assert (s.prefix_queries, s.prefix_hits) == (42, 16)
    _step(s, p)
    # the same prompt again: all but its last token (at least one is computed: its logits give the first token)
    c = Request("c", list(range(1, 21)), SamplingParams(max_tokens=4))  # 20 tokens: 4 of its 5 blocks
    s.add(c)
    assert c.prefix_hit == 16
    # one that asks for its prompt's log-probabilities computes all of it (vLLM's rule)
    d = Request("d", list(range(1, 21)), SamplingParams(max_tokens=4, prompt_logprobs=0))
    s.add(d)
    assert d.prefix_hit == 0
    p = s.schedule(0.0)
    assert p.prefill == [c, d] and p.num_prefill_tokens == 4 + 20


def test_a_preempted_request_finds_its_own_blocks_cached_and_a_failed_one_leaves_only_what_it_found():
    s = _sched()
    a = Request("a", list(range(1, 14)), SamplingParams(max_tokens=20))
    s.add(a)
    _step(s, s.schedule(0.0))
    for _ in range(4):
        _step(s, s.schedule(0.0))
    plan = s.schedule(0.0)
    s._preempt(a, plan)
    assert a.status is Status.WAITING and a.prefix_hit == 16  # 17 tokens: 4 full blocks, prompt and reply
    p = s.schedule(0.0)
    assert p.prefill == [a] and a.num_computed_tokens == 16
    _step(s, p)
    s.finish(a, FinishReason.STOP, 0.0)
    assert s.blocks.num_cached == 4
    # one that found a's blocks, cached two of its own, then failed: its own leave the cache, a's stay
    b = Request("b", a.token_ids[:16] + list(range(50, 59)), SamplingParams(max_tokens=20))
    s.add(b)
    p = s.schedule(0.0)
    assert b.num_computed_tokens == 16 and p.num_prefill_tokens == 9
    _step(s, p)
    assert s.blocks.num_cached == 6
    s.finish(b, FinishReason.ERROR, 0.0)
    assert s.blocks.num_cached == 4 and s.blocks.num_free == 64


def test_a_waiting_request_whose_tokens_shrank_leaves_its_last_token_to_compute():
    """A preempted request whose failed step's placeholder token was taken back (`engine._resolve`) has one token
    fewer than its last lookup saw: that lookup's hit covered all of its tokens now, and the prefill had none to
    compute (its logits give the next token); looked up again, at least its last token is left."""
    s = _sched()
    a = Request("a", list(range(1, 18)), SamplingParams(max_tokens=4))  # 17 tokens: 4 full blocks cached
    s.add(a)
    _step(s, s.schedule(0.0))
    b = Request("b", list(range(1, 17)) + [0], SamplingParams(max_tokens=4))  # a placeholder 17th token
    s.add(b)
    assert b.prefix_hit == 16
    b.token_ids.pop()  # (taken back: 16 tokens, all of them in cached blocks)
    assert len(s._peek(b)) * 4 < b.num_tokens and b.prefix_hit == 12


def test_the_costs_of_waiting_requests_follow_the_cache_as_it_changes():
    """A request that arrived before its prefix was computed costs only the rest once it is (each step's decisions
    read what each waiting prompt finds cached now), and a hit whose blocks were evicted since costs it all again."""
    s = Scheduler(SchedulerConfig(policy="fcfs", prefill_max_tokens=40), 12, 4, max_model_len=48)
    a = Request("a", list(range(1, 34)), SamplingParams(max_tokens=1))  # 33 tokens: 8 full blocks
    b = Request("b", list(range(1, 34)) + [99], SamplingParams(max_tokens=1))
    s.add(a)
    s.add(b)
    assert b.prefix_hit == 0
    p = s.schedule(0.0)
    assert p.prefill == [a]  # 33 + 34 past the budget of 40
    for req, tok, reason in _step(s, p):
        s.finish(req, reason, 0.0)
    p = s.schedule(0.0)
    assert p.prefill == [b] and p.num_prefill_tokens == 2 and b.num_computed_tokens == 32
    for req, tok, reason in _step(s, p):
        s.finish(req, reason, 0.0)
    c = Request("c", list(range(1, 34)) + [7], SamplingParams(max_tokens=1))
    s.add(c)
    assert c.prefix_hit == 32 and s._cost(c) == 2
    d = Request("d", list(range(200, 248)), SamplingParams(max_tokens=1))  # every block, a's evicted
    s.blocks.ensure(d, 48)
    e = Request("e", list(range(300, 302)), SamplingParams(max_tokens=1))
    s.add(e)
    s.schedule(0.0)  # (nothing fits: d holds the blocks) the costs are read again
    assert c.prefix_hit == 0 and s._cost(c) == 34


def test_caching_off_finds_nothing():
    s = _sched(enable_prefix_caching=False)
    a, b = (Request(i, list(range(1, 22)), SamplingParams(max_tokens=4)) for i in "ab")
    s.add(a)
    _step(s, s.schedule(0.0))
    s.add(b)
    assert b.prefix_hit == 0 and s.schedule(0.0).num_prefill_tokens == 21 and s.prefix_queries == 0


# --- the engine, over a real checkpoint ---

def _shared_prompts(vocab: int, seed: int, system: int = 37) -> list[list[int]]:
    """A system prompt, then each its own question (one the system prompt alone, one a copy of another)."""
    g = random.Random(seed)
    sysp = [g.randrange(1, vocab) for _ in range(system)]
    out = [sysp + [g.randrange(1, vocab) for _ in range(n)] for n in (5, 1, 30, 12, 64, 3)]
    return out + [list(out[2]), list(sysp)]


@pytest.mark.parametrize("overlap,chunked,kernels", [("off", False, "auto"), ("on", False, "auto"),
                                                     ("off", True, "off"), ("on", True, "auto")])
def test_replies_over_cached_prefixes_equal_hf_computing_them_whole(tiny_checkpoints, overlap, chunked, kernels):
    path = tiny_checkpoints["llama"]
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, overlap=overlap,
                                 kernels=kernels, scheduler=SchedulerConfig(
                                     policy="kairos", prefill_max_tokens=40 if chunked else 256,
                                     chunked_prefill=chunked)))
    try:
        prompts = _shared_prompts(eng.bundle.vocab_limit, seed=4)
        n = [9, 14, 6, 11, 8, 13, 10, 7]
        greedy = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in n]
        def drain(st) -> None:
            got = []
            for o in st:
                got.extend(o.token_ids)
            outs.append(got)
            finals.append(o)  # the final item

        outs, finals = [], []
        drain(eng.add_request(prompts[0], greedy[0]))  # the system prompt is cached once the first has run
        for st in [eng.add_request(p, g) for p, g in zip(prompts[1:], greedy[1:])]:
            drain(st)
        assert outs == _hf_greedy(path, prompts, n)
        cached = [f.metrics.num_cached_tokens for f in finals]
        assert cached[0] == 0 and all(c >= 36 for c in cached[1:6]), cached  # the system prompt's 9 blocks
        st = idle_stats(eng)
        assert st.kv_blocks_free == st.kv_blocks_total and st.num_running == 0
        assert st.prefix_cache_hits == sum(cached) and st.prefix_cache_queries >= sum(map(len, prompts))
    finally:
        eng.shutdown()


def test_a_cache_smaller_than_the_traffic_evicts_and_stays_exact(tiny_checkpoints):
    """60 blocks of 4 tokens for prompts of up to 101 tokens, many over one system prompt: blocks are evicted,
    requests preempted, and every reply is still HF's."""
    path = tiny_checkpoints["llama"]
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=60,
                                 max_model_len=200, scheduler=SchedulerConfig(policy="fcfs", prefill_max_tokens=256)))
    try:
        prompts = _shared_prompts(eng.bundle.vocab_limit, seed=5) * 2
        n = [20, 9, 30, 6, 25, 12, 17, 8] * 2
        streams = [eng.add_request(p, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
                   for p, k in zip(prompts, n)]
        outs, cached = [], []
        for st in streams:
            got = []
            for o in st:
                got.extend(o.token_ids)
            outs.append(got)
            cached.append(o.metrics.num_cached_tokens)
        assert outs == _hf_greedy(path, prompts, n)
        st = idle_stats(eng)
        assert st.kv_blocks_free == 60 and st.prefix_cache_hits > 0
        # a preempted request finding its own blocks again is no hit (vLLM counts those apart): the hits are what
        # the requests found cached when first admitted
        assert st.preemptions > 0 and st.prefix_cache_hits == sum(cached), (st.prefix_cache_hits, cached)
    finally:
        eng.shutdown()


def test_a_profile_on_the_idle_engine_leaves_nothing_cached_for_its_probes_to_overwrite(tiny_checkpoints, tmp_path):
    """reprofile's probes write throwaway KV into the cache's first blocks: the idle engine uncaches every block
    first, so a request over a prefix served before the profile computes it again and is still HF's."""
    path = tiny_checkpoints["llama"]
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
                                 max_model_len=200, scheduler=SchedulerConfig(
                                     policy="fcfs", prefill_max_tokens=256, predictor_path=str(tmp_path / "p.json"))))

    def run(p):
        out = []
        for o in eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)):
            out.extend(o.token_ids)
        return out, o.metrics.num_cached_tokens

    try:
        g = random.Random(1)
        system = [g.randrange(1, eng.bundle.vocab_limit) for _ in range(40)]
        a, b = system + [7, 8, 9], system + [11, 12]
        got_a, _ = run(a)
        assert eng.scheduler.blocks.num_cached >= 10
        eng.reprofile(time_budget_s=1.0)
        assert eng.scheduler.blocks.num_cached == 0
        got_b, cached = run(b)
        assert cached == 0 and [got_a, got_b] == _hf_greedy(path, [a, b], [8, 8])
    finally:
        eng.shutdown()
