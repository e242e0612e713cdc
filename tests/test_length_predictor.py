"""Reply lengths learned from prompts (scheduling/length_predictor.py), where the scheduler plans with them, and the
benchmark's length arms (hidden / predicted / exact) with their benchmark-only stop."""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from bench import length_training as LT
from bench import workload as W
from core.request import SLO, FinishReason, Request
from core.sampling import SamplingParams
from scheduling import length_predictor as LP
from scheduling.config import SchedulerConfig
from scheduling.predictor import LatencyModel
from scheduling.scheduler import TPOT_UNATTAINABLE, Scheduler

TIERS = (W.Tier("interactive", 100.0, 50.0), W.Tier("strict_tpot", 600.0, 30.0), W.Tier("relaxed", 3000.0, 50.0))


# --------------------------------------------------------------------------- the predictor

def test_shipped_predictor_loads_without_download_and_reports_its_held_out_figures():
    assert LP.DEFAULT_PATH.is_file() and LP.DEFAULT_PATH.stat().st_size < 4_000_000
    m = LP.LengthPredictor.load()
    h = m.meta["heldout"]
    assert h["n"] >= 1000 and 0.0 < h["bucket_accuracy"] <= 1.0
    assert h["spearman"] > h["spearman_prompt_len_only"]  # the prompt's words say more than its length
    assert h["log_loss"] < math.log(len(LP.EDGES) + 1)  # calibrated: better than knowing nothing
    assert m.meta["n_train"] > m.meta["n_train_first_turns"] and 0 < m.meta["bag_pool"] <= 1
    assert m.meta["tokenizer"] == "kairos-tiny" and m.meta["edges"] == list(LP.EDGES)
    assert m.table is not None and m.table.key.size == m.meta["vocab_size"] and m.meta["word_features"]
    assert m.W.shape == (m.meta["dim"], len(LP.EDGES) + 1)
    p = m.probs([5, 6, 7, 8])
    assert p.shape == (len(LP.EDGES) + 1,) and p.sum() == pytest.approx(1.0)
    a = m.predict([5, 6, 7, 8])
    assert isinstance(a, int) and LP.LEN_LO <= a <= LP.LEN_HI and a == m.predict([5, 6, 7, 8])
    assert m.predict([5, 6, 7, 8], q=0.1) <= m.predict([5, 6, 7, 8], q=0.5) <= m.predict([5, 6, 7, 8], q=0.9)
    assert isinstance(m.predict([]), int)  # no ids at all still predicts


def test_features_are_hashed_into_the_table_and_depend_on_order():
    bag, fixed = LP.features([10, 11, 12])
    assert len(bag) == 3 + 2 and len(fixed) == 3 + 1
    assert bag.min() >= 0 and bag.max() < LP.DIM and fixed.max() < LP.DIM
    assert not np.array_equal(LP.features([11, 10, 12])[0], bag)  # bigrams and head positions see order


def test_words_are_keyed_by_their_text_lowercased_without_the_space_marker():
    toks = ["\u0120write", "W", "rit", "e", "\u0120w", "\u0120the", ",", "\u0120essay", "\u010a", "\u2581Write",
            "<|im_start|>", "<0x0A>"]
    t = LP.WordTable.of_tokens(toks)
    assert t.opens.tolist() == [True, False, False, False, True, True, True, True, True, True, True, True]

    def words(ids):
        return t.words(np.asarray(ids, np.int64)).tolist()
    assert words([1, 2, 3]) == words([4, 2, 3]) == words([0]) == words([9])  # "W|rit|e" = " w|rit|e" = " write"
    assert words([1, 2, 3, 5]) != words([5, 1, 2, 3])  # words in another order
    assert words([4, 2, 3, 5, 6, 7]) == words([0]) + words([5]) + words([6]) + words([7])  # ","  is a word
    assert words([4, 3, 2]) != words([4, 2, 3])  # a word's tokens in another order
    assert words([1, 2]) != words([1, 2, 3]) and words([2]) != words([3])
    assert len(words([2, 3, 99, 7, -1])) == 4  # ids past the table: words of their own; the first id opens a word
    bag, fixed = LP.features([1, 2, 3, 5], t)
    assert len(bag) == (4 + 3) + (2 + 1) and len(fixed) == 4 + 1  # token and word unigrams and bigrams
    assert LP.features([1, 2, 3, 5])[0].tolist() == bag[:7].tolist()  # the token features without a table
    small = LP.features([1, 2, 3, 5], t, dim=64)
    assert small[0].max() < 64 and small[1].max() < 64


