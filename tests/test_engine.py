"""Engine behaviour on real (tiny, random) HF checkpoints: exact greedy equality, KV hygiene, abort, errors."""
import dataclasses
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.engine import PUBLISH_EVERY_S, LLMEngine
from engine.errors import EngineDeadError
from engine.testing import idle_stats
from core.messages import ErrorKind
from core.sampling import SamplingParams
from core.request import SLO, FinishReason
from scheduling.config import SchedulerConfig
from scheduling.predictor import LatencyModel

PROMPT_LENS = [1, 3, 7, 16, 33, 64, 100, 150, 250, 300]
MAX_TOKENS = [12, 30, 5, 25, 17, 40, 9, 22, 14, 33]


def _engine(path, policy="fcfs", **kw):
    return LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", block_size=4,
                                  scheduler=SchedulerConfig(policy=policy, prefill_max_tokens=256), **kw))


def _hf_greedy(path, prompt_ids, n, **generate):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # run to length, like ignore_eos
    model.generation_config.pad_token_id = 0
    out = []
    with torch.inference_mode():
        for ids, k in zip(prompt_ids, n):
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=k, min_new_tokens=k, do_sample=False, **generate)
            out.append(gen[0, len(ids):].tolist())
    return out


def _prompts(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run_staggered(eng, prompts, slos=None):
    """Submit in three waves at different engine steps; return each request's output token ids."""
    streams = [None] * len(prompts)
    outs = [[] for _ in prompts]
    waves = [range(0, 4), range(4, 7), range(7, len(prompts))]
    for w, idx in enumerate(waves):
        for i in idx:
            p = SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)
            streams[i] = eng.add_request(prompts[i], p, slos[i] if slos else None)
        if w < 2:  # let a few steps run so arrivals land mid-decode
            first = streams[idx[0]].get(timeout=30)
            outs[idx[0]].extend(first.token_ids)
            if first.finished:
                streams[idx[0]] = None
    for i, s in enumerate(streams):
        if s is None:
            continue
        for o in s:
            outs[i].extend(o.token_ids)
            assert o.finish_reason in (None, "length"), o
    return outs


@pytest.mark.parametrize("family,impl,kernels", [
    ("gpt2", "auto", "auto"), ("llama", "auto", "auto"), ("qwen2", "auto", "auto"), ("qwen3", "auto", "auto"),
    ("llama", "hf", "auto"), ("llama", "auto", "off"), ("gpt2", "auto", "off")])
def test_greedy_equals_hf_generate(tiny_checkpoints, family, impl, kernels):
    path = tiny_checkpoints[family]
    eng = _engine(path, policy="tpot_guard", model_impl=impl, kernels=kernels)
    decode_only: dict[int, int] = {}  # rows bucket (the least power of two >= rows) -> decode-only steps

    def count(ev) -> None:
        if ev.num_decode and not ev.num_prefill:
            k = 1 << (ev.num_decode - 1).bit_length()
            decode_only[k] = decode_only.get(k, 0) + 1
    eng.add_step_observer(count)
    try:
        # Llama-family models run on Kairos's own forward unless asked otherwise; GPT-2 on the HF modules
        assert (eng.runner.decoder is not None) == (family != "gpt2" and impl == "auto")
        # Kairos's CPU kernels where asked (they build on every box the tests run on), torch ops otherwise
        assert (eng.backend.kernels is not None) == (kernels == "auto")
        prompts = _prompts(eng.bundle.vocab_limit)
        # loose, distinct TPOT SLOs: never rejected, but credit batching decodes subsets of the running set
        slos = [SLO(tpot_ms=1e5 * (1 + i % 3)) for i in range(len(prompts))]
        outs = _run_staggered(eng, prompts, slos)
        assert outs == _hf_greedy(path, prompts, MAX_TOKENS)
        st = idle_stats(eng)
        assert st.kv_blocks_free == st.kv_blocks_total and st.num_running == 0
        # the step time the router scales: measured on steps that decoded, with their batch sizes
        assert st.step_ms > 0 and 1 <= st.step_batch <= len(prompts)
        # the latency model against every decode-only step, by rows bucket (what /metrics exports)
        assert eng.latency_model is not None and decode_only
        assert {k: n for k, (n, _) in st.decode_over_model.items()} == decode_only
        assert all(total > 0 for _, total in st.decode_over_model.values())
    finally:
        eng.shutdown()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_with_a_repetition_penalty_equals_hf_generate(tiny_checkpoints, family):
    """vLLM's repetition penalty is HF's (a logit of a token in the prompt or the reply divided by it where
    positive, multiplied where not): greedy replies in one batch, beside an unpenalized one, are HF's token for
    token, and the penalty changes them."""
    path = tiny_checkpoints[family]
    eng = _engine(path)
    try:
        prompts = _prompts(eng.bundle.vocab_limit)[:5]
        n = [20] * len(prompts)
        pens = [1.6, 1.0, 0.7, 1.6, 2.5]  # below 1: a repetition is favoured
        streams = [eng.add_request(p, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True,
                                                     repetition_penalty=rp)) for p, k, rp in zip(prompts, n, pens)]
        outs = [[t for o in s for t in o.token_ids] for s in streams]
    finally:
        eng.shutdown()
    for i, rp in enumerate(pens):
        assert outs[i] == _hf_greedy(path, [prompts[i]], [n[i]], repetition_penalty=rp)[0], (i, rp)
    assert outs != _hf_greedy(path, prompts, n)


def _check_logprobs(model, tok, prompt, out, lps, k, tol=2e-4):
    """Each reply token's logprobs are the model's own (its raw logits, teacher-forced on the reply): the token's
    log-probability and rank (within `tol` of a tie), its text alone, and a top `k` that holds the k likeliest."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert len(lps) == len(out)
    for j, (t, lp) in enumerate(zip(out, lps)):
        row, v = ref[j], ref[j, t].item()
        assert lp.logprob == pytest.approx(v, abs=tol), j
        assert int((row > v + tol).sum()) + 1 <= lp.rank <= int((row > v - tol).sum()) + 1, j
        assert lp.token == tok.decode([t]) and lp.id == t
        assert len(lp.top) == k and [x for _, _, x in lp.top] == sorted((x for _, _, x in lp.top), reverse=True)
        if k:
            kth = row.topk(k).values[-1].item()
            assert len({i for i, _, _ in lp.top}) == k
            for i, text, x in lp.top:
                assert x == pytest.approx(row[i].item(), abs=tol) and x >= kth - tol and text == tok.decode([i])


@pytest.mark.parametrize("family,impl", [("llama", "auto"), ("llama", "hf"), ("gpt2", "auto")])
def test_logprobs_are_the_models_own_whatever_the_sampling(tiny_checkpoints, family, impl):
    """A request's logprobs come with every reply token, in the stream's items beside their tokens, the model's raw
    distribution (vLLM's raw_logprobs): greedy, sampled, penalized (the penalty changes the tokens, not the
    logprobs) and ended by a stop token (the last item carries the stop token's); a request without asks none."""
    from transformers import AutoTokenizer

    path = tiny_checkpoints[family]
    eng = _engine(path, model_impl=impl)
    try:
        prompts = _prompts(eng.bundle.vocab_limit)[:4]
        ask = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5),
               SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True, logprobs=0),
               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.8, logprobs=20),
               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
        items = [list(eng.add_request(p, sp)) for p, sp in zip(prompts, ask)]
        # greedy to a stop token: the first reply's first token that it had not drawn before ends it
        greedy = [t for o in items[0] for t in o.token_ids]
        end = next((j for j in range(1, len(greedy)) if greedy[j] not in greedy[:j]), 0)
        stop_at = greedy[end]
        stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2, stop_token_ids=[stop_at])
        items.append(list(eng.add_request(prompts[0], stop)))
        ask.append(stop)
        prompts.append(prompts[0])
    finally:
        eng.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    for i, (prompt, sp, its) in enumerate(zip(prompts, ask, items)):
        out = [t for o in its for t in o.token_ids]
        if sp.logprobs is None:
            assert all(o.logprobs is None for o in its) and len(out) == 12
            continue
        assert all(o.logprobs is not None and len(o.logprobs) == len(o.token_ids) for o in its), i
        lps = [x for o in its for x in o.logprobs]
        _check_logprobs(model, tok, prompt, out, lps, sp.logprobs)
        if sp.temperature == 0.0 and sp.repetition_penalty == 1.0:
            assert all(x.rank == 1 for x in lps) and all(x.logprob == x.top[0][2] for x in lps if x.top)
    assert [t for o in items[2] for t in o.token_ids] != [t for o in items[3] for t in o.token_ids]  # penalized
    last = items[-1]
    # (the last item ends with the stop token and carries its logprobs; a reader behind the engine gets the tokens
    # before it merged into that item, each with its own)
    assert last[-1].finish_reason == "stop" and last[-1].token_ids[-1] == stop_at
    assert len(last[-1].logprobs) == len(last[-1].token_ids)
    assert [t for o in last for t in o.token_ids] == greedy[:end + 1]


@pytest.mark.parametrize("family,impl,chunk,overlap", [("llama", "auto", False, "off"), ("llama", "hf", False, "off"),
                                                        ("llama", "auto", True, "off"), ("llama", "auto", True, "on"),
                                                        ("gpt2", "auto", True, "on")])
