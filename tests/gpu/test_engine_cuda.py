"""The engine on the GPU, through its public API: greedy token-exact with HF `generate` (fp32) on the four tiny
families; sampled requests (the API's default temperature 1.0, and temperature / top-k / top-p / seed),
seeded reproducibility alone and in a batch, a greedy request beside sampled ones; penalties; logprobs; JSON mode;
mixed context lengths in one batch; chunked prefill; a preempted request resumed; a hung step. Skipped without CUDA
(conftest.py)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from tests.gpu.conftest import (
    collect,
    free_device_memory,
    greedy,
    hf_greedy,
    hf_model,
    make_engine,
    random_prompts,
    run_all,
)

LENS = [1, 7, 33, 100, 250, 300]
MAX_TOKENS = [12, 30, 5, 25, 17, 40]
MIXED_LENS = [3, 17, 64, 129, 200, 257, 350, 420]


def _submit_together(eng, prompts, params) -> list:
    """Each prompt with its own params, enqueued back to back holding the GIL (so that the worker sees them in
    one step, as far as a thread switch allows; the assertions do not depend on it)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        return [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    finally:
        sys.setswitchinterval(old)


def _observe(eng) -> tuple[list, callable]:
    events: list = []
    return events, eng.add_step_observer(events.append)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
def test_greedy_token_exact_with_hf(device, ckpts, family):
    path = ckpts[family]
    eng = make_engine(path, device)
    try:
        prompts = random_prompts(LENS, eng.bundle.vocab_limit, seed=3)
        outs = run_all(_submit_together(eng, prompts, [greedy(k) for k in MAX_TOKENS]))
    finally:
        eng.shutdown()
    ref = hf_greedy(hf_model(path, device), prompts, MAX_TOKENS)
    free_device_memory()
    assert outs == ref


def test_mixed_lengths_in_one_batch_equal_each_alone(device, llama_engine):
    eng = llama_engine
    prompts = random_prompts(MIXED_LENS, eng.bundle.vocab_limit, seed=5)
    events, unsubscribe = _observe(eng)
    try:
        together = run_all(eng.add_requests(prompts, greedy(24)))
    finally:
        unsubscribe()
    assert max(e.num_decode for e in events) == len(prompts)  # all of them decoded in one step
    alone = [run_all([eng.add_request(p, greedy(24))])[0] for p in prompts]
    assert together == alone


def test_penalized_greedy_replies_equal_each_alone_and_hf(device, ckpts, llama_engine):
    """Presence, frequency and repetition penalties on the GPU (their counts on the device, a reply's last token
    read from the step in flight): in one batch the replies are each one's alone, and the repetition penalty's is
    HF's token for token."""
    from core.sampling import SamplingParams

    eng = llama_engine
    prompts = random_prompts([5, 40, 120], eng.bundle.vocab_limit, seed=11)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **kw) for kw in (
        dict(repetition_penalty=1.6), dict(presence_penalty=1.5, frequency_penalty=0.5),
        dict(repetition_penalty=0.8, frequency_penalty=-0.5))]
    together = run_all(_submit_together(eng, prompts, params))
    alone = [run_all([eng.add_request(p, sp)])[0] for p, sp in zip(prompts, params)]
    assert together == alone
    ref = hf_greedy(hf_model(ckpts["llama"], device), prompts[:1], [24], repetition_penalty=1.6)
    free_device_memory()
    assert together[0] == ref[0]