def test_a_long_prompt_is_read_at_its_head_and_tail_with_its_whole_length():
    """Past READ_MAX tokens the features are the head's and the tail's (a bounded cost on the step loop for a long
    context), and the length features still count the whole prompt."""
    rng = np.random.default_rng(0)
    n = LP.READ_MAX + 3000
    a = rng.integers(0, 5000, n)
    b = a.copy()
    mid = slice(LP.READ_MAX // 2 + 10, n - LP.READ_MAX // 2 - 10)
    b[mid] = a[mid][::-1]  # its middle reversed: the same head, tail and length (in tokens, words and bytes)
    table = LP.WordTable.of_tokens([f"\u0120w{i}" if i % 3 else f"x{i}" for i in range(5000)])
    for kw in ({}, {"table": table}, {"table": table, "words_only": True}):
        fa, fb = LP.features(a, **kw), LP.features(b, **kw)
        assert fa[0].tolist() == fb[0].tolist() and fa[1].tolist() == fb[1].tolist()
        assert LP.features(a[:LP.READ_MAX + 1], **kw)[1].tolist() != fa[1].tolist()  # shorter: another length
    short = a[:100]
    assert LP.features(short)[0].size == 2 * 100 - 1  # under READ_MAX: every token


def test_save_load_round_trip_and_layout_check(tmp_path):
    K = len(LP.EDGES) + 1
    W_ = np.zeros((LP.DIM, K), np.float32)
    bias = np.zeros(K, np.float32)
    bias[3] = 5.0  # every prompt: bucket 3
    m = LP.LengthPredictor(W_, bias, {"edges": list(LP.EDGES), "x": 1})
    m.save(tmp_path / "m.npz")
    back = LP.LengthPredictor.load(tmp_path / "m.npz")
    assert back.meta["x"] == 1 and int(np.argmax(back.probs([1, 2]))) == 3
    assert LP.EDGES[2] <= back.predict([1, 2]) <= LP.EDGES[3]
    np.savez(tmp_path / "bad.npz", W=np.zeros((8, K), np.float16), bias=bias, meta=np.array(json.dumps({})))
    with pytest.raises(ValueError):
        LP.LengthPredictor.load(tmp_path / "bad.npz")
    # a small table with word features: stored in int8 steps of each bucket column, with the tokenizer's words
    rng = np.random.default_rng(0)
    W_ = rng.normal(0, 0.3, (1024, K)).astype(np.float32)
    t = LP.WordTable.of_tokens(["\u0120a", "b", "\u0120c", "."])
    m = LP.LengthPredictor(W_, bias, {"edges": list(LP.EDGES), "dim": 1024}, t)
    m.save(tmp_path / "w.npz")
    back = LP.LengthPredictor.load(tmp_path / "w.npz")
    assert np.abs(back.W - W_).max() <= np.abs(W_).max(axis=0).max() / 254 + 1e-6
    assert np.array_equal(back.W, m.quantized().W) and np.array_equal(back.table.key, t.key)
    assert np.array_equal(back.table.opens, t.opens)
    assert back.probs([0, 1, 2, 3]) == pytest.approx(m.probs([0, 1, 2, 3]), abs=0.02)


def test_bag_pooling_scales_the_bag_by_its_size_to_the_meta_power():
    K = len(LP.EDGES) + 1
    ids = [10, 11, 12, 13]
    bag, fixed = LP.features(ids)
    W_ = np.zeros((LP.DIM, K), np.float32)
    W_[bag, 5] = 1.0  # every n-gram votes for bucket 5
    W_[fixed] = 0.0
    z = {}
    for pool in (1.0, 0.5, 0.0):
        p = LP.LengthPredictor(W_, np.zeros(K, np.float32), {"edges": list(LP.EDGES), "bag_pool": pool}).probs(ids)
        z[pool] = math.log(p[5] / p[0])
    assert z[1.0] == pytest.approx(1.0, rel=1e-5) and z[0.5] == pytest.approx(len(bag) ** 0.5, rel=1e-5)
    assert z[0.0] == pytest.approx(len(bag), rel=1e-5)
    old = LP.LengthPredictor(W_, np.zeros(K, np.float32), {"edges": list(LP.EDGES)})  # a file without bag_pool
    assert math.log(old.probs(ids)[5] / old.probs(ids)[0]) == pytest.approx(1.0, rel=1e-5)  # a mean, as before


def test_training_rows_keep_the_held_out_prompts_and_their_conversations_out(monkeypatch):
    """Held out: first turns of the first HOLDOUT conversations of bench.workload's seed-0 order. Training: every
    turn pair of the others, later turns too, unless its prompt text is a held-out prompt's."""
    def conv(*turns):
        return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    records = [{"id": f"c{i}_0", "conversations": conv(f"ask {w} one two", "reply " * (5 + i),
                                                        f"more {w} three four", "again " * 6)}
               for i, w in enumerate(words)]
    records += [{"id": f"c{i}_1", "conversations": conv(f"ask {w} one two", "copy " * 9)}  # the same prompts again
                for i, w in enumerate(words)]
    records.append({"id": "x_0", "conversations": [{"from": "gpt", "value": "no human first"}]})
    vocab: dict[str, int] = {}

    class Tok:
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[vocab.setdefault(w, len(vocab)) for w in t.split()] for t in texts]}

    def text(ids):
        back = {v: k for k, v in vocab.items()}
        return " ".join(back[i] for i in ids)

    monkeypatch.setattr(W, "read_conversations", lambda path=None: tuple(records))
    monkeypatch.setattr(LT, "HOLDOUT", 4)
    rows = LT.sharegpt_rows(Tok())
    firsts = records[:-1]  # every record but the last opens with a human turn (W.first_turns' records)
    assert len(W.first_turns(records)) == len(firsts)
    held_recs = [firsts[k] for k in W.sample_order(len(firsts), 0)[:4]]
    held_texts = [r["conversations"][0]["value"] for r in held_recs]
    assert [text(x) for x, h in zip(rows.ids, rows.held) if h] == held_texts  # in the benchmark's order
    assert rows.held[:4].all() and not rows.held[4:].any() and rows.first[:4].all()
    want = sorted((c[t]["value"], t == 0, r["id"].rsplit("_", 1)[0]) for r in firsts if r not in held_recs
                  for t, c in ((t, r["conversations"]) for t in (0, 2)) if t < len(c)
                  and c[t]["value"] not in held_texts)
    got = sorted((text(x), bool(f), g) for x, f, g, h in zip(rows.ids, rows.first, rows.group, rows.held) if not h)
    assert got == want and any(not f for _, f, _ in got)  # later turns are in
    assert any(r not in held_recs and r["conversations"][0]["value"] in held_texts for r in firsts)  # some left out


def test_training_learns_which_prompts_get_long_replies_and_calibrates_a_temperature():
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    ids, lens = [], []
    for i in range(400):
        long = i % 2 == 0
        ids.append([7 if long else 8] + [int(t) for t in rng.integers(100, 110, size=8)])
        lens.append(float(rng.integers(600, 760) if long else rng.integers(20, 30)))
    lens = np.asarray(lens)
    cfg = LT.TrainConfig(max_epochs=4, lr=0.05, dropout=0.1, batch=16)
    W_, b, hist = LT.train(ids[:300], lens[:300], cfg=cfg, val=(ids[300:], lens[300:]))
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4]
    m = LP.LengthPredictor(W_, b, {"edges": list(LP.EDGES), "bag_pool": cfg.bag_pool})
    fig = LT.evaluate(m, ids[300:], lens[300:])
    assert fig["bucket_accuracy"] > 0.9 and fig["spearman"] > 0.6  # (ties within a class cap the rank correlation)
    assert fig["spearman"] == pytest.approx(max(h["spearman"] for h in hist))  # the best epoch's weights
    assert 0.5 <= LT.fit_temperature(m, ids[300:], lens[300:]) <= 4.0