def test_prompt_logprobs_are_the_models_own_in_chunks_and_whole(tiny_checkpoints, family, impl, chunk, overlap):
    """vLLM's prompt_logprobs: a request's first item carries one per prompt token (None for the first), the model's
    own given the tokens before (prompt rows computed after the step's sampled ones, chunk by chunk where a prompt
    is prefilled in chunks, with overlap scheduling too); the reply is as without them; a reply of one token carries
    them in its last item; a one-token prompt gets its token with no logprob; a request beside them without gets
    none."""
    from transformers import AutoTokenizer

    path = tiny_checkpoints[family]
    sched = dict(prefill_max_tokens=32, chunked_prefill=True) if chunk else dict(prefill_max_tokens=256)
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, model_impl=impl,
                                 overlap=overlap, scheduler=SchedulerConfig(policy="fcfs", **sched)))
    try:
        prompts = _prompts(eng.bundle.vocab_limit)
        prompts = [prompts[5], prompts[2], [7], prompts[6], prompts[3]]  # 64, 7, 1, 100 and 16 tokens
        ask = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=3),
               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=1),
               SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
               SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True, prompt_logprobs=20),
               SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
        items = [list(s) for s in [eng.add_request(p, sp) for p, sp in zip(prompts, ask)]]
        plain = [[t for o in eng.add_request(p, dataclasses.replace(sp, prompt_logprobs=None)) for t in o.token_ids]
                 for p, sp in zip(prompts, ask)]
    finally:
        eng.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    for i, (prompt, sp, its) in enumerate(zip(prompts, ask, items)):
        assert [t for o in its for t in o.token_ids] == plain[i], i  # the reply is unchanged
        carried = [o for o in its if o.prompt_logprobs is not None]
        if sp.prompt_logprobs is None:
            assert not carried
            continue
        (first,) = carried
        assert first is next(o for o in its if o.token_ids)  # the item of the first token (the last, for one)
        got = first.prompt_logprobs
        assert len(got) == len(prompt) and [x.id for x in got] == prompt, i
        assert (got[0].logprob, got[0].rank, got[0].top, got[0].token) == (None, 0, (), tok.decode([prompt[0]]))
        if len(prompt) > 1:
            _check_logprobs(model, tok, prompt[:1], prompt[1:], got[1:], sp.prompt_logprobs)
    assert items[1][-1].finished and items[1][-1].prompt_logprobs is not None and len(items[1][-1].logprobs) == 1
    assert [(x.id, x.logprob) for x in items[2][0].prompt_logprobs] == [(7, None)]


@pytest.mark.parametrize("overlap,device_path", [("off", False), ("on", False), ("on", True)])
def test_json_mode_replies_are_json_objects_or_their_prefixes(tiny_checkpoints, overlap, device_path):
    """OpenAI's json_object: every reply, greedy or sampled, with penalties or logit_bias, is a prefix of a JSON object
    its whole way (a tiny random model writes one only where its tokens leave it little choice), and one that ends
    by a stop token is a whole JSON object; the placeholders of overlap scheduling (host stream, or the device path)
    are read from the step before; a request beside them without JSON mode is as alone."""
    import json

    from core.json_grammar import START, advance
    from transformers import AutoTokenizer

    path = tiny_checkpoints["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    ids = {c: tok.convert_tokens_to_ids(c) for c in ["{", "}", '"', "a", ":", "1", ","]}
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, overlap=overlap,
                                 scheduler=SchedulerConfig(policy="fcfs", prefill_max_tokens=256)))
    if device_path:
        eng._stream = None  # (no request yet: the worker has not stepped)
    try:
        prompts = _prompts(eng.bundle.vocab_limit)[:6]
        js = dict(max_tokens=40, json_object=True)
        ask = [SamplingParams(temperature=0.0, **js),
               SamplingParams(temperature=1.0, seed=5, **js),
               SamplingParams(temperature=0.8, top_p=0.9, seed=6, frequency_penalty=0.5, **js),
               SamplingParams(temperature=0.0, allowed_token_ids=(ids["{"], ids["}"], tok.eos_token_id), **js),
               SamplingParams(temperature=1.0, seed=7, logit_bias={t: 6.0 for t in ids.values()}, **js),
               SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
        replies = [list(eng.add_request(p, sp)) for p, sp in zip(prompts, ask)]
        alone = [t for o in eng.add_request(prompts[5], ask[5]) for t in o.token_ids]
    finally:
        eng.shutdown()
    texts = ["".join(o.text for o in r) for r in replies]
    for i, (text, r) in enumerate(zip(texts[:5], replies)):
        assert advance(START, text) is not None, (i, text)
        assert r[-1].finish_reason in ("stop", "length"), r[-1]
        if r[-1].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), (i, text)
    assert texts[3] == "{}" and replies[3][-1].finish_reason == "stop"  # "{", then "}": the EOS fits only then
    assert [t for o in replies[5] for t in o.token_ids] == alone


def test_a_json_schema_reply_is_a_value_of_its_schema(tiny_checkpoints):
    """json_schema: a schema whose values are few (an enum, a boolean, a null) leaves a tiny random model no way but
    to write one: each reply, greedy or sampled, ends by its EOS as a value of the schema."""
    import json

    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"},
                                               "c": {"type": "null"}},
              "required": ["a", "b"], "additionalProperties": False}
    eng = _engine(tiny_checkpoints["llama"])
    try:
        prompts = _prompts(eng.bundle.vocab_limit)[:3]
        ask = [SamplingParams(max_tokens=600, temperature=t, seed=s, json_schema=json.dumps(schema))
               for t, s in ((0.0, None), (1.0, 3), (1.5, 4))]
        replies = [list(eng.add_request(p, sp)) for p, sp in zip(prompts, ask)]
    finally:
        eng.shutdown()
    for r in replies:
        obj = json.loads("".join(o.text for o in r))
        assert r[-1].finish_reason == "stop" and obj["a"] in ("x", "yy") and isinstance(obj["b"], bool), obj
        assert set(obj) <= {"a", "b", "c"} and obj.get("c") is None


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_bad_words_keep_their_words_out_of_the_reply(tiny_checkpoints, overlap):
    """vLLM's bad_words: a word the greedy reply writes (its first tokens' text) is never written when banned, as at
    the text's start or after a space (each its token ids), with overlap scheduling too; the reply changes there."""
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", block_size=4,
                                 overlap=overlap, scheduler=SchedulerConfig(policy="fcfs", prefill_max_tokens=256)))
    try:
        prompt = _prompts(eng.bundle.vocab_limit)[1]
        knobs = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
        plain = [t for o in eng.add_request(prompt, SamplingParams(**knobs)) for t in o.token_ids]
        def found(ids: tuple[tuple[int, ...], ...], reply: list[int]) -> bool:
            return any(tuple(reply[i:i + len(w)]) == w for w in ids for i in range(len(reply) - len(w) + 1))

        # a word of the reply whose token ids, as the input processor makes them, are the reply's own there
        words = [w for k in range(len(plain)) for n in (1, 2) if (w := eng.inputs.tokenizer.decode(plain[k:k + n])
                                                                  .strip())]
        word = next(w for w in words if found(eng.inputs.bad_words_ids([w]), plain))
        ids = eng.inputs.bad_words_ids([word])
        got = [t for o in eng.add_request(prompt, SamplingParams(**knobs, bad_words=(word,))) for t in o.token_ids]
    finally:
        eng.shutdown()
    assert got != plain and not found(ids, got), (word, ids, got)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_guided_regex_or_choice_reply_matches_whole(tiny_checkpoints, overlap):
    """vLLM's guided_regex and guided_choice (a regex of its texts), and guided_grammar (an EBNF grammar): each
    reply, greedy or sampled, penalized or not, matches whole and ends by its EOS once nothing more could match; with
    overlap scheduling too. Characters whose UTF-8 the tiny vocabulary splits between tokens (CJK, an emoji, the euro
    sign) are written a token at a time and counted once each. Every pattern is bounded, so that the constraint ends
    each reply within its max_tokens whatever the random model prefers (an unbounded `[a-z]+` ran to the cap where the
    CPU's kernels' rounding led greedy decoding never to a period)."""
    import re

    from core.ebnf_grammar import compile_grammar
    from core.regex_grammar import choice_pattern, matches

    pattern, choices = r"(ab|[0-9]{2,4})-[a-z]{1,12}\.", ["red", "green", "blue sky"]
    wide, wide_choices = "[龍国€½]{3}", ["龍国", "🎊 fiesta", "日本"]
    grammar = ('root ::= "(" expr ")"\nexpr ::= term ((" + " | " * ") term){0,2}\n'
               'term ::= [0-9]{1,3} | "x" | "(" inner ")"\ninner ::= [0-9]{1,3} (" - " [0-9])?')
    g = compile_grammar(grammar)
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", block_size=4,
                                 overlap=overlap, scheduler=SchedulerConfig(policy="fcfs", prefill_max_tokens=256)))
    try:
        prompts = _prompts(eng.bundle.vocab_limit)[:4]
        ask = [SamplingParams(max_tokens=60, temperature=0.0, regex=pattern),
               SamplingParams(max_tokens=60, temperature=1.0, seed=6, frequency_penalty=0.4, regex=pattern),
               SamplingParams(max_tokens=60, temperature=0.0, regex=choice_pattern(choices)),
               SamplingParams(max_tokens=60, temperature=1.2, seed=9, regex=choice_pattern(choices)),
               SamplingParams(max_tokens=200, temperature=0.0, grammar=grammar),
               SamplingParams(max_tokens=200, temperature=1.0, seed=4, grammar=grammar),
               SamplingParams(max_tokens=60, temperature=0.0, regex=wide),
               SamplingParams(max_tokens=60, temperature=1.2, seed=3, regex=choice_pattern(wide_choices)),
               SamplingParams(max_tokens=12, temperature=0.0, regex=choice_pattern(choices), ignore_eos=True)]
        replies = [list(eng.add_request(p, sp)) for p, sp in zip(prompts * 3, ask)]
    finally:
        eng.shutdown()
    texts = ["".join(o.text for o in r) for r in replies]
    for text, r in zip(texts[:2], replies):
        assert re.fullmatch(pattern, text) and r[-1].finish_reason == "stop", (text, r[-1])
    for text, r in zip(texts[2:4], replies[2:4]):
        assert text in choices and r[-1].finish_reason == "stop", (text, r[-1])
    for text, r in zip(texts[4:6], replies[4:6]):
        assert matches(g, text) and r[-1].finish_reason == "stop", (text, r[-1])
    assert re.fullmatch(wide, texts[6]) and replies[6][-1].finish_reason == "stop", (texts[6], replies[6][-1])
    assert texts[7] in wide_choices and replies[7][-1].finish_reason == "stop", (texts[7], replies[7][-1])
    # ignore_eos: once the text is whole only the EOS fits, and it writes nothing (vLLM's); the reply goes on to its
    # cap (nothing fitted there, and the reply left its format)
    assert texts[8] in choices and replies[8][-1].finish_reason == "length", (texts[8], replies[8][-1])


