"""bench.length_features: each predictor design is trained on the split it is given and scored on held-out rows."""
import numpy as np

from bench import length_features as LF
from bench.length_features import fit_and_score
from scheduling import length_predictor as L


def _rows(n: int = 2400, seed: int = 0) -> L.Rows:
    """Prompts whose reply length is set by their first token (long replies after token 7), and a dense feature
    that says the same."""
    rng = np.random.default_rng(seed)
    ids, lens = [], []
    for _ in range(n):
        long = rng.random() < 0.5
        ids.append([7 if long else 9] + rng.integers(20, 200, size=int(rng.integers(4, 30))).tolist())
        lens.append(float(rng.integers(400, 900) if long else rng.integers(8, 40)))
    return L.Rows(ids, np.asarray(lens), np.zeros(n, bool), np.ones(n, bool), [str(i) for i in range(n)])


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