def test_spearman_and_buckets():
    assert LP.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert LP.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert LP.spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(0.894, abs=1e-3)  # ties: average ranks
    assert math.isnan(LP.spearman([1, 1], [1, 2]))
    assert [LP.bucket_of(n) for n in (4, 15, 16, 1023, 1024, 5000)] == [0, 0, 1, 9, 10, 10]


# --------------------------------------------------------------------------- the scheduler's expected length

def _req(rid, n=10, max_tokens=900, hint=None, tpot=None, predicted=None):
    r = Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), SLO(tpot_ms=tpot,
                                                                                        output_len_hint=hint))
    r.predicted_len = predicted
    return r


def test_expected_length_is_the_hint_else_the_prediction_capped_else_max_tokens():
    assert _req("a").expected_output_len == 900
    assert _req("b", hint=40, predicted=300).expected_output_len == 40
    assert _req("c", predicted=300).expected_output_len == 300
    assert _req("d", max_tokens=100, predicted=300).expected_output_len == 100
    r = _req("e", predicted=2)
    r.token_ids += [7, 7, 7]  # outlived its prediction: at least one more token
    assert r.expected_output_len == 4
    r.bench_stop_after = 5  # the benchmark-only stop is not an expectation
    assert r.expected_output_len == 4


def test_a_hint_is_at_least_min_tokens_and_the_tokens_out_and_a_reply_only_its_cap_ends_is_that_long():
    r = Request("h", [1] * 4, SamplingParams(max_tokens=100, min_tokens=30), SLO(tpot_ms=50, output_len_hint=10))
    assert r.expected_output_len == 30
    r.token_ids += [7] * 40  # outlived the hint: at least one more token
    assert r.expected_output_len == 41 and r.gate_output_len == 41
    capped = Request("c", [1] * 4, SamplingParams(max_tokens=2000, ignore_eos=True),
                     SLO(tpot_ms=50, output_len_hint=10))
    assert capped.params.runs_to_cap and capped.expected_output_len == capped.gate_output_len == 2000


def _outlook(m, r, window=1024):
    """The outlook the scheduler plans `r` with: the predictor's, of min(length, its cap) (max_tokens, the window)."""
    return m.outlook(r.prompt_token_ids, min(r.params.max_tokens, window - len(r.prompt_token_ids)))


def _sched(policy="scorpio", **kw):
    model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.0, 0.01, 5.0))  # itl = 5 + 0.01 L
    return Scheduler(SchedulerConfig(policy=policy, **kw), 512, 4, max_model_len=1024, predictor=model)


def test_the_predictor_sets_predicted_len_at_admission_only_when_on_and_unhinted():
    on, off = _sched(length_predictor=True), _sched(length_predictor=False)
    a, b, c = _req("a"), _req("b"), _req("c", hint=50)
    on.add(a)
    off.add(b)
    on.add(c)
    m = LP.load_cached(None)
    assert a.predicted_len == round(_outlook(m, a)[0]) and b.predicted_len is None
    assert a.length_outlook == _outlook(m, a) and a.gate_len is None  # scorpio: the mean throughout
    assert c.predicted_len is None and c.expected_output_len == 50
    assert SchedulerConfig(policy="fcfs").flags().length_predictor is False
    assert SchedulerConfig(policy="fcfs", length_predictor=True).flags().length_predictor is True


def test_a_reply_only_its_cap_ends_is_planned_for_its_cap_not_predicted():
    """ignore_eos with no stop strings or stop ids, or min_tokens = max_tokens: the reply is max_tokens long, which the
    scheduler plans for instead of a prediction (ignore_eos_length, on by default); a stop string or stop id may end
    an ignore_eos reply sooner, so those are predicted, and so is every request where the knob is off (a benchmark
    that ends forced replies itself)."""
    def req(rid, **params):
        return Request(rid, list(range(3, 13)), SamplingParams(max_tokens=700, **params), SLO(tpot_ms=50.0))

    s = _sched(length_predictor=True)
    assert s.config.ignore_eos_length and s.lengths is not None
    forced, stopped, by_id, plain = (req("f", ignore_eos=True), req("s", ignore_eos=True, stop=["\n\n"]),
                                     req("i", ignore_eos=True, stop_token_ids=[5]), req("p"))
    floor, short_floor = req("m", min_tokens=700, stop=["\n\n"]), req("n", min_tokens=699)
    for r in (forced, stopped, by_id, plain, floor, short_floor):
        s.add(r)
    for r in (forced, floor):
        assert r.params.runs_to_cap and r.predicted_len is None and r.length_outlook is None
        assert r.expected_output_len == r.gate_output_len == 700
    forced.token_ids += [7] * 300
    assert forced.expected_output_len == 700
    m = LP.load_cached(None)
    for r in (stopped, by_id, plain):
        assert not r.params.runs_to_cap and r.predicted_len == round(_outlook(m, r)[0])
    assert not short_floor.params.runs_to_cap  # predicted, above its min_tokens
    assert short_floor.predicted_len == round(LP.outlook_at(_outlook(m, short_floor), 699))
    off = _sched(length_predictor=True, ignore_eos_length=False)
    again = req("g", ignore_eos=True)
    off.add(again)
    assert again.predicted_len == round(_outlook(m, again)[0])


def test_a_reply_of_at_least_min_tokens_is_planned_for_the_distribution_above_them():
    """min_tokens under max_tokens (EOS may end the reply after them): the expected length is the predicted mean
    above min_tokens, from admission until the reply outgrows them; after that, as without them."""
    from core.request import outlook_at, outlook_from

    s = _sched(length_predictor=True)
    plain = Request("p", list(range(3, 13)), SamplingParams(max_tokens=900), SLO(tpot_ms=50.0))
    floored = Request("f", list(range(3, 13)), SamplingParams(max_tokens=900, min_tokens=500), SLO(tpot_ms=50.0))
    for r in (plain, floored):
        s.add(r)
    base = _outlook(LP.load_cached(None), plain)
    assert plain.length_outlook == base and plain.predicted_len < 500
    assert floored.length_outlook == outlook_from(base, 500)
    assert floored.predicted_len == round(outlook_at(base, 500)) > 500
    assert floored.expected_output_len == floored.predicted_len
    for k in (10, 200, 499):
        floored.token_ids = floored.prompt_token_ids + [7] * k
        assert floored.expected_output_len == int(outlook_at(base, 500))
    floored.token_ids = floored.prompt_token_ids + [7] * 600
    plain.token_ids = plain.prompt_token_ids + [7] * 600
    assert floored.expected_output_len == plain.expected_output_len == min(900, int(outlook_at(base, 600)))
    assert outlook_from(base, 0) is base
    q = _sched(length_predictor=True, length_predictor_quantile=0.5)
    low = Request("q", list(range(3, 13)), SamplingParams(max_tokens=900, min_tokens=700), SLO(tpot_ms=50.0))
    q.add(low)
    assert low.predicted_len >= 700