@pytest.mark.parametrize("family,impl,kernels", [("llama", "auto", "auto"), ("llama", "auto", "off"),
                                                  ("qwen2", "hf", "auto"), ("gpt2", "auto", "off")])
def test_chunked_prefill_stays_exact(tiny_checkpoints, family, impl, kernels):
    """Prompts up to 300 tokens prefilled 37 tokens a step (chunks across SDPA, the paged kernel and the HF
    modules, a prompt in progress sharing its step with other prefills and decodes): the same tokens as HF."""
    path = tiny_checkpoints[family]
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, model_impl=impl,
                                 kernels=kernels, scheduler=SchedulerConfig(
                                     policy="kairos", prefill_max_tokens=37, chunked_prefill=True)))
    seen: list[int] = []
    eng.add_step_observer(lambda ev: seen.append(ev.num_prefill_tokens))
    try:
        prompts = _prompts(eng.bundle.vocab_limit, seed=2)
        outs = _run_staggered(eng, prompts)
        assert outs == _hf_greedy(path, prompts, MAX_TOKENS)
        # no step computed more prompt than the budget, and every prompt token was computed (a prompt's last by its
        # first decode, where a chunk stopped one short of it)
        assert max(seen) <= 37 and sum(seen) >= sum(PROMPT_LENS) - len(PROMPT_LENS)
        st = idle_stats(eng)
        assert st.kv_blocks_free == st.kv_blocks_total and st.num_running == 0
    finally:
        eng.shutdown()


def test_best_effort_prompts_in_chunks_beside_paced_replies_stay_exact(tiny_checkpoints, monkeypatch):
    """kairos over a step model that prices a prompt token at a second: best-effort prompts (no SLO) arriving while
    paced replies decode are computed in the chunks the replies' slack allows, never decoded mid-prompt, and give
    the same tokens as HF; the paced replies decode through them."""
    from engine import engine as engine_mod

    model = LatencyModel(prefill_coef=(1000.0, 1.0), decode_coef=(0.0, 0.5, 0.0, 2.0))
    monkeypatch.setattr(engine_mod, "load_or_profile", lambda eng, *a, **k: (model, {}))
    path = tiny_checkpoints["llama"]
    eng = _engine(path, policy="kairos")
    schedule, cuts = eng.scheduler.schedule, []

    def recorded(now):  # the steps that computed part of a prompt, stopping short of it, while replies decoded
        plan = schedule(now)
        cuts.extend(end for r, end in zip(plan.prefill, plan.prefill_ends) if end < r.num_tokens - 1 and plan.decode)
        return plan
    eng.scheduler.schedule = recorded
    try:
        prompts = _prompts(eng.bundle.vocab_limit, seed=3)
        paced, lone = [prompts[2], prompts[3]], [prompts[8], prompts[9]]  # 7 and 16 tokens; 250 and 300
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        streams = [eng.add_request(ids, greedy, SLO(tpot_ms=2000.0)) for ids in paced]
        outs = [list(st.get(timeout=30).token_ids) for st in streams]
        short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        streams += [eng.add_request(ids, short) for ids in lone]
        outs += [[], []]
        for i, st in enumerate(streams):
            for o in st:
                outs[i].extend(o.token_ids)
        assert outs == _hf_greedy(path, paced + lone, [40, 40, 8, 8])
        assert cuts  # a step computed part of a prompt while the replies decoded
        st = idle_stats(eng)
        assert st.kv_blocks_free == st.kv_blocks_total and st.num_running == 0
    finally:
        eng.shutdown()


def test_out_of_blocks_waits_or_preempts_and_stays_exact(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    # 120 blocks x 4 = 480 token slots: far less than the ~1300 the batch needs at once
    eng = _engine(path, num_kv_blocks=120, max_model_len=400)
    try:
        prompts = _prompts(eng.bundle.vocab_limit, seed=1)
        outs = _run_staggered(eng, prompts)
        assert outs == _hf_greedy(path, prompts, MAX_TOKENS)
        deadline = time.monotonic() + 10  # (the stats are published by the worker after the streams end)
        while eng.stats().kv_blocks_free != 120 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.stats().kv_blocks_free == 120
    finally:
        eng.shutdown()


def _hold_after_first_step(eng: LLMEngine) -> tuple[threading.Event, threading.Event]:
    """(reached, go): the engine's worker stops after its next model step until `go` is set (30 s at most), and sets
    `reached` there: what a test queues meanwhile finds that step's request admitted, however slowly the test's own
    thread runs (a reader scheduled late had found a short reply already finished)."""
    reached, go = threading.Event(), threading.Event()

    def hold(_event) -> None:
        if not reached.is_set():
            reached.set()
            go.wait(30)

    eng.add_step_observer(hold)
    return reached, go


@pytest.mark.parametrize("policy", ["fcfs", "kairos"])
def test_priority_scheduling_serves_the_lowest_priority_value_first_and_stays_exact(tiny_checkpoints, policy):
    """vLLM's priority scheduling on a real model: one seat, taken; two requests of priority 1 queue, then one of
    priority -1, the longest and the last: it is served next, then the others in arrival order, each token-exact."""
    path = tiny_checkpoints["llama"]
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, scheduler=SchedulerConfig(
        policy=policy, scheduling_policy="priority", max_num_seqs=1, prefill_max_tokens=256)))
    try:
        prompts = _prompts(eng.bundle.vocab_limit, seed=2)[:4]
        lens = [24, 6, 6, 12]
        params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in lens]
        reached, go = _hold_after_first_step(eng)
        first = eng.add_request(prompts[0], params[0])
        assert reached.wait(30)  # the seat is taken
        streams = [eng.add_request(prompts[i], params[i], priority=p) for i, p in ((1, 1), (2, 1), (3, -1))]
        go.set()
        outs = [[t for o in first for t in o.token_ids]]
        finals = []
        for s in streams:
            items = list(s)
            outs.append([t for o in items for t in o.token_ids])
            finals.append(items[-1].metrics)
        assert outs == _hf_greedy(path, prompts, lens)
        low1, low2, high = finals
        assert high.admitted_s < low1.admitted_s < low2.admitted_s
    finally:
        eng.shutdown()


def test_stats_follow_the_requests_while_steps_run(tiny_checkpoints):
    """The worker publishes its stats after a step that changed its requests (one admitted, one ended), and otherwise
    often enough that the step count moves while a reply decodes. The worker runs a step only when the test lets it
    (a step observer), so the 400-token replies run until aborted however slowly the test's own thread runs."""
    eng = _engine(tiny_checkpoints["llama"])
    step, free = threading.Event(), threading.Event()  # (one step at most for each time the test lets one: a
    # worker scheduled late runs one step, not as many as the test's polls meanwhile)

    def pace(_event) -> None:
        if not free.is_set():
            step.wait(30)
            step.clear()

    eng.add_step_observer(pace)

    def until(cond, timeout=10.0):
        deadline = time.time() + timeout
        while not cond(eng.stats()) and time.time() < deadline:
            step.set()  # one more step
            time.sleep(0.002)
        return eng.stats()

    def first(stream, timeout=30.0):
        deadline = time.time() + timeout
        while True:
            try:
                return stream.get(timeout=0.01)
            except TimeoutError:
                assert time.time() < deadline
                step.set()  # one more step

    try:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        a = eng.add_request([5] * 40, params, request_id="a")
        assert not first(a).finished
        assert until(lambda st: st.num_running == 1).num_running == 1
        b = eng.add_request([6] * 40, params, request_id="b")
        assert not first(b).finished
        assert until(lambda st: st.num_running == 2).num_running == 2
        steps = eng.stats().steps
        time.sleep(2 * PUBLISH_EVERY_S)  # the worker holds: its next step finds its last snapshot old
        assert until(lambda st: st.steps > steps).steps > steps  # the time-based refresh, the requests unchanged
        eng.abort("a")
        assert until(lambda st: st.num_running == 1).num_running == 1
        eng.abort("b")
        st = until(lambda st: st.num_running == 0 and st.kv_blocks_used == 0)
        assert st.num_running == 0 and st.kv_blocks_used == 0
    finally:
        free.set()
        step.set()
        eng.shutdown()


