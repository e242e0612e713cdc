"""Latency model: exact LS recovery, JSON persistence, online RLS refit, and the profiler."""
from __future__ import annotations


import numpy as np
import pytest

from scheduling.predictor import MIN_MS, LatencyModel, mape, profile, r2

DECODE = (0.002, 0.5, 0.01, 3.0)  # a, b, c, d
PREFILL = (0.03, 4.0, 2e-5)  # alpha, beta, gamma (the attention term: token pairs)
BATCHES = (1, 2, 4, 8, 16, 32)
CTX = (64, 128, 256, 512)
SIZES = (16, 32, 64, 128, 256, 512, 1024)


def _itl(coef, b, n) -> float:
    a, bb, c, d = coef
    return a * b * n + bb * b + c * n + d


def _pf(coef, n) -> float:
    return coef[0] * n + coef[1] + coef[2] * n * n


def _fitted() -> LatencyModel:
    model = LatencyModel(meta={"model": "tiny-llama", "device": "cpu", "dtype": "float32"})
    model.fit_prefill([(n, _pf(PREFILL, n)) for n in SIZES])
    model.fit_decode([(b, n, _itl(DECODE, b, n)) for b in BATCHES for n in CTX])
    return model


def test_exact_recovery_of_linear_model() -> None:
    model = _fitted()
    assert model.decode_coef == pytest.approx(DECODE, rel=1e-9)
    assert model.prefill_coef == pytest.approx(PREFILL, rel=1e-9)
    assert model.itl_ms(12, 300) == pytest.approx(_itl(DECODE, 12, 300))
    assert model.prefill_ms(700) == pytest.approx(_pf(PREFILL, 700))
    score = model.score_decode([(b, n, _itl(DECODE, b, n)) for b in BATCHES for n in CTX])
    assert score["r2"] == pytest.approx(1.0) and score["mape"] == pytest.approx(0.0, abs=1e-9)


def test_a_round_of_prompts_costs_its_tokens_and_the_sum_of_their_squares() -> None:
    """Attention grows with each prompt's square, not the round's: four prompts of 256 tokens cost 1024 tokens and
    4 x 256² token pairs; a chunk from 512 to 1024 costs 1024² - 512². An older file (two prefill weights) reads
    as gamma 0."""
    from scheduling.predictor import prefill_sq

    model = _fitted()
    four = model.prefill_ms(1024, 4 * prefill_sq(0, 256))
    assert four == pytest.approx(0.03 * 1024 + 4.0 + 2e-5 * 4 * 256 ** 2)
    assert four < model.prefill_ms(1024) == pytest.approx(_pf(PREFILL, 1024))
    assert model.prefill_ms(512, prefill_sq(512, 1024)) == pytest.approx(0.03 * 512 + 4.0 + 2e-5 * (1024 ** 2 - 512 ** 2))
    import json
    d = json.loads(model.to_json())
    d["prefill"] = {"w": [0.03, 4.0], "scale": [512.0, 1.0]}
    old = LatencyModel.from_json(json.dumps(d))
    assert old.prefill_coef == (0.03, 4.0, 0.0) and old.prefill_ms(100) == pytest.approx(7.0)


def test_the_attention_term_is_kept_only_where_it_predicts_the_longest_profiled_prompt_better() -> None:
    """Fitted without the longest size and judged on it: steps that grow with the square keep the term; steps on a
    line with a few ms of noise at the short sizes (a busy box) do not bend with the noise, which had over-predicted
    a prompt twice the longest profiled one by a factor of two."""
    sizes = (16, 32, 64, 128, 256, 512)
    bent = LatencyModel().fit_prefill([(n, _pf(PREFILL, n)) for n in sizes])
    assert bent.prefill_coef == pytest.approx(PREFILL, rel=1e-6)
    noise = {16: 0.0, 32: 1.5, 64: 0.0, 128: 4.0, 256: -2.0, 512: 0.0}  # ms
    line = LatencyModel().fit_prefill([(n, 0.06 * n + 1.0 + noise[n]) for n in sizes])
    assert line.prefill_coef[2] == 0.0 and line.prefill_ms(1023) == pytest.approx(0.06 * 1023 + 1.0, rel=0.05)