def test_a_prediction_that_fails_leaves_the_request_planning_for_its_cap():
    """The prediction never raises (on the worker a raise would end the engine's loop): a request the predictor fails
    on is queued with no prediction, and the next request is predicted as usual."""
    s = _sched("kairos", length_predictor=True)
    good = s.lengths

    class Broken:
        scale = 1.0

        def probs(self, ids):
            raise IndexError("odd prompt")

    s.lengths = Broken()
    bad = _req("bad")
    assert s.add(bad) is None and bad in s.waiting
    assert bad.predicted_len is None and bad.length_outlook is None and bad.expected_output_len == 900
    s.lengths = good
    ok = _req("ok")
    s.add(ok)
    assert ok.predicted_len is not None


def test_the_expected_length_follows_each_of_its_inputs():
    """expected_output_len is kept between steps, and recomputed when a token comes, a prediction is set, or the
    outlook is replaced."""
    r = _req("a", n=10, max_tokens=900)
    assert r.expected_output_len == 900
    r.predicted_len = 40
    assert r.expected_output_len == 40
    r.token_ids += [5] * 45  # past the prediction, no outlook: one more token than out
    assert r.expected_output_len == 46
    r.length_outlook = tuple(100.0 + i for i in range(60))
    assert r.expected_output_len == int(LP.outlook_at(r.length_outlook, 45))
    r.token_ids.append(5)
    assert r.expected_output_len == int(LP.outlook_at(r.length_outlook, 46))


@pytest.mark.parametrize("cap", [3000, 700])
def test_the_expected_length_token_by_token_is_the_outlook_at_each_length(cap):
    """Between two grid lengths a reply keeps its outlook entry (the kept answer is carried forward a token at a
    time): token by token the expected length is `outlook_at` at every length, past the prediction and the cap."""
    K = len(LP.EDGES) + 1
    p = np.zeros(K)
    p[2], p[8] = 0.5, 0.5
    r = _req("t", n=10, max_tokens=cap)
    r.length_outlook = LP.conditional_means(p)
    r.predicted_len = int(r.length_outlook[0])
    assert r.expected_output_len == min(r.predicted_len, cap)
    for k in range(1, 2600):
        r.token_ids.append(5)
        assert r.expected_output_len == min(int(LP.outlook_at(r.length_outlook, k)), cap), k
    r.length_outlook = LP.conditional_means(p[::-1].copy())  # a new outlook: read afresh
    assert r.expected_output_len == min(int(LP.outlook_at(r.length_outlook, 2599)), cap)


def test_outlook_is_the_mean_above_the_tokens_out_and_grows_as_a_reply_outlives_it():
    K = len(LP.EDGES) + 1
    p = np.zeros(K)
    p[2], p[8] = 0.5, 0.5  # 32..64 or 512..768
    o = LP.conditional_means(p)
    assert len(o) == len(LP.OUTLOOK_GRID) and o[0] == pytest.approx(0.5 * (64 - 32) / math.log(2)
                                                                      + 0.5 * (768 - 512) / math.log(1.5), rel=1e-6)
    assert LP.outlook_at(o, 0) == o[0]
    assert LP.outlook_at(o, 100) > 512  # past the short bucket: only the long one is left
    assert all(b >= a - 1e-9 for a, b in zip(o, o[1:]))  # never shrinks as the reply runs
    assert LP.outlook_at(o, 5000) == 5001  # past every bucket: one more token
    assert LP.quantile(p, 0.25) < 64 < 512 <= LP.quantile(p, 0.75)


def test_outlook_within_a_cap_is_the_mean_of_the_reply_the_cap_may_cut():
    """With a cap (max_tokens) every entry is E[min(length, cap) | length > t], each bucket log-uniform: at most
    min(E[length | length > t], cap), less wherever the distribution reaches past the cap; a cap beyond every bucket
    changes nothing. Checked against the same mixture sampled."""
    K = len(LP.EDGES) + 1
    p = np.zeros(K)
    p[2], p[8] = 0.5, 0.5  # 32..64 or 512..768
    rng = np.random.default_rng(0)
    lo, hi = np.array((LP.LEN_LO, *LP.EDGES), float), np.array((*LP.EDGES, LP.LEN_HI), float)
    k = rng.choice(K, size=400_000, p=p)
    x = np.exp(np.log(lo[k]) + rng.random(k.size) * np.log(hi[k] / lo[k]))
    free = LP.conditional_means(p)
    assert LP.conditional_means(p, cap=5000) == free
    for scale, cap in ((1.0, 600), (1.0, 40), (2.0, 600)):
        o = LP.conditional_means(p, scale, cap)
        for i in (0, 20, 35, 45):
            t = LP.OUTLOOK_GRID[i]
            if t >= cap:
                continue
            sampled = np.minimum(scale * x[scale * x > t], cap).mean()
            assert o[i] == pytest.approx(sampled, rel=0.01), (scale, cap, i)
            assert o[i] <= min(LP.conditional_means(p, scale)[i], cap) + 1e-9
    assert LP.conditional_means(p, cap=600)[0] < 0.5 * (64 - 32) / math.log(2) + 0.5 * 600  # the long half cut

def test_expected_length_follows_the_outlook_and_the_gate_plans_for_its_own_length():
    r = _req("o", max_tokens=600, predicted=100)
    r.length_outlook = tuple([100.0] * 10 + [400.0] * (len(LP.OUTLOOK_GRID) - 10))
    assert r.expected_output_len == 100 and r.gate_output_len == 100
    r.token_ids += [7] * 120
    assert r.expected_output_len == 400  # outlived the mean: the distribution's mean above 120
    r.gate_len = 500
    assert r.gate_output_len == 500 and r.expected_output_len == 400
    r.gate_len = 5000
    assert r.gate_output_len == 600  # capped by max_tokens
    h = _req("h", hint=40, predicted=300)
    h.gate_len = 500
    assert h.gate_output_len == 40  # a hint wins everywhere


