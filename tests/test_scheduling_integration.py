"""The scheduler in the real worker loop (embedded tiny model): TPOT guard under a strict/loose mix, TTFT guard."""
import statistics

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from core.request import SLO
from core.sampling import SamplingParams
from scheduling.config import SchedulerConfig

# Measured TPOT may exceed the SLO by this factor, plus an absolute allowance, before the test fails: the gate
# predicts from a fitted latency model and the 2-core test box is noisy (GC pauses, the idle Ray cluster of the
# session's serve tests). The hiccups are absolute, not proportional to a step of the tiny model, hence the
# allowance beside the factor.
TPOT_TOLERANCE = 1.5
TPOT_NOISE_MS = 5.0


@pytest.fixture(scope="module")
def fit_path(tmp_path_factory):
    """Profile afresh (not a cached fit from another time): the gate must predict this machine, now. The first
    engine fits; the second (the same model, dtype and threads, another policy) loads that fit."""
    return str(tmp_path_factory.mktemp("fit") / "latency.json")


@pytest.fixture(scope="module", params=["scorpio", "kairos"])
def engine(request, fit_path):
    fit = fit_path
    eng = LLMEngine(EngineConfig(model="kairos-tiny", dtype="float32", device="cpu",
                                 scheduler=SchedulerConfig(policy=request.param, max_num_seqs=96,
                                                           predictor_path=str(fit))))
    yield eng
    eng.shutdown()


def _drain(stream):
    ids, last = [], None
    for last in stream:
        ids.extend(last.token_ids)
    return ids, last


def _strict_and_loose(engine) -> tuple[dict[str, list[float]], list[str], float]:
    """80 requests at once, every other one at a strict TPOT SLO and the rest at 4x it: the TPOTs served of each
    kind (ms), the rejection reasons, the strict SLO."""
    pred = engine.latency_model
    strict = max(4.0 * pred.itl_ms(1, 64), 3.0)   # a handful of requests fit at this TPOT, not all
    loose = 4.0 * strict
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    streams = []
    for i in range(80):
        slo = SLO(tpot_ms=strict if i % 2 == 0 else loose)
        streams.append((slo, engine.add_request([7 + i % 50] * 32, params, slo)))
    served: dict[str, list[float]] = {"strict": [], "loose": []}
    reasons = []
    for slo, s in streams:
        ids, last = _drain(s)
        kind = "strict" if slo.tpot_ms == strict else "loose"
        if last.finish_reason == "rejected":
            reasons.append(last.reject_reason)
            continue
        assert last.finish_reason == "length" and len(ids) == 48
        served[kind].append(last.metrics.tpot_s * 1000.0)
    return served, reasons, strict


def test_strict_requests_meet_tpot_and_loose_ones_yield(engine):
    # One rerun where a strict request was late: the gate predicts from a fit and cannot foresee a stall of the
    # shared box (a fresh-clone CI run saw one, the rest of the suite passing); a gate that admits too much is late
    # in both runs.
    # credit batching: a loose request (TRP 1/4) is decoded less often than a strict one while both run (without
    # credits both would step alike, a ratio of ~1). How much less depends on how many strict ones the gate lets in
    # and how long both run together, so the bound leaves room below what single runs of kairos and scorpio showed
    # (once, on the 2-core box, every request of a round stepped alike, a ratio of 1.06: a rerun for it too)
    for attempt in range(2):
        if attempt:  # (timed again first: the box's load now, where the fit was timed while the neighbour was quiet)
            engine.reprofile(time_budget_s=4.0)
        served, reasons, strict = _strict_and_loose(engine)
        late = [t for t in served["strict"] if t > strict * TPOT_TOLERANCE + TPOT_NOISE_MS]
        yields = bool(served["strict"] and served["loose"]) \
            and statistics.median(served["loose"]) > 1.2 * statistics.median(served["strict"])
        if not late and yields:
            break
    assert served["strict"] and served["loose"]
    assert set(reasons) <= {"tpot_unattainable"}
    assert not late, (late, strict)
    assert yields, (served, strict)


def test_unattainable_ttft_is_rejected_with_reason(engine):
    out = list(engine.add_request([5] * 64, SamplingParams(max_tokens=4), SLO(ttft_ms=0.001)))
    assert len(out) == 1 and out[0].finish_reason == "rejected" and out[0].reject_reason == "ttft_unattainable"
    # a rejection says the reply length its admission was planned for (the replica's idle floor plans for it too):
    # kairos's predicted length (capped by max_tokens), max_tokens where nothing else ends the reply (ignore_eos) or
    # without a predictor (scorpio)
    kairos = engine.scheduler.lengths is not None
    planned = [list(engine.add_request([5] * 64, SamplingParams(max_tokens=900, ignore_eos=eos),
                                       SLO(ttft_ms=0.001)))[-1].planned_output_len for eos in (False, True)]
    assert planned[1] == 900 and (1 <= planned[0] < 900 if kairos else planned[0] == 900), planned
    ok = list(engine.add_request([5] * 64, SamplingParams(max_tokens=4, temperature=0.0), SLO(ttft_ms=60_000)))
    assert ok[-1].finish_reason in ("stop", "length")


def test_best_effort_is_never_rejected(engine):
    streams = [engine.add_request([9] * 100, SamplingParams(max_tokens=8, temperature=0.0)) for _ in range(30)]
    assert all(_drain(s)[1].finish_reason in ("stop", "length") for s in streams)


def test_kairos_predicts_lengths_on_the_tokenizer_its_predictor_counts_in(engine):
    """kairos-tiny's tokenizer is the shipped length predictor's (its fingerprint, passed by the engine): kairos runs
    with the predictor and ranks by work; scorpio's preset leaves the predictor off."""
    on = engine.config.scheduler.policy == "kairos"
    assert (engine.scheduler.lengths is not None) is on
    assert engine.scheduler.flags.short_first is on and (engine.scheduler.shedder is not None) is on