def test_piecewise_prefill_and_clamp() -> None:
    model = LatencyModel(theta=32)
    model.fit_prefill([(8, 5.0), (16, 7.0), *[(n, _pf(PREFILL, n)) for n in (64, 128, 256, 512)]])
    assert model.prefill_ms(10) == 6.0  # c0 = mean of the samples at n <= theta
    assert model.prefill_ms(100) == pytest.approx(_pf(PREFILL, 100))
    negative = LatencyModel(prefill_coef=(-1.0, 0.0), decode_coef=(0.0, 0.0, 0.0, -5.0))
    assert negative.prefill_ms(100) == MIN_MS
    assert negative.itl_ms(4, 100) == MIN_MS


def test_json_round_trip(tmp_path) -> None:
    model = _fitted()
    clone = LatencyModel.from_json(model.to_json())
    path = tmp_path / "fit.json"
    model.save(path)
    loaded = LatencyModel.load(path)
    for other in (clone, loaded):
        assert other.meta == model.meta
        assert other.decode_coef == model.decode_coef and other.prefill_coef == model.prefill_coef
    assert clone.itl_ms(3, 77) == loaded.itl_ms(3, 77) == model.itl_ms(3, 77)
    assert model.matches({"model": "tiny-llama", "dtype": "float32"})
    assert not model.matches({"device": "cuda"})
    with pytest.raises(ValueError, match="format"):
        LatencyModel.from_json('{"format": 99}')


def test_a_model_saved_while_others_read_and_write_it_is_read_whole(tmp_path) -> None:
    """Replicas of one host profile the same setup at once: each save lands whole (no reader sees part of a file),
    and leaves no file of its own beside it."""
    import threading

    path = tmp_path / "fit.json"
    models = []
    for i in range(4):
        m = _fitted()
        m.meta = {**m.meta, "writer": i, "pad": "x" * 200_000}  # (a file long enough to be read while written)
        models.append(m)
    models[0].save(path)
    stop, seen, errors = threading.Event(), set(), []

    def read() -> None:
        while not stop.is_set():
            try:
                seen.add(LatencyModel.load(path).meta["writer"])
            except Exception as e:  # noqa: BLE001 - what the test counts
                errors.append(repr(e))

    def write(m) -> None:
        for _ in range(15):
            m.save(path)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(m,)) for m in models]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert not errors, errors[:3]
    assert seen and [p.name for p in tmp_path.iterdir()] == ["fit.json"]


def test_score_helpers() -> None:
    assert r2([1, 2, 3], [1, 2, 3]) == 1.0
    assert r2([1, 2, 3], [2, 2, 2]) == 0.0
    assert r2([5, 5], [5, 5]) == 1.0
    assert mape([100, 200], [110, 180]) == pytest.approx(0.1)


class FakeEngine:
    """Callables returning measured ms; each call advances a fake clock by one second."""

    def __init__(self, noise: float = 0.0) -> None:
        self.now = 0.0
        self.rng = np.random.default_rng(0)
        self.noise = noise

    def clock(self) -> float:
        return self.now

    def _measure(self, ms: float) -> float:
        self.now += 1.0
        return ms * (1 + self.rng.normal(0, self.noise)) if self.noise else ms

    def prefill(self, n: int) -> float:
        return self._measure(_pf(PREFILL, n))

    def decode(self, b: int, n: int) -> float:
        return self._measure(_itl(DECODE, b, n))


def _profile(eng: FakeEngine, budget: float):
    return profile(eng.prefill, eng.decode, prefill_sizes=SIZES, batch_sizes=BATCHES, ctx_lens=CTX,
                   repeats=2, time_budget_s=budget, clock=eng.clock)


def test_profile_full_run_recovers_model_and_reports_holdout() -> None:
    model, report = _profile(FakeEngine(), budget=1e9)
    n_decode = 2 * len(BATCHES) * len(CTX)
    assert report["n_samples"] == 2 * len(SIZES) + n_decode
    assert report["n_decode"] == n_decode and report["n_holdout"] == n_decode // 4
    assert not report["budget_exhausted"]
    assert report["r2"] == pytest.approx(1.0)
    assert report["mape_holdout"] == pytest.approx(0.0, abs=1e-9)
    assert model.decode_coef == pytest.approx(DECODE, rel=1e-9)


def test_profile_noisy_holdout_mape() -> None:
    _, report = _profile(FakeEngine(noise=0.02), budget=1e9)
    assert 0.002 < report["mape_holdout"] < 0.05
    assert 0.002 < report["mape_train"] < 0.05
    assert report["r2"] > 0.99