def test_logprobs_on_the_device_are_the_models_own_in_a_batch_and_alone(device, ckpts, llama_engine):
    """Logprobs picked on the device and copied with the tokens (one wait): greedy, sampled and penalized rows in one
    batch with a row that asks none; each row's are its own alone, and the model's (HF's fp32 forward on the reply,
    within float noise: the engine's kernels differ from HF's); a prompt's logprobs too."""
    import torch

    from core.sampling import SamplingParams

    eng = llama_engine
    prompts = random_prompts([5, 40, 120, 9], eng.bundle.vocab_limit, seed=13)
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=2, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, logprobs=20,
                             prompt_logprobs=3),
              greedy(16)]

    def run(streams):
        out = []
        for s in streams:
            items = list(s)
            toks = [t for o in items for t in o.token_ids]
            lps = None if items[-1].logprobs is None else [x for o in items for x in o.logprobs]
            prompt = [o.prompt_logprobs for o in items if o.prompt_logprobs is not None]
            out.append((toks, lps, prompt))
        return out
    together = run(_submit_together(eng, prompts, params))
    alone = [run([eng.add_request(p, sp)])[0] for p, sp in zip(prompts, params)]
    assert [t for t, *_ in together] == [t for t, *_ in alone]
    assert together[3][1] is None and [len(x[2]) for x in together] == [0, 0, 1, 0]
    model = hf_model(ckpts["llama"], device)
    with torch.inference_mode():  # the prompt's logprobs (a prefill with prompt rows: eager, not a mixed graph)
        logits = model(torch.tensor([prompts[2]], device=device)).logits[0, :-1]
    ref = torch.log_softmax(logits.float(), dim=-1)[:, :eng.bundle.vocab_limit]
    (plp,) = together[2][2]
    assert len(plp) == 120 and plp[0].logprob is None and all(len(x.top) == 3 for x in plp[1:])
    want = ref.gather(-1, torch.tensor(prompts[2][1:], device=device).unsqueeze(-1)).squeeze(-1).tolist()
    assert [x.logprob for x in plp[1:]] == pytest.approx(want, abs=5e-3)
    for (toks, lps, _), (_, lone, _), p, sp in zip(together, alone, prompts, params):
        if sp.logprobs is None:
            continue
        assert len(lps) == len(toks) == 16 and all(len(x.top) == sp.logprobs for x in lps)
        assert [x.logprob for x in lps] == pytest.approx([x.logprob for x in lone], abs=1e-3)
        with torch.inference_mode():
            logits = model(torch.tensor([p + toks], device=device)).logits[0, len(p) - 1:-1]
        ref = torch.log_softmax(logits.float(), dim=-1)[:, :eng.bundle.vocab_limit]
        want = ref.gather(-1, torch.tensor(toks, device=device).unsqueeze(-1)).squeeze(-1).tolist()
        assert [x.logprob for x in lps] == pytest.approx(want, abs=5e-3)
    del model
    free_device_memory()


def test_json_mode_on_the_device_beside_plain_replies(device, ckpts, llama_engine):
    """JSON mode's rows are drawn on the host from the device's logits (the step before's tokens read there too,
    under overlap scheduling): each reply is a JSON object's prefix, one forced to "{}" ends by its EOS, a guided
    regex's reply matches it, and the plain replies beside them are as alone."""
    import json
    import re

    from core.json_grammar import START, advance
    from core.sampling import SamplingParams

    eng = llama_engine
    tok = eng.outputs.tokenizer
    braces = (tok.convert_tokens_to_ids("{"), tok.convert_tokens_to_ids("}"), tok.eos_token_id)
    prompts = random_prompts([5, 40, 120, 17], eng.bundle.vocab_limit, seed=17)
    params = [SamplingParams(max_tokens=24, temperature=0.0, json_object=True),
              SamplingParams(max_tokens=24, temperature=0.0, json_object=True, allowed_token_ids=braces),
              greedy(24), SamplingParams(max_tokens=24, temperature=1.0, seed=4, regex=r"[0-9]{2}-(ab|cd)")]
    streams = _submit_together(eng, prompts, params)
    items = [list(s) for s in streams]
    texts = ["".join(o.text for o in its) for its in items]
    assert advance(START, texts[0]) is not None, texts[0]
    assert json.loads(texts[1]) == {} and items[1][-1].finish_reason == "stop"
    assert [t for o in items[2] for t in o.token_ids] == run_all([eng.add_request(prompts[2], greedy(24))])[0]
    assert re.fullmatch(r"[0-9]{2}-(ab|cd)", texts[3]) and items[3][-1].finish_reason == "stop", texts[3]