def test_rejections_made_with_every_seat_taken_are_counted_apart(tiny_checkpoints):
    """A request the full queue turns away while every seat runs counts in `rejected_seats_full` as well as under
    its reason."""
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", block_size=4,
                                 scheduler=SchedulerConfig(policy="fcfs", max_num_seqs=1, max_waiting=1,
                                                           prefill_max_tokens=256)))
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    try:
        reached, go = _hold_after_first_step(eng)
        checked = threading.Event()  # (until the test has seen b waiting, a's steps take 10 ms or more: a 4 s window)
        eng.add_step_observer(lambda _: checked.is_set() or time.sleep(0.01))
        eng.add_request([5] * 40, params, request_id="a")
        assert reached.wait(30)  # the one seat is taken
        b = eng.add_request([6] * 40, params, request_id="b")  # waits: the queue holds one
        turned = [eng.add_request([7] * 40, params, request_id=x) for x in ("c", "d")]
        go.set()
        for s in turned:
            last = s.get(timeout=30)
            assert last.finished and last.finish_reason == "rejected"
        deadline = time.time() + 10
        while eng.stats().rejected_seats_full < 2 and time.time() < deadline:
            time.sleep(0.005)
        st = eng.stats()
        assert st.rejected == {"overloaded": 2} and st.rejected_seats_full == 2 and st.num_waiting == 1
        checked.set()
        eng.abort("b")
    finally:
        eng.shutdown()


def test_abort_frees_blocks_and_ends_stream(tiny_checkpoints):
    eng = _engine(tiny_checkpoints["llama"])
    try:
        reached, go = _hold_after_first_step(eng)
        s = eng.add_request([5] * 40, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                            request_id="long")
        assert reached.wait(30)  # running, far from its end
        eng.abort("long")
        go.set()
        last = None
        for last in s:
            pass
        assert last.finished and last.finish_reason == "abort"
        deadline = time.time() + 5
        while eng.stats().kv_blocks_used and time.time() < deadline:
            time.sleep(0.01)
        assert eng.stats().kv_blocks_used == 0
    finally:
        eng.shutdown()


def test_running_engines_raise_the_young_collection_threshold_and_the_last_to_exit_restores_it(tiny_checkpoints):
    import gc

    import engine.engine as engine_module
    assert engine_module._gc_users == 0, "an engine of an earlier test still runs (one not shut down)"
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        a = _engine(tiny_checkpoints["llama"], gc_threshold=40_000)
        assert gc.get_threshold() == (40_000, 10, 10)
        b = _engine(tiny_checkpoints["llama"], gc_threshold=40_000)
        a.shutdown()
        assert gc.get_threshold() == (40_000, 10, 10)  # b still runs
        b.shutdown()
        assert gc.get_threshold() == (700, 10, 10)
        c = _engine(tiny_checkpoints["llama"], gc_threshold=0)
        assert gc.get_threshold() == (700, 10, 10)
        c.shutdown()
    finally:
        gc.set_threshold(*saved)


def test_add_requests_reach_the_first_step_together_and_a_bad_prompt_enqueues_none(tiny_checkpoints):
    eng = _engine(tiny_checkpoints["llama"], policy="kairos")
    events = []
    eng.add_step_observer(events.append)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        with pytest.raises(ValueError):
            eng.add_requests([[5] * 4, []], params)  # the empty prompt is refused: neither runs
        streams = eng.add_requests([[5] * 4, [6] * 5, [7] * 6], params)
        assert [sum(1 for _ in s) > 0 for s in streams] == [True] * 3
        eng.run_idle(lambda e: None, require_idle=False)  # the last step's event is in
        assert events[0].num_prefill == 3 and events[0].num_prefill_tokens == 15
        assert sum(e.num_prefill for e in events) == 3
    finally:
        eng.shutdown()


def test_streamed_text_equals_one_shot_decode(tiny_checkpoints):
    eng = _engine(tiny_checkpoints["qwen2"])
    tok = eng.tokenizer
    try:
        for seed in range(4):
            p = SamplingParams(max_tokens=48, temperature=1.0, seed=seed, ignore_eos=True)
            chunks, ids = [], []
            for o in eng.add_request("héllo wörld ✓ 你好 🎉", p):
                chunks.append(o.text)
                ids.extend(o.token_ids)
            assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True)
    finally:
        eng.shutdown()


def test_incremental_detokenizer_multibyte(tiny_checkpoints):
    from engine.detokenizer import IncrementalDetokenizer
    from engine.loader import load_model

    tok = load_model(tiny_checkpoints["gpt2"]).tokenizer
    text = "emoji 🎉🧪 and CJK 你好世界, accents héllo wörld ✓"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    pieces = [d.step(i) for i in ids]
    assert "".join(pieces) == text
    assert "" in pieces  # some characters really were split across tokens


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's, Mistral's decoder: a word's marker is its space, the first
    word's stripped in a decode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "\u2581The", "\u2581capital", "\u2581is", "\u2581Pa", "ris", ".", "\u2581and", "\u2581so"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_a_reply_is_decoded_after_its_prompt_so_its_first_word_keeps_its_space(tiny_checkpoints):
    """vLLM's: the reply's text is what decoding the prompt and the reply adds to the prompt's: a SentencePiece
    decode strips a sequence's first space, and a reply decoded alone lost the one before its first word; byte-level
    BPE (GPT-2's) is the same either way; a prompt whose last tokens cut a character is primed with its last
    PRIME_MAX tokens."""
    from engine.detokenizer import IncrementalDetokenizer
    from engine.loader import load_model

    tok = _metaspace_tokenizer()
    prompt, reply = [1, 2, 3], [4, 5, 6, 7, 8]
    assert tok.decode(reply) == "Paris. and so"  # (alone: its first space stripped)
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(d.step(t) for t in reply) + d.flush()
    assert text == " Paris. and so" == tok.decode(prompt + reply)[len(tok.decode(prompt)):]
    gpt2 = load_model(tiny_checkpoints["gpt2"]).tokenizer
    words = "emoji 🎉🧪 and CJK 你好世界, accents héllo wörld ✓"
    ids, head = gpt2.encode(words, add_special_tokens=False), gpt2.encode("Say it:", add_special_tokens=False)
    d = IncrementalDetokenizer(gpt2, prompt_ids=head)
    assert "".join(d.step(t) for t in ids) + d.flush() == words
    # a prompt of token ids that ends inside a character (a reply cut by max_tokens, continued): the reply's first
    # tokens complete it, and the character is the reply's (it began with U+FFFD), as vLLM's
    assert [gpt2.decode([t]) for t in ids[4:7]] == [" \ufffd", "\ufffd", "\ufffd"]  # (🎉's space and bytes)
    for k in (5, 6):
        d = IncrementalDetokenizer(gpt2, prompt_ids=head + ids[:k])
        assert "".join(d.step(t) for t in ids[k:]) + d.flush() == words[len("emoji"):], k


def _byte_fallback_tokenizer():
    """Llama 2's kind of decoder: SentencePiece with byte fallback (a character the vocabulary lacks is its UTF-8
    bytes, a token each)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "\u2581a": 258, "a": 259,
             "\u65e5": 260, "\u2581": 261, "\u00bb": 262}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")


def test_a_byte_run_that_turns_invalid_starts_the_decode_stream_over():
    """tokenizers' DecodeStream raises "Invalid prefix encountered" where a ByteFallback decoder's byte run turns
    invalid after a whole character (a sampled reply of byte tokens): the engine's worker died with every request
    in flight. The stream starts over, as vLLM's does; a reply of whole characters is decoded as before."""
    import random

    from engine.detokenizer import IncrementalDetokenizer

    tok = _byte_fallback_tokenizer()
    rng = random.Random(0)
    bytes_ = [2 + b for b in (0xE6, 0x97, 0xA5, 0xC2, 0xBB, 0x80, 0xC5)]
    for _ in range(300):
        d = IncrementalDetokenizer(tok, True, [rng.randrange(2, 263) for _ in range(rng.randrange(0, 6))])
        text = "".join(d.step(rng.choice(bytes_ + [258, 259, 260, 261, 262])) for _ in range(12)) + d.flush()
        assert isinstance(text, str)
    whole = [258, 2 + 0xE6, 2 + 0x97, 2 + 0xA5, 259, 262]  # " a", 日 as its three bytes, "a", »
    d = IncrementalDetokenizer(tok, True, [259])
    assert "".join(d.step(t) for t in whole) + d.flush() == " a\u65e5a\u00bb"
    # a prompt whose last tokens all hold a U+FFFD (its bytes, written in the prompt): still primed, so the reply's
    # first word keeps its space
    prompt = [1, 258, 2 + 0xEF, 2 + 0xBF, 2 + 0xBD, 258]
    d = IncrementalDetokenizer(tok, True, prompt)
    assert "".join(d.step(t) for t in (258, 258)) + d.flush() == " a a" == \
        tok.decode(prompt + [258, 258], skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]


def test_a_request_whose_output_fails_fails_alone(tiny_checkpoints):
    """An exception in one request's output (its text, a stop string) ends that request with an error; its
    neighbours and the engine go on (it broke the worker's loop: the engine died)."""
    eng = _engine(tiny_checkpoints["llama"])
    try:
        on_token = eng.outputs.on_token

        def failing(req, *args, **kwargs):
            if req.request_id == "bad" and req.num_output_tokens >= 3:
                raise RuntimeError("Invalid prefix encountered")
            return on_token(req, *args, **kwargs)

        eng.outputs.on_token = failing
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        bad, good = eng.add_request([5, 6, 7], params, request_id="bad"), eng.add_request([8, 9], params)
        last_bad, last_good = list(bad)[-1], list(good)[-1]
        assert last_bad.finish_reason == "error" and "output failed" in last_bad.error
        assert last_good.finish_reason == "length" and last_good.num_output_tokens == 12 and eng.is_alive()
    finally:
        eng.shutdown()