def test_profile_respects_time_budget() -> None:
    eng = FakeEngine()
    model, report = _profile(eng, budget=12.0)
    assert report["n_samples"] == 12 and report["seconds"] == 12.0
    assert report["budget_exhausted"]
    assert report["n_prefill"] == 6 and report["n_decode"] == 6  # interleaved: both kinds measured
    assert model.prefill_coef == pytest.approx(PREFILL, rel=1e-9)
    assert model.itl_ms(4, 128) > MIN_MS  # fitted with what it had


def test_profile_with_no_time_still_returns_a_model() -> None:
    model, report = _profile(FakeEngine(), budget=0.0)
    assert report["n_samples"] == 0 and report["mape_holdout"] is None and report["r2"] is None
    assert model.itl_ms(4, 128) == MIN_MS


def test_fit_never_predicts_a_bigger_batch_faster():
    """A flat, noisy ITL curve (tiny model, busy box) must not fit a negative slope."""
    rng = np.random.default_rng(3)
    samples = [(b, n, 10.0 + rng.normal(0, 1.5) - 0.05 * b) for b in (1, 2, 4, 8, 16, 32) for n in (64, 128, 256)]
    m = LatencyModel().fit_decode(samples)
    assert all(c >= 0 for c in m.decode_coef)
    assert m.itl_ms(32, 128) >= m.itl_ms(1, 128)


def test_scaled_copy_multiplies_step_times_and_leaves_the_original() -> None:
    m = LatencyModel(prefill_coef=(0.1, 2.0), decode_coef=(0.001, 0.2, 0.01, 3.0))
    s = m.scaled(decode=1.5, prefill=2.0)
    assert s.itl_ms(8, 200) == pytest.approx(1.5 * m.itl_ms(8, 200))
    assert s.prefill_ms(300) == pytest.approx(2.0 * m.prefill_ms(300))
    assert m.itl_ms(8, 200) == pytest.approx(0.001 * 1600 + 1.6 + 2.0 + 3.0)  # the original is untouched


def test_prefill_knee_fits_a_flat_then_linear_step_time():
    """A GPU-like prefill: flat at 10 ms up to 512 tokens, then 10 + 0.02 ms a token beyond. The knee search puts
    theta at the flat part's end and fits the line beyond it; without it one line misses both ends."""
    from scheduling.predictor import LatencyModel

    sizes = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    samples = [(n, 10.0 if n <= 512 else 10.0 + 0.02 * (n - 512)) for n in sizes]
    knee = LatencyModel().fit_prefill(samples, find_knee=True)
    assert knee.score_prefill(samples)["mape"] < 0.01
    assert abs(knee.prefill_ms(64) - 10.0) < 0.1 and abs(knee.prefill_ms(3000) - (10 + 0.02 * 2488)) < 1.0
    plain = LatencyModel().fit_prefill(samples)
    assert plain.score_prefill(samples)["mape"] > 0.1


def test_the_price_of_lora_adapters_is_fitted_kept_and_scaled():
    from scheduling.predictor import Adapters

    truth = (2.0, 0.5, 0.01)
    samples = [(b, k, truth[0] + truth[1] * k + truth[2] * b) for b in (1, 4, 16, 64) for k in (1, 2, 4) if k <= b]
    m = LatencyModel(decode_coef=(0.0, 0.5, 0.0, 5.0)).fit_lora(samples)
    assert m.prices_adapters and all(abs(x - y) < 1e-6 for x, y in zip(m.lora_coef, truth))
    assert m.lora_ms(0, 16) == 0.0 and abs(m.lora_ms(2, 16) - 3.16) < 1e-6
    again = LatencyModel.from_json(m.to_json())
    assert again.lora_coef == m.lora_coef and not LatencyModel().prices_adapters
    assert abs(m.scaled(decode=2.0).lora_ms(2, 16) - 6.32) < 1e-6
    view = Adapters(m)
    assert view.itl_ms(4, 100) == m.itl_ms(4, 100) and view.prefill_ms(10) == m.prefill_ms(10)
    view.adapters = 2
    assert view.itl_ms(4, 100) == m.itl_ms(4, 100) + m.lora_ms(2, 4)