def test_chunked_prefill_equals_unchunked(device, ckpts, llama_engine):
    prompts = random_prompts([400, 9, 150], llama_engine.bundle.vocab_limit, seed=7)
    unchunked = [run_all([llama_engine.add_request(p, greedy(20))])[0] for p in prompts]
    eng = make_engine(ckpts["llama"], device, prefill_max_tokens=32, chunked_prefill=True)
    try:
        events, _ = _observe(eng)
        chunked = run_all(_submit_together(eng, prompts, [greedy(20)] * len(prompts)))
        eng.run_idle(lambda e: None, require_idle=False)  # the last step's event is in
    finally:
        eng.shutdown()
    assert max(e.num_prefill_tokens for e in events) <= 32  # the 400-token prompt took 13 steps or more
    assert sum(e.num_prefill_tokens for e in events) >= sum(map(len, prompts))
    assert chunked == unchunked


def test_best_effort_prompts_in_chunks_beside_a_running_reply_equal_unchunked(device, ckpts, llama_engine):
    """kairos computes a best-effort prompt that arrives while a reply decodes in chunks of at most its prompt budget
    (decode and prefill rows in the same steps, the mixed graphs on CUDA): the same tokens as each prompt alone."""
    prompts = random_prompts([12, 400, 150], llama_engine.bundle.vocab_limit, seed=29)
    alone = [run_all([llama_engine.add_request(p, greedy(20))])[0] for p in prompts]
    eng = make_engine(ckpts["llama"], device, policy="kairos", prefill_max_tokens=32)
    try:
        events, _ = _observe(eng)
        reached, go = threading.Event(), threading.Event()

        def hold(_event) -> None:  # after the reply's first step the worker waits for the long prompts: on a GPU
            if not reached.is_set():  # its other 19 steps may take less than a late thread's wake-up
                reached.set()
                go.wait(30)

        eng.add_step_observer(hold)
        first = eng.add_request(prompts[0], greedy(20))
        assert reached.wait(120)  # the reply is decoding before the long prompts arrive
        rest = [eng.add_request(p, greedy(20)) for p in prompts[1:]]
        go.set()
        toks, last = collect(first)
        outs = [toks] + run_all(rest)
        eng.run_idle(lambda e: None, require_idle=False)  # the last step's event is in
    finally:
        eng.shutdown()
    assert last.finish_reason == "length" and outs == alone
    assert any(0 < e.num_prefill_tokens <= 32 and e.num_decode for e in events)  # a chunk beside the decode


def test_preempted_requests_resume_token_exact(device, ckpts, llama_engine):
    """40 blocks of 16 = 640 cache slots; 8 prompts of 48 tokens fit, their 64 new tokens each (896 slots in
    all) do not: the scheduler preempts, then recomputes the preempted requests (more prompt tokens prefilled
    than the prompts hold), and every output equals the unconstrained engine's."""
    prompts = random_prompts([48] * 8, llama_engine.bundle.vocab_limit, seed=11)
    free = run_all(llama_engine.add_requests(prompts, greedy(64)))
    eng = make_engine(ckpts["llama"], device, num_kv_blocks=40, block_size=16, max_model_len=400)
    try:
        events, _ = _observe(eng)
        tight = run_all(eng.add_requests(prompts, greedy(64)))
        eng.run_idle(lambda e: None, require_idle=False)
        st = eng.stats()
        assert st.kv_blocks_free == st.kv_blocks_total == 40
    finally:
        eng.shutdown()
    assert st.preemptions > 0 and sum(e.num_prefill_tokens for e in events) > sum(map(len, prompts))
    assert tight == free