def test_a_gate_quantile_plans_admission_for_a_conservative_length():
    k, s = _sched("kairos", length_predictor=True, length_gate_quantile=0.8), _sched("scorpio", length_predictor=True)
    a, b = _req("a"), _req("b")
    k.add(a)
    s.add(b)
    m = LP.load_cached(None)
    p = m.probs(a.prompt_token_ids)
    assert a.predicted_len == b.predicted_len and b.gate_len is None
    assert a.gate_len == max(a.predicted_len, LP.quantile(p, 0.8)) and a.gate_output_len >= a.expected_output_len
    z = _sched("kairos", length_predictor=True)  # the preset's gate plans for the mean, as everything else
    c = _req("c")
    z.add(c)
    assert c.gate_len is None


def test_kairos_ranks_by_work_only_with_length_information():
    """short_first and work shedding (kairos's preset) rank requests by expected work: on with an active predictor,
    off without one (work would be max_tokens / TPOT, a ranking by tier) unless the config sets them."""
    on, off = _sched("kairos", length_predictor=True), _sched("kairos", length_predictor=False)
    assert on.flags.short_first and on.flags.work_shedding and on.shedder is not None
    assert not off.flags.short_first and not off.flags.work_shedding and off.shedder is None
    forced = _sched("kairos", length_predictor=False, short_first=True)
    assert forced.flags.short_first and not forced.flags.work_shedding
    assert not _sched("scorpio", length_predictor=True).flags.short_first


def test_the_vbs_gate_plans_for_the_prediction_instead_of_the_cap():
    """A strict reply with a cap of 900 tokens: planned at the cap (context 10 + 450), one step's ITL * 1.3 is
    over its TPOT; planned at a short predicted length it fits."""
    for predicted, admitted in ((None, False), (40, True)):
        s = _sched()
        r = _req("r", tpot=10.0, predicted=predicted)
        s.add(r)
        p = s.schedule(0.0)
        assert (p.prefill == [r]) is admitted
        assert (p.rejected == [(r, TPOT_UNATTAINABLE)]) is not admitted


def test_a_finished_request_carries_the_length_predicted_at_its_arrival():
    """The engine's final item says what the scheduler planned the reply's length at from its length predictor at
    the request's arrival: the prediction within max_tokens (the replica's `kairos_length_prediction_ratio` and the
    usage's `kairos_metrics` read it); nothing where a hint gave the length."""
    from engine.config import EngineConfig
    from engine.default_model import ensure_default_model
    from engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=str(ensure_default_model("kairos-tiny")), dtype="float32", device="cpu",
                                 scheduler=SchedulerConfig(policy="kairos")))
    try:
        prompt = list(range(40, 90))
        predicted = round(LP.load_cached(None).outlook(prompt, 900)[0])  # E[min(length, max_tokens)]
        assert 6 < predicted < 900
        finals = []
        for cap, hint in ((900, None), (6, None), (900, 5)):
            stream = eng.add_request(prompt, SamplingParams(max_tokens=cap, temperature=0.0),
                                     SLO(ttft_ms=60_000, tpot_ms=1_000, output_len_hint=hint))
            out = stream.get(timeout=60)
            eng.abort(stream.request_id)  # (its final item says it as one that ran to its end does)
            while not out.finished:
                out = stream.get(timeout=60)
            finals.append(out)
        assert [f.metrics.predicted_output_len for f in finals] == [predicted, 6, None]
    finally:
        eng.shutdown()


def test_bench_stop_ends_a_reply_only_where_the_engine_was_started_for_the_benchmark():
    for bench_stop, ends_at in ((True, 3), (False, 8)):
        s = _sched("fcfs", bench_stop=bench_stop)
        r = _req("r", max_tokens=8)
        r.bench_stop_after = 3
        s.add(r)
        for step in range(10):
            plan = s.schedule(0.0)
            (_, _, reason), = s.postprocess(plan, [5], float(step))
            if reason is not None:
                break
        assert reason is FinishReason.LENGTH and r.num_output_tokens == ends_at


# --------------------------------------------------------------------------- the benchmark's arms

def test_length_arms_offer_the_same_requests_and_hide_only_the_length():
    spec = W.WorkloadSpec(num_requests=40, rate_rps=2.0, seed=3, max_model_len=800)
    exact = W.generate(spec, TIERS)
    hidden = W.generate(replace(spec, lengths="hidden"), TIERS)
    capped = W.generate(replace(spec, lengths="predicted", length_cap=64), TIERS)
    capped_exact = W.generate(replace(spec, length_cap=64), TIERS)
    for e, h, c, ce in zip(exact, hidden, capped, capped_exact):
        assert (e.arrival_s, e.prompt_ids, e.tier) == (h.arrival_s, h.prompt_ids, h.tier)
        assert e.stop_after is None and e.output_len == e.max_tokens == e.output_len_hint
        assert h.output_len_hint is None and h.max_tokens == 800 - 1 - len(h.prompt_ids)
        assert h.stop_after == h.output_len == e.max_tokens
        assert c.max_tokens == min(64, 800 - 1 - len(c.prompt_ids)) and c.stop_after == min(e.max_tokens, c.max_tokens)
        # the cap the hidden arms send ends the reply in every arm: the exact arm serves the same replies
        assert ce.max_tokens == ce.output_len_hint == c.output_len and ce.stop_after is None
    assert W.describe(hidden)["output_len"] == W.describe(exact)["output_len"]
    assert W.describe(capped)["output_len"] == W.describe(capped_exact)["output_len"]
    assert any(e.output_len > 64 for e in exact)  # (the cap cut some replies)
    with pytest.raises(ValueError):
        W.generate(replace(spec, lengths="oracle"), TIERS)