def test_a_prefill_past_the_knee_never_costs_less_and_a_short_chunk_keeps_its_attention():
    """A knee fit: c0 for a step of up to theta tokens, the line beyond. The two are fitted apart: the line just past
    the knee was below c0 (every stored GPU fit predicted less for one more token there), and a short chunk deep in a
    long prompt cost c0, its attention dropped (and one token more cost several times as much)."""
    from scheduling.predictor import prefill_sq

    model = LatencyModel(c0=5.4, theta=128.0, prefill_coef=(0.03, 0.5, 1e-6))  # the line at 129: 4.4 ms
    times = [model.prefill_ms(n) for n in range(1, 400)]
    assert all(b >= a for a, b in zip(times, times[1:])) and model.prefill_ms(129) == model.prefill_ms(128) == 5.4
    deep = [model.prefill_ms(n, prefill_sq(32768 - n, 32768)) for n in (64, 128, 129, 256)]
    assert deep[1] > 5.4 and all(b >= a for a, b in zip(deep, deep[1:]))
    assert deep[2] - deep[1] < 0.1  # one more token: about one more token's time, not three times the step
    flat = LatencyModel(prefill_coef=(0.03, 0.5, 1e-6))  # no knee (a CPU fit): the line, as before
    assert flat.prefill_ms(10) == pytest.approx(0.03 * 10 + 0.5 + 1e-6 * 100)


def test_a_fit_from_too_few_samples_or_with_gross_error_is_not_kept_for_later_starts(tmp_path, monkeypatch):
    """A profile was cached and reused at every start however bad: four decode terms fitted from two samples (the
    budget gone to first-step compiles) read a step many times too long; a fit timed on a busy host had a gross
    prefill error. Such a fit serves its engine's run, and is not saved: the next start profiles afresh."""
    from types import SimpleNamespace

    from engine import profiling

    assert profiling.untrusted({"budget_exhausted": True, "n_decode": 2, "n_prefill": 2}) is not None
    assert profiling.untrusted({"budget_exhausted": False, "n_decode": 90, "prefill_mape": 9.85}) is not None
    assert profiling.untrusted({"budget_exhausted": True, "n_decode": 40, "n_prefill": 12, "prefill_mape": 0.2,
                                "mape_holdout": 0.3}) is None
    saved: list = []
    monkeypatch.setattr(LatencyModel, "save", lambda self, path: saved.append(path))
    fits = iter([{"budget_exhausted": True, "n_decode": 2, "n_prefill": 2}, {"budget_exhausted": False,
                                                                             "n_decode": 90, "n_prefill": 30}])
    monkeypatch.setattr(profiling, "profile", lambda *a, **k: (LatencyModel(), dict(next(fits))))
    monkeypatch.setattr(profiling, "Prober", lambda engine: SimpleNamespace(prefill=lambda n: 1.0,
                                                                             decode=lambda b, n: 1.0))
    cache = SimpleNamespace(num_blocks=64, block_size=16)
    engine = SimpleNamespace(max_model_len=512, cache=cache, bundle=SimpleNamespace(device=SimpleNamespace(type="cpu")),
                             config=SimpleNamespace(scheduler=SimpleNamespace(prefill_max_tokens=256, max_num_seqs=8),
                                                    serves_lora=False))
    model, report = profiling._profile(engine, 1.0, {"m": 1}, tmp_path / "p.json")
    assert report["untrusted"] and report["path"] is None and saved == []
    model, report = profiling._profile(engine, 1.0, {"m": 1}, tmp_path / "p.json")
    assert "untrusted" not in report and saved == [tmp_path / "p.json"]


def _gpu_like(n: float, q: float = None, batch: int = 0, ctx: float = 0.0) -> float:
    """A GPU-shaped step (exact): the weights read once per forward (6 ms) whatever its tokens, 0.004 ms a token,
    1e-6 ms a prefill token pair, 2e-5 ms a decode row's context token; a hybrid step is one forward."""
    q = n * n if q is None else q
    return 6.0 + 0.004 * (n + batch) + 1e-6 * q + 2e-5 * batch * ctx


def test_chunks_over_a_cached_prefix_fix_the_attention_term_that_short_fresh_prompts_leave_to_noise() -> None:
    """Fresh prompts of up to 4,096 tokens on a GPU spend little on attention: with a little noise the term is kept or
    dropped by chance, and a chunk deep in a long prompt was predicted at a third of its time. Chunks timed over a
    cached prefix (`(n, q, ms)` samples: q grows at a fixed n) fix it."""
    from scheduling.predictor import prefill_sq

    sizes = (256, 512, 1024, 2048, 4096)
    noisy = {256: 0.0, 512: 0.5, 1024: -0.5, 2048: 1.0, 4096: -3.0}  # ms (of steps of 8 to 45 ms)
    fresh = [(n, _gpu_like(n) + noisy[n]) for n in sizes]
    deep = [(n, prefill_sq(at, at + n), _gpu_like(n, prefill_sq(at, at + n))) for n in (512, 2048)
            for at in (8192, 16384, 30720)]
    without = LatencyModel().fit_prefill(fresh)
    model = LatencyModel().fit_prefill(fresh + deep)
    q = prefill_sq(30720, 32768)
    assert without.prefill_ms(2048, q) < 0.6 * _gpu_like(2048, q)  # (this noise drops the term)
    assert model.prefill_ms(2048, q) == pytest.approx(_gpu_like(2048, q), rel=0.05)
    assert model.prefill_ms(32768) == pytest.approx(_gpu_like(32768), rel=0.05)
    assert model.score_prefill(deep)["mape"] < 0.05