def test_replies_over_a_cached_prefix_equal_the_uncached_engines(device, ckpts):
    """Prompts over one 100-token system prompt, and one prompt again: with prefix caching (the default) each
    admission after the first computes only what follows the cached blocks (the paged prefill kernel over them), and
    every reply equals an engine's without it, which computes each prompt whole."""
    outs = {}
    for caching in (False, True):
        eng = make_engine(ckpts["llama"], device, block_size=16, enable_prefix_caching=caching)
        try:
            system = random_prompts([100], eng.bundle.vocab_limit, seed=41)[0]
            tails = random_prompts([5, 40, 1, 130], eng.bundle.vocab_limit, seed=43)
            prompts = [system + t for t in tails] + [system + tails[1]]
            first = run_all([eng.add_request(prompts[0], greedy(16))])
            outs[caching] = first + run_all(_submit_together(eng, prompts[1:], [greedy(16)] * 4))
            eng.run_idle(lambda e: None, require_idle=False)
            st = eng.stats()
        finally:
            eng.shutdown()
        assert st.kv_blocks_free == st.kv_blocks_total
        assert (st.prefix_cache_hits >= 4 * 96) == caching and (st.prefix_cache_hits == 0) != caching
    assert outs[True] == outs[False]


def test_lora_adapters_replies_equal_peft(device, ckpts, tmp_path):
    """Requests of the base model and of two LoRA adapters in the same steps (those run eagerly: no graph holds an
    adapter's rows), then base requests alone (the decode graphs): each reply is PEFT's own model's, on the GPU."""
    peft = pytest.importorskip("peft")
    from engine.testing import build_tiny_lora

    base = ckpts["llama"]
    adapters = {"a": str(build_tiny_lora(base, tmp_path / "a", seed=1)),
                "b": str(build_tiny_lora(base, tmp_path / "b", seed=2, targets=("q_proj", "v_proj", "down_proj"), r=4,
                                         alpha=8, rslora=True))}
    eng = make_engine(base, device, lora_modules=adapters)
    try:
        prompts = random_prompts([5, 40, 100], eng.bundle.vocab_limit, seed=7)
        jobs = [(p, lo) for lo in (None, "a", "b") for p in prompts]
        old = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        try:
            streams = [eng.add_request(p, greedy(12), lora=lo) for p, lo in jobs]
        finally:
            sys.setswitchinterval(old)
        outs = run_all(streams)
        alone = run_all(_submit_together(eng, prompts, [greedy(12)] * 3))
    finally:
        eng.shutdown()
    want = {}
    for lo in (None, "a", "b"):
        model = hf_model(base, device)
        if lo is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[lo]).eval()
        want[lo] = hf_greedy(model, prompts, [12] * 3)
    free_device_memory()
    assert want["a"] != want[None] and want["b"] != want[None]
    assert outs == [w for lo in (None, "a", "b") for w in want[lo]]
    assert alone == want[None]


def test_default_temperature_and_sampling_knobs(device, llama_engine):
    """What an OpenAI client sends without `temperature` (1.0), and each knob: every request ends by length
    with ids the tokenizer has."""
    from core.sampling import SamplingParams

    eng = llama_engine
    params = [SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.7, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, top_k=20, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.2, top_p=0.8, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.0, top_p=0.05, ignore_eos=True)]
    prompts = random_prompts([5, 40, 12, 77, 3, 20], eng.bundle.vocab_limit, seed=13)
    outs = run_all(_submit_together(eng, prompts, params))
    assert all(len(o) == 16 and all(0 <= t < eng.bundle.vocab_limit for t in o) for o in outs)
    assert len({tuple(o) for o in outs[:4]}) > 1  # sampled, not one fixed answer