def test_a_request_id_used_again_while_its_aborted_step_runs_gets_only_its_own_prompt_logprobs(tiny_checkpoints):
    """Overlap scheduling: request A (asking prompt logprobs) is aborted while its prefill is in flight, and a new
    request takes its id; that step's prompt logprobs were written into the new request's (a longer prompt: an
    IndexError that killed the engine)."""
    eng = _engine(tiny_checkpoints["llama"], overlap="on")
    try:
        eng.inject_fault(hang_s=1.5)  # A's step held: what is posted meanwhile lands with it in flight
        a = eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=5, prompt_logprobs=1), request_id="A")
        time.sleep(0.3)  # (later, A's step has run: then nothing to see, and nothing fails)
        eng.abort("A")
        prompt = list(range(100, 109))
        b = eng.add_request(prompt, SamplingParams(max_tokens=3, prompt_logprobs=1), request_id="A")
        assert list(a)[-1].finished
        items = list(b)
        got = next(o.prompt_logprobs for o in items if o.prompt_logprobs is not None)
        assert [t.id for t in got] == prompt and items[-1].finish_reason == "length" and eng.is_alive()
    finally:
        eng.shutdown()


def test_a_request_a_more_urgent_one_evicted_ends_though_nothing_else_is_queued(tiny_checkpoints):
    """Priority scheduling with a full queue: B (more urgent) evicts A, then B is aborted before the next schedule.
    A is turned away at the next schedule, which, with no other request, never came: A's stream stayed open."""
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", block_size=4,
                                 scheduler=SchedulerConfig(policy="fcfs", prefill_max_tokens=256, max_waiting=1,
                                                           scheduling_policy="priority")))
    try:
        gate, holding = threading.Event(), threading.Event()

        def hold(_):
            holding.set()
            gate.wait(30)

        # the worker held in one drain of its inbox: the three posts below are taken in the same turn
        t = threading.Thread(target=lambda: eng.run_idle(hold, require_idle=False))
        t.start()
        assert holding.wait(30)
        a = eng.add_request([5, 6], SamplingParams(max_tokens=4), priority=5)
        b = eng.add_request([7, 8], SamplingParams(max_tokens=4), priority=0, request_id="b")
        eng.abort("b")
        gate.set()
        t.join(30)
        assert list(b)[-1].finish_reason == "abort"
        last = a.get(timeout=30)
        assert last.finished and last.finish_reason == "rejected" and last.reject_reason == "overloaded"
    finally:
        eng.shutdown()


def test_seeded_sampling_is_reproducible(tiny_checkpoints):
    eng = _engine(tiny_checkpoints["llama"])
    try:
        def run(seed):
            p = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=seed, ignore_eos=True)
            return [t for o in eng.add_request([3, 4, 5], p) for t in o.token_ids]
        assert run(7) == run(7)
        assert run(7) != run(8)
    finally:
        eng.shutdown()


def test_stop_strings_and_eos(tiny_checkpoints):
    eng = _engine(tiny_checkpoints["llama"])
    try:
        p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        full = "".join(o.text for o in eng.add_request([3, 4, 5], p))
        assert len(full) > 4
        stop = full[3:5]
        outs = list(eng.add_request([3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop])))
        text = "".join(o.text for o in outs)
        assert outs[-1].finish_reason == "stop" and stop not in text and full.startswith(text)
        assert outs[-1].stop_reason == stop  # the string that ended it (vLLM's stop_reason)
        toks = [t for o in eng.add_request([3, 4, 5], p) for t in o.token_ids]
        outs = list(eng.add_request([3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                              stop_token_ids=[toks[2]])))
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", toks[2])  # a stop token: its id
        cut = toks.index(toks[2])
        assert [t for o in outs for t in o.token_ids] == toks[:cut + 1]
        # its text is not the reply's (vLLM's, without include_stop_str_in_output)
        assert "".join(o.text for o in outs) == eng.bundle.tokenizer.decode(toks[:cut]).rstrip("\ufffd")
        assert list(eng.add_request([3, 4, 5], p))[-1].stop_reason is None  # by length: none
        # past min_tokens only (as vLLM): a stop string in the text of the first min_tokens tokens does not end it,
        # one that ends in a later token's text does
        toks = [t for o in eng.add_request([3, 4, 5], p) for t in o.token_ids]
        early = eng.bundle.tokenizer.decode(toks[:1])
        assert early and early in full[:len(early)]
        outs = list(eng.add_request([3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                              min_tokens=8, stop=[early])))
        text = "".join(o.text for o in outs)
        assert text.startswith(early) and sum(len(o.token_ids) for o in outs) >= 8
        later = full.find(early, len(eng.bundle.tokenizer.decode(toks[:8])) - len(early) + 1)  # ends after them
        assert (outs[-1].finish_reason, text) == (("stop", full[:later]) if later >= 0 else ("length", full))
        eos = eng.bundle.eos_token_ids[0]
        outs = list(eng.add_request([3, 4, 5], SamplingParams(max_tokens=5, stop_token_ids=[], temperature=0.0)))
        assert outs[-1].finish_reason in ("stop", "length")
        assert eos not in [t for o in outs for t in o.token_ids][:-1]
    finally:
        eng.shutdown()


