"""How well designs of the reply-length predictor rank ShareGPT replies, on one split: is the shipped one's held-out
rank correlation (`scheduling.length_predictor`) what prompt features reach on this data, and what would a probe on
a language model's hidden state add?

Every design is trained the same way on the shipped predictor's training split (its validation conversations set
aside, first turns and later turns weighted as the shipped fit weighs them), its epoch chosen by the validation
split's Spearman, and scored on the held-out benchmark prompts (`length_predictor.HOLDOUT`):

- `ngrams`: the shipped features (hashed token and word n-grams, head tokens, length), softmax over the buckets;
- `ngrams+embed`: plus a pretrained model's input embeddings of the prompt (its own tokenizer), mean-pooled and
  standardized, through a linear layer: word meanings learned from far more text than ShareGPT's;
- `embed`: those embeddings alone;
- `ngrams+rank`: the n-grams with a pairwise ranking loss on the expected log length added to the log loss;
- `ngrams+mlp`: the n-grams, plus a hidden layer of `MLP_WIDTH` ReLU units over the same hashed features: whether
  the linear model misses interactions between words (a prompt that asks to "write" a "list" of "ten" things);
- `probe@sub`: a probe on the model's last hidden state of the prompt as a chat request (its template, the
  question's first and last `--probe-tokens` / 2 tokens): the final position's state and the mean over positions,
  standardized, through a linear layer. A forward per prompt is costly on a CPU, so the probe designs train on the
  first `--probe-rows` first turns of the training split only (`@sub`), beside `ngrams@sub`, the n-grams on the same
  rows, and `ngrams+probe@sub`. `probe` and `ngrams+probe` (run only when named) read every row of the split, later
  turns too, as the n-grams do: a forward for each of ~40,000 prompts.

    python -m bench.length_features [--model kairos-default] [--summary length-features-sharegpt]
    python -m bench.length_features --agreement [--summary length-agreement-sharegpt]   # `reply_agreement`

The model is SmolLM2-135M-Instruct (kairos-default) by default, the served default model. Training uses torch; the
probe's forwards take most of a run's time (it prints how long they took).
"""
from __future__ import annotations

import argparse
import glob
import time
from typing import Any, Sequence

import numpy as np

DESIGNS = ("ngrams", "ngrams+embed", "embed", "ngrams+rank", "ngrams+mlp", "ngrams@sub", "probe@sub",
           "ngrams+probe@sub")
FULL_PROBES = ("probe", "ngrams+probe")  # on every row: a forward per row, so only when named in --designs
MLP_WIDTH = 64


def pooled_embeddings(texts: Sequence[str], model: str) -> np.ndarray:
    """The mean of `model`'s input embeddings over each text's tokens (its tokenizer), standardized per dimension."""
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from bench.driver import resolve_model_path

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    E = None
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        with safe_open(f, "pt") as st:
            name = next((k for k in st.keys() if k.endswith("embed_tokens.weight") or k.endswith("wte.weight")), None)
            if name is not None:
                E = st.get_tensor(name).float()
                break
    if E is None:
        raise SystemExit(f"{path}: no input embedding table found")
    ids = tok(list(texts), add_special_tokens=False)["input_ids"]
    X = torch.stack([E[torch.tensor(x or [0])].mean(0) for x in ids]).numpy()
    return (X - X.mean(0)) / (X.std(0) + 1e-6)