def test_policy_labels_carry_their_length_arm():
    from bench.slo import arm_sched, length_arm, policy_spec

    assert policy_spec("kairos+lengths=exact+vbs_margin=1.2") == ("kairos", {"vbs_margin": 1.2})
    assert length_arm("kairos+lengths=exact", "hidden") == "exact" and length_arm("kairos", "predicted") == "predicted"
    with pytest.raises(SystemExit):
        length_arm("kairos+lengths=oracle", "hidden")
    assert arm_sched("predicted") == {"length_predictor": True, "bench_stop": True, "ignore_eos_length": False}
    assert arm_sched("hidden")["length_predictor"] is False and arm_sched("exact")["length_predictor"] is True
    assert arm_sched("hidden")["ignore_eos_length"] is False and arm_sched("exact")["ignore_eos_length"] is True


def _sse_stub(chunks, seen: list, delay_s: float = 0.0):
    """An aiohttp handler that records each request (its JSON body and headers in `seen`) and streams `chunks(body)`
    as SSE events, `delay_s` apart, until the client hangs up."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((body, dict(request.headers)))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for chunk in chunks(body):
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if delay_s:
                    await asyncio.sleep(delay_s)
        except (ConnectionResetError, RuntimeError):
            pass
        return resp

    return handler


def test_http_client_stops_a_hidden_length_reply_itself():
    """Over HTTP the benchmark-only stop is the client's: it closes the stream after `stop_after` tokens and counts
    the reply complete; the server never sees the length (no hint header, max_tokens the cap)."""
    from bench.driver import run_http
    from tests.stub_http import stub_server

    seen: list = []
    one_a_chunk = _sse_stub(lambda body: ({"choices": [{"text": "x", "finish_reason": None}]}
                                          for _ in range(body["max_tokens"])), seen)
    item = W.WorkItem(0.0, [5, 6, 7], 50, "relaxed", 3000.0, 500.0, None, stop_after=4)
    with stub_server(one_a_chunk) as url:
        run = run_http(url, [item], model="m", drain_s=5.0)
    rec = run.records[0]
    assert rec.finish_reason == "length" and rec.n_out == 4 and rec.output_len == 4 and rec.max_tokens == 50
    assert seen[0][0]["max_tokens"] == 50 and "x-slo-output-len" not in {k.lower() for k in seen[0][1]}


def test_http_client_counts_the_tokens_of_merged_chunks_toward_the_stop():
    """A replica behind its client merges tokens into one chunk: the client asks for vLLM's continuous usage and
    counts tokens by it, so the reply ends at its `stop_after`-th token (not chunk), and its TPOT spans that many."""
    from bench.driver import run_http
    from bench.metrics import tpot_s
    from tests.stub_http import stub_server

    def merged(body):  # the first token alone, then chunks of three, each with the usage so far
        sent = 0
        for k in (1, 3, 3, 3, 3, 3):
            sent += k
            yield {"choices": [{"text": "x" * k, "finish_reason": None}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": sent, "total_tokens": 3 + sent}}

    seen: list = []
    item = W.WorkItem(0.0, [5, 6, 7], 50, "relaxed", 3000.0, 500.0, None, stop_after=8)
    with stub_server(_sse_stub(merged, seen, delay_s=0.05)) as url:
        run = run_http(url, [item], model="m", drain_s=5.0)
    rec = run.records[0]
    assert rec.scheduled_s == pytest.approx(run.started_s) and rec.arrival_s >= rec.scheduled_s  # (due at 0.0)
    assert seen[0][0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert rec.finish_reason == "length" and rec.n_out == 8 and len(rec.token_times) == 8
    assert rec.deliveries == 4 and rec.merged_deliveries == 3  # (1), (3), (3), (3: the 8th token in it)
    # its 8 tokens came in 4 chunks (each merged token at its chunk's time), and its TPOT spans its 7 later tokens,
    # the three chunks 50 ms apart
    assert len(set(rec.token_times)) == 4 and rec.token_times == sorted(rec.token_times)
    # (the three gaps are the server's 50 ms sleeps as the client reads them: a chunk held in a buffer comes with the
    # next, so a gap may read shorter; their sum is well above none)
    assert tpot_s(rec) == pytest.approx((rec.token_times[-1] - rec.token_times[0]) / 7) and tpot_s(rec) >= 0.1 / 7


def test_bound_reads_the_reply_length_not_the_cap(tmp_path):
    from bench.bound import bounds

    recs = [{"load_multiple": 1.5, "seed": 0, "policy": "kairos", "warmup": False, "good": True, "rejected": False,
             "n_out": n, "max_tokens": 500, "output_len": n, "arrival_s": 0.0, "end_s": 1.0} for n in (10, 20, 30)]
    (b,) = bounds(recs)
    assert b["arrival_tokens"] == 60 and b["policies"]["kairos"]["oracle_own_tokens"] == 3


def test_a_policy_turns_the_predictor_on_only_for_the_tokenizer_it_counts_in(tmp_path):
    """kairos's preset turns the predictor on; it takes effect only where the served model's tokenizer is the one the
    predictor was trained in (its fingerprint), unless the config sets it explicitly; the fingerprint is the SHA-256
    of tokenizer.json."""
    m = LP.load_cached(None)
    ours = m.meta["tokenizer_sha256"]
    (tmp_path / "tokenizer.json").write_text("{}")
    other = LP.tokenizer_fingerprint(tmp_path)
    assert other != ours and LP.tokenizer_fingerprint(tmp_path / "missing") is None
    assert LP.tokenizer_fingerprint(None) is None and LP.counts_in(m, ours) and not LP.counts_in(m, None)
    model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.0, 0.01, 5.0))

    def lengths(fingerprint, **kw):
        return Scheduler(SchedulerConfig(policy="kairos", **kw), 512, 4, max_model_len=1024, predictor=model,
                         tokenizer_fingerprint=fingerprint).lengths

    assert SchedulerConfig(policy="kairos").flags().length_predictor is True
    assert lengths(ours) is m and lengths(other) is None and lengths(None) is None
    assert lengths(other, length_predictor=True) is m and lengths(ours, length_predictor=False) is None


def test_selection_gain_is_what_a_ranking_serves_under_half_the_tokens_over_a_random_order():
    from bench.length_training import selection_gain
    lens = np.array([10.0, 20.0, 30.0, 40.0, 100.0, 200.0, 300.0, 400.0])  # 1,100 tokens: a budget of 550
    exact = selection_gain(lens, lens)
    assert exact["predicted"] == exact["exact"] > 1.0  # the true order: 10..200 (400 tokens) + 300 > 550 -> 6
    worst = selection_gain(-lens, lens)  # longest first: 400 alone
    assert worst["predicted"] < 1.0 < worst["exact"]


def test_a_chat_request_is_predicted_from_its_last_user_message_not_the_template():
    """The predictor was trained on a turn's own text; a chat request's prompt is the conversation in the chat
    template, so the input processor hands the scheduler the last user message's ids to predict from."""
    from transformers import AutoTokenizer

    from core.messages import ChatTurn
    from engine.default_model import ensure_default_model
    from engine.inputs import InputProcessor

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model("kairos-tiny")))
    inputs = InputProcessor(tok, len(tok), [0], 1024, 1 << 16)
    question = "Write a detailed essay about the history of the French revolution."
    chat = inputs.process(None, SamplingParams(max_tokens=500), None, "c", messages=[
        ChatTurn("system", "You are terse."), ChatTurn("user", "hi"), ChatTurn("assistant", "hello"),
        ChatTurn("user", question)])
    plain = inputs.process(question, SamplingParams(max_tokens=500), None, "p")
    assert chat.question_ids == plain.prompt_token_ids != chat.prompt_token_ids and plain.question_ids is None
    s = _sched("kairos", length_predictor=True)
    s.add(chat)
    s.add(plain)
    m = LP.load_cached(None)
    assert chat.length_outlook == plain.length_outlook == m.outlook(plain.prompt_token_ids, 500)
    assert m.outlook(chat.prompt_token_ids, 500) != chat.length_outlook  # the template would have shifted it