def test_include_stop_str_in_output_keeps_a_stop_strings_and_a_stop_tokens_text(tiny_checkpoints):
    """vLLM's include_stop_str_in_output: the stop string that ends a reply stays in its text, and so does the text
    of a stop token id that ends it (without it both are left out)."""
    from transformers import AutoTokenizer

    path = tiny_checkpoints["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    eng = _engine(path)
    def plain(ids):  # whole characters only: what the streamed text and a one-shot decode agree on
        return all("\ufffd" not in tok.decode([t]) for t in ids)
    try:
        base = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
        for prompt in _prompts(eng.bundle.vocab_limit):
            ids = [t for o in eng.add_request(prompt, SamplingParams(**base)) for t in o.token_ids]
            end = next((j for j in range(2, 16) if ids[j] not in ids[:j] and tok.decode([ids[j]]).strip()
                        and plain(ids[:j + 1])), None)
            if end is not None:
                break
        assert end is not None

        def text(**kw):
            return "".join(o.text for o in eng.add_request(prompt, SamplingParams(**base, **kw)))
        kept = text(stop_token_ids=[ids[end]], include_stop_str_in_output=True)
        cut = text(stop_token_ids=[ids[end]])
    finally:
        eng.shutdown()
    assert kept == tok.decode(ids[:end + 1]) and cut == tok.decode(ids[:end])


@pytest.fixture(scope="module")
def llama_engine(tiny_checkpoints):
    """One engine for every bad input below: each must leave it serving the next."""
    eng = _engine(tiny_checkpoints["llama"])
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "non-empty"),
    ([1] * 600, SamplingParams(), "maximum context length is 512 tokens"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(max_tokens=-3), "max_tokens"),
    ("hi", SamplingParams(temperature=-0.1), "temperature"),
    ("hi", SamplingParams(top_p=-0.1), "top_p"),
    ("hi", SamplingParams(top_p=1.5), "top_p"),
    ([10**9], SamplingParams(), "token ids"),
])
def test_bad_input_raises_clear_error_and_engine_keeps_serving(llama_engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llama_engine.add_request(prompt, params)
    outs = list(llama_engine.add_request("still serving", SamplingParams(max_tokens=3, temperature=0.0)))
    assert outs[-1].finished and outs[-1].finish_reason in ("stop", "length")


def test_without_priority_scheduling_a_priority_is_accepted_and_has_no_effect(llama_engine):
    # vLLM 0.32's: a priority under its default fcfs is taken (and ignored); a non-integer is refused
    assert llama_engine.inputs.process("hi", SamplingParams(max_tokens=2), None, None, priority=3).priority == 0
    assert list(llama_engine.add_request("hi", SamplingParams(max_tokens=2), priority=3))[-1].finished
    with pytest.raises(ValueError, match="priority must be an integer"):
        llama_engine.add_request("hi", SamplingParams(max_tokens=2), priority=1.5)
    assert list(llama_engine.add_request("hi", SamplingParams(max_tokens=2), priority=0))[-1].finished


def test_unknown_model_path_is_a_value_error():
    with pytest.raises(ValueError, match="cannot load model"):
        LLMEngine(EngineConfig(model="/nonexistent/model/dir", device="cpu"))


def test_fault_in_a_step_ends_streams_with_error_and_engine_recovers(tiny_checkpoints):
    eng = _engine(tiny_checkpoints["llama"])
    try:
        eng.inject_fault(1)
        outs = list(eng.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0)))
        assert outs[-1].finish_reason == "error" and "injected" in outs[-1].error
        assert eng.is_alive()
        outs = list(eng.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
        assert outs[-1].finish_reason == "length"
    finally:
        eng.shutdown()


def test_a_job_queued_behind_a_step_that_breaks_the_worker_is_refused_not_run(tiny_checkpoints):
    """`run_idle`'s job posted while a step runs whose failure breaks the worker's loop: the inbox drained after the
    loop is refused (EngineDeadError), not run on the broken engine as if it were idle."""
    eng = _engine(tiny_checkpoints["llama"])
    try:
        eng.inject_fault(hang_s=2.0)  # the next step holds 2 s, then breaks the loop
        eng.inject_fault(fatal=True)
        stream = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
        deadline = time.monotonic() + 10
        while not (eng._fatal_fault and eng._hang_s == 0) and time.monotonic() < deadline:
            time.sleep(0.001)  # (until the step holds: both faults read, the hang begun)
        ran = []
        with pytest.raises(EngineDeadError):
            eng.run_idle(lambda e: ran.append(1), timeout=30)
        assert not ran and list(stream)[-1].finish_reason == "error"
    finally:
        eng.shutdown()


def test_a_dead_worker_ends_every_stream_even_where_ending_a_request_fails(tiny_checkpoints):
    """The worker's loop broke and ending a request then failed too (`_finish` raising): every open stream still
    ends (they waited for ever: the rest of the worker's clean-up never ran), and a request sent after is refused."""
    eng = _engine(tiny_checkpoints["llama"])
    try:
        stream = eng.add_request([1, 2, 3], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        next(iter(stream))  # (running)

        def broken(*args, **kwargs):
            raise RuntimeError("finish broke")

        eng._finish = broken
        eng.inject_fault(fatal=True)
        got = []
        reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
        reader.start()
        reader.join(20)
        assert got and got[-1].finished and got[-1].finish_reason == "error", got[-1:]
        deadline = time.monotonic() + 10
        while eng._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(EngineDeadError):
            eng.add_request([1, 2], SamplingParams(max_tokens=2))
    finally:
        eng.shutdown()


def test_a_hung_step_fails_every_request_as_unavailable_and_the_engine_counts_dead(tiny_checkpoints):
    """A step stuck in a device call never returns an error: past step_timeout_s the watchdog ends every open
    stream (the request in the step, one sent after) as unavailable, which the Ingress resends elsewhere, and the
    engine reports itself dead (a Serve replica's health check fails) and refuses new requests."""
    eng = _engine(tiny_checkpoints["llama"], step_timeout_s=3.0)
    try:
        assert eng.step_timeout_s == 3.0
        eng.inject_fault(hang_s=30.0)  # the next step hangs: the first one of `running`
        running = eng.add_request([1, 2, 3], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        t0 = time.monotonic()
        time.sleep(0.5)  # its step has begun (and hangs)
        waiting = eng.add_request([4, 5, 6], SamplingParams(max_tokens=4, temperature=0.0))
        last = list(running)[-1]
        ends = list(waiting)
        assert time.monotonic() - t0 < 20.0  # the watchdog, not the step's return, ended them
        for out in (last, ends[-1]):
            assert out.finish_reason == "error" and out.error_kind is ErrorKind.UNAVAILABLE
            assert "hung" in out.error and "step_timeout_s=3" in out.error
        assert not eng.is_alive() and not eng.stats().alive and "hung" in eng.dead_reason()
        with pytest.raises(EngineDeadError, match="hung"):
            eng.add_request([1, 2], SamplingParams(max_tokens=2))
    finally:
        eng.shutdown(timeout=1.0)  # its worker sleeps on in the injected hang, then finds the engine stopped


def test_the_step_timeout_defaults_to_the_latency_models_largest_step_with_a_floor():
    from engine.engine import STEP_TIMEOUT_FLOOR_S, step_timeout_s
    from scheduling.predictor import LatencyModel

    cfg = EngineConfig()
    assert step_timeout_s(cfg, None, 2048) == STEP_TIMEOUT_FLOOR_S
    assert step_timeout_s(cfg.model_copy(update={"step_timeout_s": 0.0}), None, 2048) == 0.0  # off
    fast = LatencyModel(prefill_coef=(0.01, 5.0, 0.0), decode_coef=(0.0, 0.0, 0.0, 10.0))
    assert step_timeout_s(cfg, fast, 2048) == STEP_TIMEOUT_FLOOR_S
    slow = LatencyModel(prefill_coef=(10.0, 0.0, 0.0), decode_coef=(0.0, 0.0, 0.0, 1000.0))  # 20 s for 2048
    assert step_timeout_s(cfg, slow, 2048) == pytest.approx(10 * (10.0 * 2048 + 1000.0) / 1000.0)


def test_a_step_predicted_longer_than_the_automatic_timeout_gets_ten_times_its_own_prediction():
    """Without a prefill token budget one step may prefill many whole prompts: the automatic limit, sized for one
    window, would call it hung."""
    from types import SimpleNamespace

    from scheduling.scheduler import StepPlan

    lm = LatencyModel(prefill_coef=(10.0, 0.0, 0.0), decode_coef=(0.0, 0.0, 0.0, 1000.0))
    me = SimpleNamespace(scheduler=SimpleNamespace(predictor=lm), _turn=(5.0, 120.0))
    small = StepPlan(num_prefill_tokens=100, decode=[object()], decode_mean_len=10.0)
    LLMEngine._allow(me, small)
    assert me._turn == (5.0, 120.0)  # 10 x 2 s: within the engine's limit
    big = StepPlan(num_prefill_tokens=64 * 2048, decode=[object()], decode_mean_len=10.0)
    LLMEngine._allow(me, big)
    assert me._turn == (5.0, pytest.approx(10 * (10.0 * 64 * 2048 + 1000.0) / 1000.0))


def test_decode_groups_split_by_length_and_pad_little():
    from engine.backends.torch_ref import group_by_length
    assert group_by_length([]) == []
    assert group_by_length([3, 3, 3, 3], overhead=0) == [(0, 4)]  # equal lengths: one group, no padding
    # a long request joining four short ones would pad each by 30 blocks: it gets its own group
    assert group_by_length([2, 2, 2, 2, 32], overhead=16) == [(0, 4), (4, 5)]
    assert group_by_length([2, 3, 4, 5], overhead=16) == [(0, 4)]  # small padding: one call is cheaper
    groups = group_by_length(sorted([1, 5, 9, 14, 20, 40, 41, 60, 90, 91]), overhead=8)
    assert groups[0][0] == 0 and groups[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # contiguous, in order, covering all


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "default"])
def test_prompt_encoder_matches_hf_encode(tiny_checkpoints, family):
    """add_request tokenizes through the fast tokenizer's backend directly: the same ids as HF's encode. (The
    tokenizer as `load_model` loads it, without the model's weights.)"""
    from transformers import AutoTokenizer

    from engine.default_model import ensure_default_model
    from engine.inputs import prompt_encoder

    path = str(ensure_default_model("kairos-default")) if family == "default" else tiny_checkpoints[family]
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    enc = prompt_encoder(tok)
    eos = tok.eos_token or ""
    for text in ["Hello", " leading space", "two  spaces\nnew line\ttab", "ünïcödé — 漢字 🙂", f"a{eos}b",
                 "x" * 300, "  ", "123 456.789"]:
        assert enc(text) == tok.encode(text, add_special_tokens=False), text


def test_a_cached_profile_follows_the_checkpoint_not_its_folder(tiny_checkpoints, tmp_path):
    """The profile cache is keyed by the checkpoint's content: a copy elsewhere (the same tiny model built in
    another test session's temporary folder) has the same identity; a weight rewritten in place, or another
    config, does not."""
    import shutil

    from engine.profiling import model_identity

    src = Path(tiny_checkpoints["llama"])
    copy = tmp_path / src.name
    shutil.copytree(src, copy)
    assert model_identity(str(copy)) == model_identity(str(src))
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    weights.write_bytes(bytes(data))
    assert model_identity(str(copy)) != model_identity(str(src))
    assert model_identity(tiny_checkpoints["qwen2"]) != model_identity(str(src))
    assert model_identity("some-hub/id") == "some-hub/id"  # not a folder: the name as given


def _pickled_modules(obj) -> list[str]:
    """The modules whose classes unpickling `obj` imports."""
    import io
    import pickle

    seen: list[str] = []

    class Spy(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append(module)
            return super().find_class(module, name)

    Spy(io.BytesIO(pickle.dumps(obj))).load()
    return seen


def test_reprofile_swaps_the_fit_when_idle_and_refuses_while_serving(tiny_checkpoints):
    from engine import profiling

    eng = _engine(tiny_checkpoints["llama"])
    try:
        before = eng.latency_model
        report = eng.reprofile(time_budget_s=2.0)
        assert report["cached"] is False and report["n_decode"] > 0
        assert eng.latency_model is not before and eng.profile_report == report
        fit, _ = eng.run_idle(lambda e: profiling.load_or_profile(e, 1.0, fresh=True))
        assert fit.meta and not [m for m in _pickled_modules(fit) if m.split(".")[0] == "torch"]  # (a new fit, as
        # an engine makes where none is cached: an engine process's client unpickles it, and imports no torch)
        rep = eng.reprofile(time_budget_s=2.0, scale=(2.0, 3.0))  # calibrated: the new fit's times, scaled
        fit, cal = LatencyModel.load(rep["path"]), eng.latency_model  # the cache keeps the unscaled fit
        assert cal.itl_ms(4, 100) == pytest.approx(2.0 * fit.itl_ms(4, 100))
        assert cal.prefill_ms(200) == pytest.approx(3.0 * fit.prefill_ms(200))
        held = threading.Event()

        def hold(_event) -> None:  # (after the busy request's first step, until the profile's job is queued: it
            if not held.is_set():  # is in flight when the job runs, however late this thread is scheduled)
                held.set()
                deadline = time.monotonic() + 30
                while eng._inbox.empty() and time.monotonic() < deadline:
                    time.sleep(0.001)

        unsubscribe = eng.add_step_observer(hold)
        s = eng.add_request([5] * 40, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                            request_id="busy")
        assert held.wait(30)
        with pytest.raises(RuntimeError, match="in flight"):
            eng.reprofile(time_budget_s=2.0)
        unsubscribe()
        eng.abort("busy")
        assert list(s)[-1].finish_reason == "abort"
        deadline = time.time() + 5
        while eng.stats().kv_blocks_used and time.time() < deadline:
            time.sleep(0.01)
        assert eng.stats().kv_blocks_used == 0  # the refused profile took no blocks
        outs = list(eng.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
        assert outs[-1].finish_reason == "length"
    finally:
        eng.shutdown()


def test_decode_probe_lengths_spread_around_the_mean():
    """A profile's decode batch of (B, L) has mean context exactly L, spread as a served batch's is."""
    from types import SimpleNamespace

    from engine.profiling import Prober

    probe = Prober(SimpleNamespace(max_model_len=600))
    for batch, ctx in ((1, 64), (7, 128), (32, 256), (16, 512)):
        lens = probe.lengths(batch, ctx)
        assert len(lens) == batch and sum(lens) == batch * ctx
        assert all(1 <= n <= 599 for n in lens)
    assert len(set(probe.lengths(32, 256))) > 8  # not all equal


def _first_logits(eng, prompts):
    """Logits of one prefill step over `prompts` (an idle engine, throwaway blocks)."""
    from engine.profiling import Prober

    def job(e):
        reqs, _ = Prober(e)._requests(prompts, 0)
        return e.runner.execute(reqs, []).float()
    return eng.run_idle(job)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_own_forward_matches_hf_modules_in_bf16(tiny_checkpoints, family):
    """bf16 takes other matmul kernels (oneDNN packed weights with fused post-ops on CPUs with native bf16,
    upcast fp32 GEMMs elsewhere): the logits stay within bf16 rounding of the HF modules' forward."""
    prompts = _prompts(512)[:4]
    out = {}
    for impl in ("kairos", "hf"):
        eng = LLMEngine(EngineConfig(model=tiny_checkpoints[family], dtype="bfloat16", device="cpu", block_size=4,
                                     model_impl=impl))
        try:
            out[impl] = _first_logits(eng, prompts)
        finally:
            eng.shutdown()
    scale = out["hf"].abs().max().item()
    assert (out["kairos"] - out["hf"]).abs().max().item() <= 0.03 * scale


def test_model_impl_kairos_refuses_an_unsupported_family(tiny_checkpoints):
    with pytest.raises(ValueError, match="model_impl='kairos'"):
        LLMEngine(EngineConfig(model=tiny_checkpoints["gpt2"], dtype="float32", device="cpu", model_impl="kairos"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_long_prefill_through_the_paged_kernel_matches_sdpa(tiny_checkpoints, dtype):
    """A 450-token prompt's prefill attends either through SDPA or, one query row per token, through the paged
    decode kernel (`CpuBackend.paged_prefill_max`: up to 4,096 tokens in bf16 on AVX512-BF16 without AMX): the
    same logits within the dtype's rounding, the same greedy token."""
    from engine.profiling import Prober

    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype=dtype, device="cpu", max_model_len=512))
    rng = random.Random(7)
    ids = [rng.randrange(3, eng.bundle.vocab_limit) for _ in range(450)]

    def logits(limit: int) -> torch.Tensor:
        eng.backend.paged_prefill_max = limit
        reqs, _ = Prober(eng)._requests([ids], 0)
        return eng.runner.execute(reqs, [])[0].float()

    try:
        assert eng.backend.kernels is not None
        sdpa, paged = (eng.run_idle(lambda e, n=n: logits(n)) for n in (0, 512))
        assert sdpa.argmax() == paged.argmax()
        tol = 0.02 if dtype == "bfloat16" else 1e-4
        assert (sdpa - paged).abs().max() <= tol * sdpa.abs().max()
    finally:
        eng.shutdown()


def test_paged_prefill_limit_by_dtype_and_instruction_set():
    from engine.backends.cpu.backend import PAGED_PREFILL_MAX, PAGED_PREFILL_MAX_AVX512_BF16, paged_prefill_max

    class Kernels:
        def __init__(self, isa):
            self.packed_isa = isa

    assert paged_prefill_max(None, torch.bfloat16) == 0
    assert paged_prefill_max(Kernels("avx512_bf16"), torch.bfloat16) == PAGED_PREFILL_MAX_AVX512_BF16 == 4096
    for isa, dtype in (("amx", torch.bfloat16), (None, torch.bfloat16), ("avx512_bf16", torch.float32)):
        assert paged_prefill_max(Kernels(isa), dtype) == PAGED_PREFILL_MAX == 256


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_the_engine_offers_the_models_sampling_defaults_unless_told_not_to(tiny_checkpoints, tmp_path, mode):
    """generation_config=auto (vLLM's default): the engine offers what the model's generation_config recommends, which
    the OpenAI server applies to requests that leave those knobs out; vllm: none (the server's own defaults)."""
    import json
    import shutil

    path = tmp_path / "sampling"
    shutil.copytree(tiny_checkpoints["llama"], path)
    cfg = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 0.6, "top_p": 0.9,
                                                             "max_new_tokens": 7}))
    eng = _engine(str(path), generation_config=mode)
    try:
        auto = mode == "auto"
        assert eng.sampling_defaults == ({"temperature": 0.6, "top_p": 0.9, "max_tokens": 7} if auto else {})
        # (its max_new_tokens: the cap of a reply whose request sets none)
        assert eng.inputs.default_max_tokens == (7 if auto else None)
        out = list(eng.add_request([1, 2, 3], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)))
        assert out[-1].num_output_tokens == (7 if auto else eng.max_model_len - 3)
    finally:
        eng.shutdown()