def test_a_hybrid_step_is_one_forward_where_the_profile_measures_it_so() -> None:
    """A step that prefills beside decodes: their sum (`mixed` "sum", a CPU's fit and any saved before) counted a
    GPU's weight read twice (a 64-token chunk beside 64 decodes predicted at about twice its time); where the hybrid
    probes say so (`fit_mixed`), the prefill of its tokens and the decode rows together, plus their context."""
    model = LatencyModel().fit_prefill([(n, _gpu_like(n)) for n in (16, 64, 256, 1024, 4096)])
    model.fit_decode([(b, c, _gpu_like(0, 0, b, c)) for b in (1, 8, 64, 256) for c in (128, 1024, 4096)])
    assert model.mixed == "sum" and model.beside_ms(64, None, 64, 1024) == model.prefill_ms(64)
    hybrid = [(n, float(n * n), b, 1024.0, _gpu_like(n, None, b, 1024)) for n in (64, 256, 1024) for b in (16, 64, 256)]
    report = model.fit_mixed(hybrid)
    assert report["mixed"] == model.mixed == "shared" and report["mixed_mape_shared"] < 0.02 < report["mixed_mape_sum"]
    for n, b in ((64, 64), (512, 128), (16, 256)):
        assert model.mixed_ms(n, None, b, 2048) == pytest.approx(_gpu_like(n, None, b, 2048), rel=0.02)
        assert model.mixed_ms(n, None, b, 2048) >= model.itl_ms(b, 2048)  # (a prefill never makes it faster)
    assert model.beside_ms(0, 0, 64, 1024) == 0.0 and model.beside_ms(64, None, 0, 0) == model.prefill_ms(64)
    again = LatencyModel.from_json(model.to_json())
    assert again.mixed == "shared" and again.mixed_ms(64, None, 64, 1024) == model.mixed_ms(64, None, 64, 1024)
    assert LatencyModel.from_json(model.scaled(2.0, 2.0).to_json()).mixed == "shared"
    cpu_like = [(n, q, b, c, model.prefill_ms(n, q) + model.itl_ms(b, c)) for n, q, b, c, _ in hybrid]
    assert model.fit_mixed(cpu_like)["mixed"] == model.mixed == "sum"
    with pytest.raises(ValueError, match="mixed"):
        LatencyModel(mixed="overlap")


def test_a_step_padded_to_a_graphs_token_count_is_predicted_at_that_count() -> None:
    """Steps with prefill rows replay CUDA graphs at fixed token counts: a step of 129 tokens runs as 192. The fit
    (on counts of the ladder) predicts a step at the count it runs as, up to the ladder's last (its attention as
    it is); past it, as it is."""
    ladder = (16, 32, 64, 96, 128, 192, 256)
    model = LatencyModel(prefill_coef=(0.01, 5.0, 0.0), decode_coef=(0.0, 0.1, 0.0, 4.0), token_ladder=ladder)
    assert model.step_prefill_ms(129) == pytest.approx(0.01 * 192 + 5.0)
    assert model.step_prefill_ms(128) == pytest.approx(0.01 * 128 + 5.0)
    assert model.step_prefill_ms(300) == pytest.approx(0.01 * 300 + 5.0)
    assert model.beside_ms(129, None, 8, 100) == model.step_prefill_ms(129)  # ("sum": its own step)
    model.mixed = "shared"  # (its tokens beside 8 decode rows: 137, run as 192)
    assert model.beside_ms(129, None, 8, 100) == pytest.approx(0.01 * 192 + 5.0 - (0.1 * 8 + 4.0))
    # a queue of prompts (the TTFT guard's, the router's copy of the model) is no one step: not padded
    assert model.prefill_ms(129) == pytest.approx(0.01 * 129 + 5.0)
    assert LatencyModel.from_json(model.to_json()).token_ladder == ladder
    # fitted on steps that ran padded: a size off the ladder (a budget of 300) is read as the count it ran as
    true = LatencyModel(prefill_coef=(0.01, 5.0, 0.0), token_ladder=(16, 64, 128, 256, 320, 512))
    fit = LatencyModel(token_ladder=true.token_ladder).fit_prefill([(n, true.step_prefill_ms(n))
                                                                     for n in (16, 64, 256, 300, 512, 1024, 2048)])
    assert fit.prefill_coef == pytest.approx((0.01, 5.0, 0.0), abs=1e-9)


