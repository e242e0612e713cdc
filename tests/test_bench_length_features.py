"""bench.length_features: each predictor design is trained on the split it is given and scored on held-out rows."""
import numpy as np

from bench import length_features as LF
from bench.length_features import fit_and_score
from bench import length_training as LT
from scheduling import length_predictor as L


def _rows(n: int = 2400, seed: int = 0) -> LT.Rows:
    """Prompts whose reply length is set by their first token (long replies after token 7), and a dense feature
    that says the same."""
    rng = np.random.default_rng(seed)
    ids, lens = [], []
    for _ in range(n):
        long = rng.random() < 0.5
        ids.append([7 if long else 9] + rng.integers(20, 200, size=int(rng.integers(4, 30))).tolist())
        lens.append(float(rng.integers(400, 900) if long else rng.integers(8, 40)))
    return LT.Rows(ids, np.asarray(lens), np.zeros(n, bool), np.ones(n, bool), [str(i) for i in range(n)])


def test_every_design_learns_what_its_features_say(monkeypatch) -> None:
    monkeypatch.setattr(LF, "MLP_WIDTH", 8)  # (64 by default: the hidden layer's table is most of a run's time here)
    # a hashed space smaller than the shipped one: Adam's dense steps over the whole table were most of the rest
    monkeypatch.setattr(L, "DIM", 1 << 14)
    rows = _rows()
    feats = [L.features(x, dim=L.DIM) for x in rows.ids]
    dense = np.stack([[1.0 if x[0] == 7 else -1.0, 0.0] for x in rows.ids]).astype(np.float32)
    idx = np.arange(len(rows.ids))
    fit, val, held = idx[:2000], idx[2000:2200], idx[2200:]
    for design in ("ngrams", "probe", "ngrams+probe", "ngrams+rank", "ngrams+mlp"):
        epochs = 40 if design == "probe" else 4  # a dense layer alone learns at Adam's small steps from a random start
        r = fit_and_score(design, rows, feats, dense, fit, val, held, epochs=epochs, rank_weight=1.0)
        assert r["design"] == design and 1 <= r["epoch"] <= epochs and len(r["history"]) == epochs
        assert r["heldout_spearman"] > 0.5, r  # a two-valued ranking of these lengths tops out near 0.87


class _WordTokenizer:
    """Each word one id (its length), as a tokenizer call returns them."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[10 + len(w) for w in t.split()] for t in texts]}


def test_reply_agreement_pairs_distinct_replies_to_one_prompt(monkeypatch) -> None:
    from bench import workload as W

    rng = np.random.default_rng(1)
    records = []
    for i in range(60):  # each prompt asked twice, replies of about the same length (a length the prompt sets)
        n = int(rng.integers(5, 400))
        for k in range(2):
            reply = " ".join(["w"] * (n + k))  # distinct texts, one word apart
            question = {"from": "human", "value": f"question {i} asks for {n} words please"}
            records.append({"id": f"r{i}-{k}", "conversations": [question, {"from": "gpt", "value": reply}]})
        # the same conversation pasted again: a duplicate reply, not a second one
        records.append({"id": f"r{i}-dup", "conversations": records[-1]["conversations"]})
    records.append({"id": "once", "conversations": [{"from": "human", "value": "asked only once here ok"},
                                                    {"from": "gpt", "value": "an answer of some words"}]})
    monkeypatch.setattr(W, "read_conversations", lambda path=None: tuple(records))
    got = LF.reply_agreement(_WordTokenizer(), boot=20)
    assert got["first_turns"]["prompts"] == got["all_turns"]["prompts"] == 60  # the one-reply prompt is not paired
    assert got["first_turns"]["other_reply_spearman"] > 0.99
    lo, hi = got["first_turns"]["other_reply_ci95"]
    assert 0.9 < lo <= hi <= 1.0
    assert -1.0 <= got["all_turns"]["shipped_predictor_spearman"] <= 1.0