def test_reconfigure_swaps_the_scheduler_once_idle_and_keeps_what_the_engine_counts(tiny_checkpoints):
    """`LLMEngine.reconfigure`: a request in flight finishes under the scheduler that admitted it, with the same
    tokens; one that arrives meanwhile waits for the new scheduler (counted as waiting), which runs once the old one
    has drained, over the same KV cache, and serves it with the same tokens; what the engine counts since its start
    (preemptions, the latency model's error on its steps) carries over. A knob fixed at start, an unknown knob or a
    bad value is a ValueError that changes nothing."""
    eng = _engine(tiny_checkpoints["llama"])
    try:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        alone = [t for o in eng.add_request([5] * 30, params) for t in o.token_ids]
        errors = eng.scheduler.model_error
        checked = threading.Event()  # (until the test has seen both: each step of the busy one takes 10 ms or more,
        eng.add_step_observer(lambda _: checked.is_set() or time.sleep(0.01))  # a 4 s window for a late thread)
        busy = eng.add_request([5] * 30, params)
        first = busy.get(timeout=30)
        cfg = eng.reconfigure({"policy": "scorpio", "vbs_margin": 1.2})
        assert (cfg.policy, cfg.vbs_margin, cfg.prefill_max_tokens) == ("scorpio", 1.2, 256)  # over its start's
        late = eng.add_request([5] * 30, params)
        deadline = time.time() + 5
        while (st := eng.stats()).num_waiting != 1 and time.time() < deadline:
            time.sleep(0.001)
        assert (st.num_running, st.num_waiting) == (1, 1)  # (the test needs the first still running here)
        assert st.policy == "fcfs" and eng.scheduler.config.policy == "fcfs"  # busy: not yet
        checked.set()
        rest = [t for o in busy for t in o.token_ids]
        assert first.token_ids + rest == alone  # the request in flight is served as before
        assert [t for o in late for t in o.token_ids] == alone  # and the late one, by the new scheduler
        deadline = time.time() + 5  # (the late one's blocks are free once a snapshot after its end is published)
        while ((st := eng.stats()).policy != "scorpio" or st.kv_blocks_free != st.kv_blocks_total) \
                and time.time() < deadline:
            time.sleep(0.01)
        assert st.policy == "scorpio" and eng.scheduler.flags.vbs_gate and eng.scheduler.model_error is errors
        assert st.kv_blocks_free == st.kv_blocks_total
        assert [t for o in eng.add_request([5] * 30, params) for t in o.token_ids] == alone
        # the knobs asked replace those asked before: back to the start's policy, with its own margin
        assert eng.reconfigure({}).policy == "fcfs"
        for bad, match in (({"max_num_seqs": 8}, "max_num_seqs .* cannot change"), ({"polcy": "edf"}, "polcy"),
                           ({"policy": "lifo"}, "policy"), ({"vbs_margin": -1}, "vbs_margin"), (["edf"], "mapping")):
            with pytest.raises(ValueError, match=match):
                eng.reconfigure(bad)
        deadline = time.time() + 5
        while eng.stats().policy != "fcfs" and time.time() < deadline:
            time.sleep(0.01)
        assert eng.stats().policy == "fcfs" and eng.scheduler.config.vbs_margin is None
    finally:
        eng.shutdown()