def test_seeded_sampling_is_reproducible_alone_and_batched(device, llama_engine):
    from core.sampling import SamplingParams

    eng = llama_engine
    p, q, r = random_prompts([9, 31, 70], eng.bundle.vocab_limit, seed=17)

    def seeded(seed):
        return SamplingParams(max_tokens=32, temperature=1.0, top_k=100, top_p=0.95, seed=seed, ignore_eos=True)

    solo = run_all([eng.add_request(p, seeded(7))])[0]
    assert run_all([eng.add_request(p, seeded(7))])[0] == solo
    assert run_all([eng.add_request(p, seeded(8))])[0] != solo
    # the same prompt and seed twice in one batch, beside other prompts with that seed: the same tokens as alone
    batched = run_all(eng.add_requests([p, q, p, r], seeded(7)))
    assert batched[0] == solo and batched[2] == solo
    # and beside unseeded and greedy neighbours
    mixed = run_all(_submit_together(eng, [q, p, r], [SamplingParams(max_tokens=32, ignore_eos=True), seeded(7),
                                                       greedy(32)]))
    assert mixed[1] == solo


def test_greedy_request_beside_sampled_ones_equals_its_solo_run(device, llama_engine):
    from core.sampling import SamplingParams

    eng = llama_engine
    g, a, b, c = random_prompts([25, 8, 60, 14], eng.bundle.vocab_limit, seed=19)
    solo = run_all([eng.add_request(g, greedy(32))])[0]
    events, unsubscribe = _observe(eng)
    try:
        streams = _submit_together(eng, [a, g, b, c], [
            SamplingParams(max_tokens=40, ignore_eos=True),
            greedy(32),
            SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=1.1, top_k=10, ignore_eos=True)])
        outs = run_all(streams)
    finally:
        unsubscribe()
    assert outs[1] == solo
    assert max(e.num_decode for e in events) >= 2  # the greedy request shared decode steps with sampled ones


def test_logit_bias_and_min_tokens_act_on_their_own_rows(device, llama_engine):
    """OpenAI's logit_bias and vLLM's min_tokens on the device's sampler, in one batch with a plain greedy request:
    +100 makes a token every greedy and every sampled (top-p, the Triton draw) choice, -100 bans a greedy run's own
    first token, a stop token id below min_tokens is never drawn; the plain request equals its solo run."""
    from core.sampling import SamplingParams

    eng = llama_engine
    plain_p, force_p, draw_p, ban_p, stop_p = random_prompts([12, 30, 7, 45, 20], eng.bundle.vocab_limit, seed=23)
    plain = run_all([eng.add_request(plain_p, greedy(16))])[0]
    first = run_all([eng.add_request(ban_p, greedy(1))])[0][0]
    favourite = run_all([eng.add_request(stop_p, greedy(1))])[0][0]
    outs = run_all(_submit_together(eng, [plain_p, force_p, draw_p, ban_p], [
        greedy(16),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0}),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True, logit_bias={43: 100.0}),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0})]))
    assert outs[0] == plain
    assert outs[1] == [42] * 16 and outs[2] == [43] * 16
    assert outs[3] != [first]
    toks, last = collect(eng.add_request(stop_p, SamplingParams(max_tokens=6, temperature=0.0, min_tokens=4,
                                                                stop_token_ids=[favourite])))
    assert favourite not in toks[:4] and last.finished


def test_a_stream_ends_with_usage_counts(device, llama_engine):
    toks, last = collect(llama_engine.add_request([5, 6, 7, 8], greedy(6)))
    assert len(toks) == 6 and last.num_output_tokens == 6 and last.num_prompt_tokens == 4