def probe_states(texts: Sequence[str], model: str, tokens: int, batch: int = 16) -> np.ndarray:
    """`model`'s final hidden state (after its last norm) of each text as a chat request's one user message: the
    last position's and the mean over positions, concatenated and standardized; a text over `tokens` tokens is read at
    its first and last `tokens` / 2."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.driver import resolve_model_path

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # bf16: twice fp32 on a CPU
    ids = []
    for t in texts:
        q = tok(t, add_special_tokens=False)["input_ids"]
        q = q if len(q) <= tokens else q[:tokens // 2] + q[-(tokens // 2):]
        ids.append(tok.apply_chat_template([{"role": "user", "content": tok.decode(q)}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    out = []
    with torch.inference_mode():
        for i in range(0, len(ids), batch):
            chunk = ids[i:i + batch]
            n = max(len(x) for x in chunk)
            x = torch.tensor([[tok.pad_token_id or 0] * (n - len(c)) + c for c in chunk])  # left-padded
            mask = torch.tensor([[0] * (n - len(c)) + [1] * len(c) for c in chunk])
            h = lm.model(input_ids=x, attention_mask=mask).last_hidden_state
            mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            out.append(torch.cat([h[:, -1], mean], 1).float().numpy())
    X = np.concatenate(out)
    return (X - X.mean(0)) / (X.std(0) + 1e-6)


def reply_agreement(tokenizer: Any, seed: int = 0, boot: int = 1000) -> dict[str, Any]:
    """How well one reply's length ranks another's to the same prompt: the noise any prompt-only predictor meets.

    ShareGPT holds some prompts more than once (a popular question, a prompt pasted again) with replies that differ.
    Over the (human turn, reply) pairs that pass bench.workload's filters (as the predictor's rows), grouped by the
    prompt's text, a prompt with two or more distinct replies gives two of them at random (`seed`): the Spearman
    correlation of their lengths over such prompts is how well a predictor that drew a reply from the very
    distribution the prompt's replies come from would rank (a "sample" of the truth). The shipped predictor's
    Spearman against the same first replies is beside it (these prompts are mostly in its training split, so that
    figure is optimistic, but for the held-out benchmark prompts among them). Each with a bootstrap 95% interval
    over prompts; for first turns, every turn (a later turn such as "continue" has its context in the chat, not in
    its text), and the held-out ones."""
    from bench import workload as W
    from bench import length_training as LT
    from scheduling import length_predictor as L

    by_prompt: dict[str, dict[str, bool]] = {}  # prompt text -> {distinct reply text: a first turn}
    for r in W.read_conversations():
        c = r.get("conversations") or []
        for t in range(len(c) - 1):
            if c[t].get("from") == "human" and c[t + 1].get("from") == "gpt":
                replies = by_prompt.setdefault((c[t].get("value") or "").strip(), {})
                reply = (c[t + 1].get("value") or "").strip()
                replies[reply] = replies.get(reply, False) or t == 0
    rng = np.random.default_rng(seed)
    picked = []  # (prompt, reply a, reply b, a first turn)
    for prompt, replies in by_prompt.items():
        if len(replies) >= 2 and prompt:
            a, b = rng.choice(len(replies), 2, replace=False)
            texts = list(replies)
            picked.append((prompt, texts[a], texts[b], any(replies.values())))
    enc = tokenizer([p[0] for p in picked], add_special_tokens=False)["input_ids"]
    la = [len(x) for x in tokenizer([p[1] for p in picked], add_special_tokens=False)["input_ids"]]
    lb = [len(x) for x in tokenizer([p[2] for p in picked], add_special_tokens=False)["input_ids"]]
    keep = [i for i, ids in enumerate(enc)
            if W.SHAREGPT_MIN <= len(ids) <= W.SHAREGPT_MAX_PROMPT and min(la[i], lb[i]) >= W.SHAREGPT_MIN
            and len(ids) + max(la[i], lb[i]) <= W.SHAREGPT_MAX_TOTAL]
    model = L.load_cached()  # the shipped one counts in kairos-tiny's tokens (--tokenizer's default)
    pred = {i: float(model.outlook(enc[i])[0]) for i in keep}

    def interval(x: np.ndarray, y: np.ndarray) -> list[float]:
        got = [L.spearman(x[j], y[j]) for j in (rng.integers(0, len(x), len(x)) for _ in range(boot))]
        return [round(float(np.nanpercentile(got, q)), 3) for q in (2.5, 97.5)]

    rows_ = LT.sharegpt_rows(tokenizer)
    held = {tuple(x) for x, h in zip(rows_.ids, rows_.held) if h}  # the benchmark's prompts: never trained on
    out: dict[str, Any] = {}
    for name, rows in (("first_turns", [i for i in keep if picked[i][3]]), ("all_turns", keep),
                       ("heldout", [i for i in keep if tuple(enc[i]) in held])):
        a, b = np.asarray([la[i] for i in rows], float), np.asarray([lb[i] for i in rows], float)
        p = np.asarray([pred[i] for i in rows])
        out[name] = {"prompts": len(rows),
                     "other_reply_spearman": round(L.spearman(b, a), 4), "other_reply_ci95": interval(b, a),
                     "shipped_predictor_spearman": round(L.spearman(p, a), 4), "shipped_predictor_ci95": interval(p, a)}
    return out


def fit_and_score(design: str, rows: Any, feats: list, dense: np.ndarray | None, fit: np.ndarray, val: np.ndarray,
                  held: np.ndarray, epochs: int, rank_weight: float, seed: int = 0) -> dict[str, Any]:
    """Train one design on rows `fit` (`dense`: the rows' embedding or probe features, where the design has them);
    the held-out Spearman of its expected log length at the best validation epoch."""
    import torch

    from bench import length_training as LT
    from scheduling import length_predictor as L

    torch.manual_seed(seed)
    cfg = LT.TrainConfig()
    K = len(L.EDGES) + 1
    y = torch.tensor([L.bucket_of(n) for n in rows.lens])
    w = torch.tensor(np.where(rows.first, 1.0, cfg.later_weight), dtype=torch.float32)
    log_len = torch.tensor(np.log(rows.lens), dtype=torch.float32)
    mids = torch.tensor(np.log(L.bucket_mids()), dtype=torch.float32)
    ngrams, embed = "ngrams" in design, "embed" in design or "probe" in design
    bag = torch.nn.EmbeddingBag(L.DIM, K, mode="sum")
    torch.nn.init.zeros_(bag.weight)
    bias = torch.nn.Parameter(torch.log(torch.bincount(y[fit], minlength=K).float() + 1.0))
    head = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(dense.shape[1], K)) if embed else None
    mlp = "mlp" in design  # a hidden layer over the hashed features, beside the linear path
    hidden = torch.nn.EmbeddingBag(L.DIM, MLP_WIDTH, mode="sum") if mlp else None
    if hidden is not None:
        torch.nn.init.normal_(hidden.weight, std=0.02)
    top = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(MLP_WIDTH, K)) if mlp else None
    D = torch.from_numpy(dense).float() if embed else None
    params = [bias] + ([bag.weight] if ngrams else []) + (list(head.parameters()) if embed else [])
    params += [hidden.weight, *top.parameters()] if mlp else []
    opt = torch.optim.Adam(params, lr=cfg.lr)

    def logits(idx: np.ndarray, train: bool) -> Any:
        z = bias.expand(len(idx), K)
        if ngrams:
            bi, bo, bw = LT._batches(feats, idx, cfg.bag_pool)
            if train:
                bw = bw * (torch.rand(bw.shape) >= cfg.dropout).float() / (1.0 - cfg.dropout)
            z = z + bag(bi, bo, per_sample_weights=bw)
            if mlp:
                top.train(train)
                z = z + top(hidden(bi, bo, per_sample_weights=bw))
        if embed:
            head.train(train)
            z = z + head(D[idx])
        return z

    def spearman(idx: np.ndarray) -> float:
        with torch.no_grad():
            return L.spearman((torch.softmax(logits(idx, False), 1) @ mids).numpy(), rows.lens[idx])

    rng = np.random.default_rng(seed)
    history = []
    for epoch in range(epochs):
        for b in np.array_split(rng.permutation(fit), max(1, len(fit) // cfg.batch)):
            z = logits(b, True)
            loss = (torch.nn.functional.cross_entropy(z, y[b], reduction="none") * w[b]).sum() / w[b].sum()
            if ngrams:
                loss = loss + cfg.l2 * (bag.weight * bag.weight).sum()
            if mlp:
                loss = loss + cfg.l2 * (hidden.weight * hidden.weight).sum()
            if "rank" in design:  # pairwise logistic loss: a longer reply should get the larger expected log length
                s = torch.softmax(z, 1) @ mids
                sign = torch.sign(log_len[b][:, None] - log_len[b][None, :])
                pair = torch.nn.functional.softplus(-4.0 * sign * (s[:, None] - s[None, :]))
                loss = loss + rank_weight * pair[sign != 0].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        history.append((epoch + 1, spearman(val), spearman(held)))
    best = max(history, key=lambda h: h[1])
    return {"design": design, "epoch": best[0], "validation_spearman": round(best[1], 4),
            "heldout_spearman": round(best[2], 4), "history": [[e, round(v, 4), round(h, 4)] for e, v, h in history]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.length_features", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="kairos-tiny", help="the tokens lengths are counted in (as shipped)")
    ap.add_argument("--model", default="kairos-default", help="whose input embeddings `embed` pools and whose "
                    "hidden state `probe` reads")
    ap.add_argument("--designs", default=",".join(DESIGNS))
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--rank-weight", type=float, default=1.0)
    ap.add_argument("--probe-rows", type=int, default=1500, help="@sub designs: training first turns (and as many "
                    "held-out, half as many validation ones)")
    ap.add_argument("--probe-tokens", type=int, default=64, help="the probe reads this many of the question's tokens")
    ap.add_argument("--agreement", action="store_true", help="only `reply_agreement`: how well another reply to the "
                    "same prompt ranks a reply's length, beside the shipped predictor on those prompts")
    ap.add_argument("--summary", default=None, help="bench/summaries/NAME.json")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from bench.driver import resolve_model_path
    from bench import length_training as LT
    from scheduling import length_predictor as L

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer))
    if args.agreement:
        got = reply_agreement(tok)
        for name, g in got.items():
            print(f"  {name:<11} {g['prompts']:>4} prompts with two distinct replies: another reply's Spearman "
                  f"{g['other_reply_spearman']:.3f} {g['other_reply_ci95']}, the shipped predictor's "
                  f"{g['shipped_predictor_spearman']:.3f} {g['shipped_predictor_ci95']}", flush=True)
        if args.summary:
            from bench.report import command_line, write_summary

            head = "ShareGPT prompts with two distinct replies, Spearman of one reply's length against: " + "; ".join(
                f"{n} ({g['prompts']}) another reply {g['other_reply_spearman']:.3f}, the shipped predictor "
                f"{g['shipped_predictor_spearman']:.3f}" for n, g in got.items())
            figures = {**got, "tokenizer": args.tokenizer}
            cmd = command_line("bench.length_features", argv)
            print(f"summary -> {write_summary(args.summary, cmd, head, figures)}")
        return 0
    rows = LT.sharegpt_rows(tok)
    groups = sorted({g for g, h in zip(rows.group, rows.held) if not h})
    val_groups = set(np.random.default_rng(0).choice(groups, int(len(groups) * 0.25), replace=False).tolist())
    in_val = np.array([g in val_groups for g in rows.group]) & ~rows.held
    fit = np.flatnonzero(~rows.held & ~in_val)
    val, held = np.flatnonzero(in_val & rows.first), np.flatnonzero(rows.held)
    table = L.WordTable.of_tokenizer(tok)
    feats = [L.features(x, table) for x in rows.ids]
    designs = [d for d in args.designs.split(",") if d]
    texts = tok.batch_decode(rows.ids)
    embed = pooled_embeddings(texts, args.model) if any("embed" in d for d in designs) else None
    k = args.probe_rows
    sub = (fit[rows.first[fit]][:k], val[:k // 2], held[:k])  # the @sub designs' rows
    probe, probe_ms = None, None
    if any("probe" in d for d in designs):
        t1 = time.perf_counter()
        full = any(d in FULL_PROBES for d in designs)
        union = np.concatenate((fit, val, held) if full else sub)
        if full:  # in order of prompt length, about the tokens the probe reads (batches of alike lengths pad less)
            union = union[np.argsort([min(len(rows.ids[i]), args.probe_tokens) for i in union], kind="stable")]
        got = probe_states([texts[i] for i in union], args.model, args.probe_tokens)
        probe = np.zeros((len(rows.ids), got.shape[1]), np.float32)
        probe[union] = got
        probe_ms = 1000.0 * (time.perf_counter() - t1) / len(union)
        print(f"probe states of {len(union)} prompts in {time.perf_counter() - t1:.0f} s", flush=True)
    print(f"{len(fit)} training rows, {len(val)} validation first turns, {len(held)} held out (@sub: "
          f"{', '.join(str(len(x)) for x in sub)}); features in {time.perf_counter() - t0:.0f} s", flush=True)
    results = []
    for d in designs:
        splits = sub if d.endswith("@sub") else (fit, val, held)
        r = fit_and_score(d, rows, feats, probe if "probe" in d else embed, *splits, args.epochs, args.rank_weight)
        r["n"] = [int(len(x)) for x in splits]
        results.append(r)
        print(f"  {d:<17} held-out Spearman {r['heldout_spearman']:.3f} (validation {r['validation_spearman']:.3f}, "
              f"epoch {r['epoch']})", flush=True)
    if args.summary:
        from bench.report import command_line, write_summary

        head = "held-out ShareGPT Spearman by predictor design: " + ", ".join(
            f"{r['design']} {r['heldout_spearman']:.3f}" for r in results)
        figures = {"designs": results, "model": args.model, "tokenizer": args.tokenizer,
                   "probe_ms_per_prompt": None if probe_ms is None else round(probe_ms, 1),
                   "probe_tokens": args.probe_tokens,
                   "n": {"train": int(len(fit)), "validation": int(len(val)), "heldout": int(len(held))}}
        print(f"summary -> {write_summary(args.summary, command_line('bench.length_features', argv), head, figures)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