def test_a_request_aborted_while_it_waits_for_a_new_scheduler_no_longer_counts_as_waiting(tiny_checkpoints):
    eng = _engine(tiny_checkpoints["llama"])
    try:
        checked = threading.Event()  # (until the test has seen it all, the running request's steps take 10 ms or
        eng.add_step_observer(lambda _: checked.is_set() or time.sleep(0.01))  # more: its reply, clamped to the
        busy = eng.add_request([5] * 10, SamplingParams(max_tokens=2000, ignore_eos=True))  # window, 5 s at least
        busy.get(timeout=30)
        eng.reconfigure({"policy": "edf"})
        waiting = [eng.add_request([6] * 10, SamplingParams(max_tokens=5)) for _ in range(3)]

        def published(want: tuple) -> tuple:
            deadline = time.monotonic() + 10
            while (got := ((st := eng.stats()).num_waiting, st.num_running, st.policy)) != want \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
            return got

        assert published((3, 1, "fcfs")) == (3, 1, "fcfs")
        for s in waiting:
            eng.abort(s.request_id)
            assert [o for o in s][-1].finish_reason is FinishReason.ABORT
        assert published((0, 1, "fcfs")) == (0, 1, "fcfs")  # (busy still runs)
        checked.set()
    finally:
        eng.shutdown()


def test_reconfigured_follows_the_devices_defaults_for_the_new_policy():
    """`engine.config.reconfigured`: a GPU's scheduler defaults apply where neither the start nor the change set a
    knob, by the new policy (kairos's VBS margin 1.0 there); the knobs given at start stay unless changed."""
    from engine.config import for_device, reconfigured

    given = SchedulerConfig(policy="fcfs", max_waiting=100)
    running = for_device(EngineConfig(scheduler=given), "cuda").scheduler
    cfg = reconfigured(given, running, {"policy": "kairos", "length_predictor": "true"}, "cuda")
    assert (cfg.policy, cfg.length_predictor, cfg.vbs_margin, cfg.max_num_seqs, cfg.max_waiting) == \
        ("kairos", True, 1.0, 256, 100)
    assert reconfigured(given, running, {"policy": "scorpio"}, "cuda").vbs_margin is None  # its preset's 1.3
    on_cpu = for_device(EngineConfig(scheduler=given), "cpu").scheduler
    assert reconfigured(given, on_cpu, {"policy": "kairos"}, "cpu").vbs_margin is None  # the CPU: the preset's
    with pytest.raises(ValueError, match="prefill_max_tokens"):
        reconfigured(given, running, {"prefill_max_tokens": 512}, "cuda")
    assert reconfigured(given, running, {"prefill_max_tokens": 2048}, "cuda").prefill_max_tokens == 2048  # as it is


def test_dummy_load_format_serves_random_weights_from_a_config_alone(tiny_checkpoints, tmp_path):
    """`load_format=dummy` (vLLM's): a folder without weight files serves the model of its config.json, with the
    architecture's own initialisation at seed 0: HF's greedy tokens on those weights; without it the folder is a
    clear error."""
    import shutil

    from transformers import AutoConfig

    src = Path(tiny_checkpoints["llama"])
    for f in src.iterdir():
        if f.suffix not in (".safetensors", ".bin"):
            shutil.copy2(f, tmp_path / f.name)
    with pytest.raises(ValueError, match="cannot load model"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    eng = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", dtype="float32", device="cpu",
                                 block_size=4))
    try:
        assert eng.bundle.model.generation_config.to_diff_dict() == \
            AutoModelForCausalLM.from_pretrained(src).generation_config.to_diff_dict()  # the checkpoint's, read
        prompts = _prompts(eng.bundle.config.vocab_size)[:3]
        got = [[t for o in eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
                for t in o.token_ids] for p in prompts]
    finally:
        eng.shutdown()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    assert got == want


def test_a_reconfigure_whose_scheduler_cannot_be_built_leaves_the_engine_serving_as_before(tiny_checkpoints, tmp_path):
    """A length predictor file that does not load is the caller's ValueError (it was only logged, once the old
    scheduler had drained). A change that fails when the worker builds its scheduler is logged; the engine keeps its
    scheduler, serves, and its requests keep their priorities where that scheduler ranks by them (they came in at
    priority 0 once a change to fcfs had been asked)."""
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", block_size=4,
                                 scheduler=SchedulerConfig(policy="fcfs", scheduling_policy="priority")))
    try:
        bad = tmp_path / "lengths.npz"
        bad.write_bytes(b"not an npz")
        with pytest.raises(ValueError, match="length_predictor_path"):
            eng.reconfigure({"policy": "kairos", "length_predictor": True, "length_predictor_path": str(bad)})

        def broken(*args, **kwargs):
            raise RuntimeError("cannot build it")

        eng._new_scheduler = broken
        eng.reconfigure({"policy": "edf", "scheduling_policy": "fcfs"})
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        assert list(eng.add_request([1, 2, 3], params))[-1].finish_reason == "length"
        time.sleep(0.2)
        assert eng.is_alive() and eng.stats().policy == "fcfs"
        assert eng.inputs.process([1, 2, 3], params, None, None, priority=5).priority == 5
        assert list(eng.add_request([1, 2, 3], params))[-1].finish_reason == "length"
    finally:
        eng.shutdown()


def test_a_request_posted_as_the_engine_stops_ends_instead_of_waiting_forever(tiny_checkpoints):
    """`add_request` checks the engine runs, then posts: a shutdown that drains the inbox between the two left the
    request's stream with no end. Its stream now ends as unavailable, whichever of the two comes first."""
    eng = _engine(tiny_checkpoints["llama"])
    real = eng._inbox

    entered, stopped = threading.Event(), threading.Event()

    class SlowPost:  # the caller's thread descheduled between the check and the put, until the engine has stopped
        def put(self, item):
            if isinstance(item, tuple):
                entered.set()
                stopped.wait(10)
            real.put(item)

        def get_nowait(self):
            return real.get_nowait()

    eng._inbox = SlowPost()
    box = {}
    poster = threading.Thread(target=lambda: box.setdefault("s", eng.add_request([1, 2, 3], SamplingParams())))
    poster.start()
    assert entered.wait(10)  # (checked that the engine runs)
    eng.shutdown()
    stopped.set()
    poster.join()
    out = box["s"].get(timeout=10)
    assert out.finished and out.finish_reason is FinishReason.ERROR and out.error == "engine shut down"
    assert out.error_kind is ErrorKind.UNAVAILABLE


def test_the_apps_chat_template_renders_chats_in_process(tiny_checkpoints):
    """vLLM's --chat-template (EngineConfig.chat_template) in place of the tokenizer's own."""
    from core.messages import ChatTurn

    eng = _engine(tiny_checkpoints["llama"], chat_template="{{ messages[0]['content'] }}!")
    try:
        assert eng.inputs.render_chat([ChatTurn("user", "hi")]) == "hi!"
    finally:
        eng.shutdown()


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_the_gpu_warm_up_step_fits_its_own_cache_at_any_block_size(tiny_checkpoints, monkeypatch, block_size):
    """The CUDA start's warm-up step (the largest step's activations, measured before the KV cache is sized) holds
    its prompt and `max_num_seqs` decodes of 2 tokens each in a cache made for it: with block_size 1 each decode
    needs 2 blocks, and the start failed ("KV accounting bug"). Its torch.cuda calls stubbed, on the CPU."""
    from engine.kv_cache import cache_spec

    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 1 << 40)
    sched = SchedulerConfig(policy="fcfs", max_num_seqs=4, prefill_max_tokens=16, chunked_prefill=True)
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], device="cpu", block_size=block_size,
                                 dtype="float32", backend="torch", scheduler=sched, max_model_len=64))
    try:
        spec = cache_spec(eng.config, eng.bundle, eng.backend)
        assert eng.run_idle(lambda e: e._warmup_peak(spec, e.runner.decoder)) > 0
    finally:
        eng.shutdown()


def test_longrope_takes_one_set_of_factors_for_every_request_of_a_step(tiny_checkpoints, tmp_path):
    """LongRoPE (Phi-3's) as vLLM runs it: its long factors for every position where the window passes the
    pretraining one, else its short ones. HF's rotary module chose by the longest position of the packed step: a
    short prompt batched with a long one took the long factors, alone the short ones (its logprobs differed)."""
    import json
    import shutil

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = tmp_path / "longrope"
    shutil.copytree(tiny_checkpoints["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(max_position_embeddings=128, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.3 * i for i in range(8)], "original_max_position_embeddings": 32})
    (path / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    for window, factors in ((128, "long"), (32, "short")):
        eng = _engine(str(path), max_model_len=window)
        try:
            short, long = _prompts(eng.bundle.vocab_limit)[0][:5], _prompts(eng.bundle.vocab_limit)[-1][:window - 8]
            together = [[x.logprob for o in s for x in o.logprobs] for s in eng.add_requests([short, long], params)]
            alone = [x.logprob for o in eng.add_request(short, params) for x in o.logprobs]
            assert together[0] == pytest.approx(alone, abs=1e-5), window
            rotary = eng.bundle.model.model.rotary_emb
            seq = 33 if factors == "long" else None
            want = ROPE_INIT_FUNCTIONS["longrope"](eng.bundle.config, rotary.inv_freq.device, seq_len=seq)[0]
            assert torch.allclose(rotary.inv_freq.float(), want.float()), window
        finally:
            eng.shutdown()


def test_a_logit_softcap_is_refused_by_the_paged_attention_not_dropped():
    """The paged attention the engine's models run has no logit softcapping (Gemma 2's): a model asking for one
    gets an error, not logits computed without it."""
    import pytest as _pytest

    from engine.attention import paged_attention

    with _pytest.raises(NotImplementedError, match="softcap"):
        paged_attention(None, None, None, None, None, softcap=50.0)