# --------------------------------------------------------------------------- a predictor for any served tokenizer

def test_words_only_features_depend_on_the_text_not_on_how_a_tokenizer_splits_it():
    one = LP.WordTable.of_tokens(["\u0120Write", "\u0120an", "\u0120essay", "."])  # " Write an essay."
    two = LP.WordTable.of_tokens(["W", "rite", "\u0120a", "n", "\u0120ess", "ay", ".", "\u0120"])
    a, b = LP.features([0, 1, 2, 3], one, words_only=True), LP.features([0, 1, 2, 3, 4, 5, 6], two, words_only=True)
    assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
    assert one.num_bytes(np.array([0, 1, 2, 3])) == two.num_bytes(np.array([0, 1, 2, 3, 4, 5, 6])) == 13  # no spaces
    assert LP.features([0, 2, 1, 3], one, words_only=True)[0].tolist() != a[0].tolist()  # word bigrams see order


def test_lengths_scale_into_the_served_tokenizers_tokens():
    K = len(LP.EDGES) + 1
    p = np.zeros(K)
    p[3], p[7] = 0.6, 0.4
    base, double = LP.conditional_means(p), LP.conditional_means(p, 2.0)
    assert double[0] == pytest.approx(2 * base[0]) and LP.quantile(p, 0.5, 2.0) in (2 * LP.quantile(p, 0.5) + d
                                                                                      for d in (-1, 0, 1))
    k = 150  # tokens out in the served tokenizer: 75 of the training tokenizer's
    assert LP.outlook_at(double, k) == pytest.approx(2 * LP.outlook_at(base, k // 2), rel=0.08)  # (grid rounding)


def test_the_served_model_gets_a_predictor_in_its_own_tokens():
    """The shipped predictor where the served tokenizer is the one it counts in; on any other model the words-only
    predictor bound to that tokenizer, its lengths scaled by the tokenizers' token counts on the file's reference
    text; none without a tokenizer unless the config asks."""
    from transformers import AutoTokenizer

    from engine.default_model import ensure_default_model

    main, words = LP.load_cached(None), LP.load_cached(str(LP.WORDS_PATH))
    assert words.words_only and not main.words_only and words.meta["reference_tokens"] > 0
    other = words.meta["heldout_other_tokenizer"]
    assert other["spearman"] > other["spearman_prompt_len_only"] and other["n"] == main.meta["heldout"]["n"]
    with pytest.raises(ValueError):
        main.bind(None)
    tiny = AutoTokenizer.from_pretrained(str(ensure_default_model("kairos-tiny")))
    smol = AutoTokenizer.from_pretrained(str(ensure_default_model("kairos-default")))
    ours = main.meta["tokenizer_sha256"]
    assert LP.for_served_model(None, ours, tiny) is main
    bound = LP.for_served_model(None, "another", smol)
    assert bound is not None and bound.words_only and bound.table.key.size == len(smol)
    assert 0.3 < bound.scale < 0.9  # SmolLM2's 49k vocabulary spends fewer tokens on a text than kairos-tiny's 2.5k
    assert LP.for_served_model(None, "another") is None and LP.for_served_model(None, "another", explicit=True) is main
    # a chat request on SmolLM2: predicted from its question, in SmolLM2's tokens
    model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.0, 0.01, 5.0))
    s = Scheduler(SchedulerConfig(policy="kairos"), 512, 4, max_model_len=1024, predictor=model,
                  tokenizer_fingerprint="another", tokenizer=smol)
    assert s.lengths is not None and s.lengths.scale == bound.scale
    r = Request("q", smol("Write a long essay about rivers.", add_special_tokens=False)["input_ids"],
                SamplingParams(max_tokens=900), SLO())
    s.add(r)
    p = words.bind(smol).probs(r.prompt_token_ids)
    assert r.length_outlook == LP.conditional_means(p, bound.scale, 900) and r.predicted_len == round(r.length_outlook[0])