def test_profile_times_chunks_and_hybrid_steps_where_asked() -> None:
    """`profile` with chunk and hybrid probes (a GPU's): both kinds measured beside the others, the attention term
    from the chunks, the hybrid form chosen by them."""
    from scheduling.predictor import prefill_sq

    model, report = profile(lambda n: _gpu_like(n), lambda b, c: _gpu_like(0, 0, b, c),
                            prefill_sizes=(16, 64, 256, 1024, 4096), batch_sizes=(1, 8, 64), ctx_lens=(128, 1024),
                            repeats=2, time_budget_s=1e9, run_chunk=lambda n, at: _gpu_like(n, prefill_sq(at, at + n)),
                            chunks=[(512, 8192), (2048, 30720)],
                            run_mixed=lambda n, b, c: _gpu_like(n, None, b, c), mixed=[(64, 16, 1024), (256, 64, 1024)])
    assert report["n_chunk"] == 4 and report["n_mixed"] == 2 and report["mixed"] == model.mixed == "shared"
    q = prefill_sq(30720, 32768)
    assert model.prefill_ms(2048, q) == pytest.approx(_gpu_like(2048, q), rel=0.02)


def test_a_gpu_profile_asks_for_chunks_hybrid_steps_and_the_ladder_and_a_cpu_profile_for_neither(tmp_path,
                                                                                                  monkeypatch):
    """`engine.profiling._profile` on CUDA: chunks over a cached prefix within the window and the cache, hybrid steps
    whose prompt and decodes fit the seats and the cache, the backend's token ladder; on a CPU, its fit as before."""
    from types import SimpleNamespace

    from engine import profiling

    asked: list[dict] = []
    monkeypatch.setattr(LatencyModel, "save", lambda self, path: None)
    monkeypatch.setattr(profiling, "profile", lambda *a, **k: (asked.append(k), (LatencyModel(), {}))[1])
    prober = SimpleNamespace(prefill=lambda n: 1.0, decode=lambda b, n: 1.0, chunk=lambda n, at: 1.0,
                             mixed=lambda n, b, c: 1.0)
    monkeypatch.setattr(profiling, "Prober", lambda engine: prober)

    def engine(device: str, window: int, tokens: int, seqs: int):
        sched = SimpleNamespace(prefill_max_tokens=2048, max_num_seqs=seqs)
        return SimpleNamespace(max_model_len=window, cache=SimpleNamespace(num_blocks=tokens // 16, block_size=16),
                               bundle=SimpleNamespace(device=SimpleNamespace(type=device)),
                               config=SimpleNamespace(scheduler=sched, serves_lora=False),
                               backend=SimpleNamespace(token_ladder=lambda: (16, 32, 512)))

    profiling._profile(engine("cuda", 32768, 400_000, 256), 1.0, {"m": 1}, tmp_path / "p.json")
    k = asked.pop()
    assert k["run_chunk"] is prober.chunk and k["run_mixed"] is prober.mixed and k["token_ladder"] == (16, 32, 512)
    assert k["chunks"] and all(at >= n and at + n <= 32767 and at % 16 == 0 for n, at in k["chunks"])
    assert {n for n, _ in k["chunks"]} == {512, 2048} and max(at for _, at in k["chunks"]) >= 30000
    assert k["mixed"] and all(b + 1 <= 256 for _, b, _ in k["mixed"])  # (a hybrid step of 257 rows never runs)
    profiling._profile(engine("cuda", 4096, 20_000, 64), 1.0, {"m": 1}, tmp_path / "p.json")  # a small cache
    k = asked.pop()
    assert all(at + n <= 4095 for n, at in k["chunks"])
    assert all(n + b * (2 * ctx + 16) <= 20_000 and b + 1 <= 64 for n, b, ctx in k["mixed"])
    profiling._profile(engine("cpu", 4096, 20_000, 64), 1.0, {"m": 1}, tmp_path / "p.json")
    k = asked.pop()
    assert (k["run_chunk"], k["chunks"], k["run_mixed"], k["mixed"], k["token_ladder"]) == (None, [], None, [], ())