def test_overlap_scheduling_gives_the_replies_of_a_synchronous_engine(device, ckpts):
    """Overlap scheduling (on by default on CUDA: decode graphs read the previous step's tokens on the device) against
    the same engine without it: greedy and seeded replies, stop token ids the host learns one step late, max_tokens
    ending others; the same tokens and finish reasons."""
    from core.sampling import SamplingParams

    path = ckpts["llama"]
    replies = {}
    for overlap in ("off", "on"):
        eng = make_engine(path, device, overlap=overlap)
        try:
            assert eng.overlap is (overlap == "on")
            prompts = random_prompts([5, 40, 12, 77, 3, 20], eng.bundle.vocab_limit, seed=23)
            free = run_all(_submit_together(eng, prompts, [greedy(12)] * len(prompts)))
            params = [greedy(7)] + [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[o[i]])
                                    for i, o in enumerate(free[1:4])]
            params += [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True),
                       SamplingParams(max_tokens=9, temperature=0.7, top_k=30, seed=5, ignore_eos=True)]
            streams = _submit_together(eng, prompts, params)
            replies[overlap] = [collect(s) for s in streams]
        finally:
            eng.shutdown()
        free_device_memory()
    got = [(toks, last.finish_reason) for toks, last in replies["on"]]
    assert got == [(toks, last.finish_reason) for toks, last in replies["off"]]
    assert [len(t) for t, _ in got][0] == 7 and all(last.error is None for _, last in replies["on"])


def test_a_hung_step_fails_its_requests_and_the_worker_that_wakes_later_frees_the_device(device, ckpts):
    """The engine's watchdog on the GPU: a step hung past step_timeout_s ends every stream as unavailable and the
    engine counts as dead; the worker that returns from the hang later finds the engine stopped and releases its
    graphs and cache (the next engine starts on a clean device)."""
    from core.messages import ErrorKind
    from core.sampling import SamplingParams

    eng = make_engine(ckpts["llama"], device, step_timeout_s=2.0)
    try:
        eng.inject_fault(hang_s=6.0)  # the next step: the first of these requests
        prompts = random_prompts([5, 40, 12], eng.bundle.vocab_limit, seed=31)
        streams = _submit_together(eng, prompts, [SamplingParams(max_tokens=50, temperature=0.0)] * 3)
        ends = [collect(s)[1] for s in streams]
        assert all(e.finish_reason == "error" and e.error_kind is ErrorKind.UNAVAILABLE for e in ends)
        assert not eng.is_alive() and "hung" in eng.dead_reason()
    finally:
        eng.shutdown(timeout=30)  # waits for the worker to wake from the hang and release the device
    assert not eng._thread.is_alive()
    free_device_memory()
    eng = make_engine(ckpts["llama"], device)
    try:
        toks, last = collect(eng.add_request([1, 2, 3], greedy(5)))
        assert len(toks) == 5 and last.error is None
    finally:
        eng.shutdown()
    free_device_memory()


def test_dummy_weights_on_the_device_and_a_policy_changed_in_place(device, ckpts, tmp_path):
    """`load_format=dummy` builds the config's random weights on the GPU (none read) and serves them, the same
    tokens twice (seeded); `reconfigure` swaps in scorpio once idle, with the device's defaults for its policy
    (kairos's VBS margin 1.0 on a GPU, scorpio's published 1.3), and the replies stay the same."""
    import shutil
    import time

    from core.sampling import SamplingParams

    for f in Path(ckpts["llama"]).iterdir():
        if f.suffix not in (".safetensors", ".bin"):
            shutil.copy2(f, tmp_path / f.name)
    prompts = random_prompts([7, 33], 200, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for _ in range(2):
        eng = make_engine(str(tmp_path), device, load_format="dummy", policy="kairos")
        try:
            assert all(p.device.type == device for p in eng.bundle.model.parameters())
            assert eng.scheduler.flags.vbs_margin == (1.0 if device == "cuda" else 1.05)
            outs.append([collect(eng.add_request(p, params))[0] for p in prompts])
            eng.reconfigure({"policy": "scorpio"})
            deadline = time.monotonic() + 10
            while eng.stats().policy != "scorpio" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert eng.stats().policy == "scorpio" and eng.scheduler.flags.vbs_margin == 1.3
            assert [collect(eng.add_request(p, params))[0] for p in prompts] == outs[-1]
        finally:
            eng.shutdown()
            del eng
            free_device_memory()
    assert outs[0] == outs[1]