def test_length_calibration_learns_the_served_replies_scale_and_counts_a_capped_reply_at_its_cap():
    """LengthCalibration: the decayed ratio of the replies' lengths to what was expected of them, a prior of replies
    at 1 mixed in, within its bounds; a reply ended by its cap counts at the cap on both sides."""
    cal = LP.LengthCalibration(half_life=50.0, prior=10.0, lo=0.25, hi=4.0)
    assert cal.scale == 1.0
    cal.observe(200.0, 100.0, 1000)
    assert 0.9 < cal.scale < 1.0  # one reply at half: the prior keeps the scale near 1
    for _ in range(300):
        cal.observe(200.0, 100.0, 1000)
    assert cal.scale == pytest.approx(0.5, abs=0.02)
    for _ in range(300):  # the replies change: it follows them
        cal.observe(100.0, 300.0, 1000)
    assert cal.scale == pytest.approx(3.0, abs=0.1)
    capped = LP.LengthCalibration(prior=0.0)
    for _ in range(50):
        capped.observe(2000.0, 512.0, 512)  # expected 2000 but capped at 512: says nothing about the scale
    assert capped.scale == pytest.approx(1.0)
    for _ in range(50):
        capped.observe(float("nan"), 5.0, 512)
        capped.observe(0.0, 5.0, 512)
    assert capped.scale == pytest.approx(1.0) and capped.observed == 50
    low = LP.LengthCalibration(prior=0.0)
    for _ in range(10):
        low.observe(400.0, 1.0, 1000)
    assert low.scale == 0.25  # bounded
    # the expectation (within the cap at the scale, over the scale) is compared as it is: a reply as planned at a
    # scale of 0.25 under a cap of 200 (expected 80 served tokens: 320 over the scale) keeps the scale (it counted
    # 320 as 200, a ratio of 0.4)
    learned = LP.LengthCalibration(prior=0.0)
    for _ in range(20):
        learned.observe(320.0, 80.0, 200)
    assert learned.scale == pytest.approx(0.25)
    # replies that all run to a short cap say only "at least that long": the scale stays (it climbed to its bound)
    censored = LP.LengthCalibration(half_life=50.0, prior=10.0)
    for _ in range(2000):
        censored.observe(50.0, 64.0, 64)
    assert censored.scale == pytest.approx(1.0)


def test_kairos_scales_its_predictions_by_the_replies_it_served_and_scorpio_does_not():
    """length_calibration (kairos's on a CPU replica, off on a GPU's: `for_device`): each reply that ran to its end
    (stop or length, not an abort) is compared with the uncalibrated expectation it was admitted with, and later
    requests are predicted at the learned scale; the reply's cap bounds what it says."""
    from engine.config import EngineConfig, for_device

    assert for_device(EngineConfig(), "cuda").scheduler.flags().length_calibration is False
    assert for_device(EngineConfig(), "cpu").scheduler.flags().length_calibration is True
    k, s = _sched("kairos", length_predictor=True), _sched("scorpio", length_predictor=True)
    assert k.length_cal is not None and s.length_cal is None
    assert _sched("kairos", length_predictor=True, length_calibration=False).length_cal is None
    first = _req("first")
    k.add(first)
    base = first.length_outlook[0]
    assert first.length_base == pytest.approx(base)
    for i in range(400):  # every reply ends at a quarter of what was expected of it
        r = _req(f"r{i}", max_tokens=1000)
        k.add(r)
        r.token_ids.extend([7] * max(1, round(r.length_base / 4)))
        k.finish(r, FinishReason.STOP if i % 2 else FinishReason.LENGTH, 1.0)
    gone = _req("gone")
    k.add(gone)
    gone.token_ids.extend([7] * 900)
    k.finish(gone, FinishReason.ABORT, 1.0)  # cut short: says nothing
    floored = Request("floored", list(range(3, 13)), SamplingParams(max_tokens=1000, min_tokens=600))
    k.add(floored)
    floored.token_ids.extend([7] * 601)  # 600 and the EOS the sampler allowed first
    k.finish(floored, FinishReason.STOP, 1.0)  # ended as soon as min_tokens let it: says only "shorter"
    assert k.length_cal.scale == pytest.approx(0.25, abs=0.03) and k.length_cal.observed == 400
    later = _req("later")
    k.add(later)
    # the calibrated distribution, within the cap: E[min(scale * length, cap)], not the scale times the capped base
    p = LP.load_cached(None).probs(later.prompt_token_ids)
    assert later.length_outlook == LP.conditional_means(p, k.lengths.scale * k.length_cal.scale, 900)
    assert later.length_outlook[0] == pytest.approx(base * k.length_cal.scale, rel=0.1)
    # compared with its reply: the calibrated expectation over the scale (within the cap over it, so a little above
    # the first request's, which the cap cut at the scale of 1)
    assert later.length_base == pytest.approx(later.length_outlook[0] / k.length_cal.scale)
    assert later.length_base == pytest.approx(base, rel=0.1)
    assert later.predicted_len == round(later.length_outlook[0])


def test_the_outlook_reaches_past_the_buckets_at_a_scale_above_one():
    """At a scale above 1 (a calibration's, or a wordier served tokenizer's) the predicted lengths reach past the
    buckets' end in served tokens: the outlook's grid goes that far, so a reply past the end of the scale-1 grid is
    planned with the distribution's tokens left, not one."""
    import math

    from core.request import outlook_at

    p = np.zeros(len(LP.EDGES) + 1)
    p[-1] = 1.0  # all in the last bucket: [lo, hi) training tokens
    lo, hi = float(LP.EDGES[-1]), float(LP.LEN_HI)
    for scale, k in ((2.0, 3000), (4.0, 7000)):
        out = LP.conditional_means(p, scale, cap=50_000)
        want = (scale * hi - k) / math.log(scale * hi / k)  # E[len | len > k], log-uniform within the bucket
        assert outlook_at(out, k) - k > 0.6 * (want - k), (scale, outlook_at(out, k), want)


def test_a_quantile_above_min_tokens_is_of_the_distribution_above_it():
    """A request's min_tokens: the planning quantile is of the lengths above it (it was the whole distribution's,
    raised to min_tokens: a median of a reply at least 160 tokens long planned 160, not 175), never below it; past
    the distribution's end it is min_tokens itself."""
    from scheduling.length_predictor import EDGES, quantile

    one = np.zeros(len(EDGES) + 1)
    one[4] = 1.0  # all of it in [128, 192), log-uniform
    assert quantile(one, 0.5) == quantile(one, 0.5, floor=0.0) == round(math.sqrt(128 * 192))
    assert quantile(one, 0.5, floor=160.0) == round(math.sqrt(160 * 192))
    assert quantile(one, 0.5, scale=2.0, floor=320.0) == round(2 * math.sqrt(160 * 192))
    assert quantile(one, 0.9, floor=5000.0) == 5000
    flat = np.full(len(EDGES) + 1, 1.0 / (len(EDGES) + 1))
    got = [quantile(flat, 0.5, floor=f) for f in (0, 50, 200, 800)]
    assert got == sorted(got) and all(g >= f for g, f in zip(got, (0, 50, 200, 800)))
