"""Scheduler configuration: every knob of the seeds and of SCORPIO, validated, with policy presets."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PolicyName = Literal["fcfs", "pack", "edf", "edf_reject", "tpot_guard", "scorpio", "kairos"]
POLICIES: tuple[str, ...] = ("fcfs", "pack", "edf", "edf_reject", "tpot_guard", "scorpio", "kairos")


@dataclass(frozen=True, slots=True)
class PolicyFlags:
    """The mechanisms a policy switches on (a preset, then the config's explicit overrides)."""

    queue_order: Literal["fifo", "ldf"] = "fifo"
    admission: Literal["fifo", "pack"] = "fifo"
    force_fifo_every: int = 0
    ttft_reject: bool = False
    sort_before_reject: bool = False
    credit_batching: bool = False
    vbs_gate: bool = False
    monotone_skip: bool = False
    hybrid_steps: bool = False
    itl_correction: bool = False
    tier_floor: bool = False
    pace_guard: bool = False
    work_shedding: bool = False
    catch_up: bool = False
    prefill_hold: bool = False
    short_first: bool = False
    measured_margin: bool = False
    impatient_reserve: bool = False
    pace_work: bool = False
    fill_steps: bool = False
    pace_slack: bool = False
    urgent_first: bool = False
    length_predictor: bool = False
    # with the length predictor: its lengths scaled by the served replies' over its own (LengthCalibration)
    length_calibration: bool = False
    # the mean context the VBS gate predicts a candidate's steps at (SchedulerConfig.gate_context)
    gate_context: Literal["batch", "horizon"] = "batch"
    # with the length predictor: the VBS gate admits against this quantile of a fresh request's predicted length
    # distribution (0: against the expected length, as everything else plans)
    length_gate_quantile: float = 0.0
    vbs_margin: float = 1.3  # k of the VBS gate: ITL(VBS, L) * k < slack * T_min (SCORPIO's published 1.3)


PRESETS: dict[str, PolicyFlags] = {
    "fcfs": PolicyFlags(),
    "pack": PolicyFlags(admission="pack", force_fifo_every=8),
    "edf": PolicyFlags(queue_order="ldf"),
    "edf_reject": PolicyFlags(queue_order="ldf", ttft_reject=True),
    "tpot_guard": PolicyFlags(credit_batching=True, vbs_gate=True),
    "scorpio": PolicyFlags(queue_order="ldf", ttft_reject=True, credit_batching=True, vbs_gate=True),
    # kairos corrects the gate with a bounded factor measured on the steps it runs (ItlCorrection), so its static
    # margin only has to cover what that measurement misses (1.05: more goodput than 1.1 on ShareGPT, TPOT still met;
    # 1.0 let misses through). It predicts reply lengths from the prompt (length_predictor: where the predictor counts
    # in the served model's tokens, Scheduler) and, with those lengths, spends its capacity on the least work: a
    # fresh request the VBS gate turns away waits within its TTFT SLO instead of being rejected, and the waiting
    # queue gets room least work first (short_first); under overload the fresh requests with the most work are
    # turned away before they reach the gate (work_shedding). Without length information (no predictor) work is
    # max_tokens / TPOT, a ranking by tier, and the Scheduler leaves these two off unless a config sets them.
    # Its gate plans for the predicted mean, as everything else. Its TTFT margin is measured on its own admissions
    # (measured_margin: ttft_guard.MeasuredMargin), SCORPIO's a fixed 50 ms. Work is the machine time a request
    # takes at its pace, and what a faster pace costs the batch (pace_work: shedding.PaceCost). Credits skip a
    # request only to keep a step within the gate's plan (fill_steps): where the step hardly grows with the batch,
    # paced replies would otherwise hold their seats for twice their TPOT (a GPU replica, whose seats then bind);
    # filling pauses after a paced reply misses its TPOT (steps at the plan leave a strict reply no room for stalls).
    # pace_slack (a reply ahead of its pace counted at the TPOT it still needs) is opt-in: the simulator gains with
    # it, but a paired run on the CPU box lost goodput and missed more TPOTs (bench/README).
    # With length information its waiting queue also minds TTFT deadlines: a request with seconds of TTFT slack leaves
    # room for one whose TTFT SLO is shorter than the time between finished replies (impatient_reserve), and when
    # room opens, the waiting requests whose deadline comes before the next room take it first (urgent_first).
    # Without it (no predictor) both stay off, as short_first: there they cost the patient tiers more than the
    # impatient one gained (bench/README). Its gate predicts a candidate's steps at SCORPIO's context (every running
    # reply grows by half the candidate's). gate_context "horizon" (a running reply grows only until it ends) is
    # opt-in: nearer the contexts the steps then have, and as much goodput or more in the simulator except with exact
    # lengths, but a paired bench.slo run on the 2-core CPU lost goodput with it in every length arm (bench/README).
    # Its predictions take the scale of the replies it served (length_calibration): the predictor learned ShareGPT's
    # reference replies, and a served model answers longer or shorter than they did (off on a GPU replica:
    # engine.config.GPU_SCHEDULER_DEFAULTS)
    "kairos": PolicyFlags(queue_order="ldf", ttft_reject=True, sort_before_reject=True, credit_batching=True,
                          vbs_gate=True, monotone_skip=True, hybrid_steps=True, itl_correction=True, pace_guard=True,
                          catch_up=True, prefill_hold=True, vbs_margin=1.05, length_predictor=True, short_first=True,
                          work_shedding=True, measured_margin=True, pace_work=True, fill_steps=True,
                          impatient_reserve=True, urgent_first=True, length_calibration=True),
}
_OVERRIDES = {f: f for f in PolicyFlags.__slots__} | {"admission": "prefill_admission_policy",
                                                      "force_fifo_every": "prefill_force_fifo_every"}


class SchedulerConfig(BaseModel):
    """Named, validated scheduler knobs. `None` on a mechanism knob means "as the policy says"."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "kairos"
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM's --scheduling-policy, beside `policy`: priority: a request's `priority` (an "
        "integer, lower first, 0 by default) ranks it before everything the policy weighs: the waiting queue is in "
        "priority order (the policy's order within each priority), no request is admitted while one of a lower "
        "value waits for room, and a full KV cache preempts the lowest priority first; fcfs: every request is of "
        "priority 0 (a client's value is accepted and has no effect, as vLLM's)")
    # capacity
    max_num_seqs: int = Field(64, gt=0, description="max running (admitted, unfinished) requests")
    max_waiting: int = Field(128, gt=0, description="queued requests beyond this are rejected (429): overloaded. "
                             "The default, 2 x the default max_num_seqs (512 on a GPU), bounds a burst's wait to "
                             "about two generations; set it beside a larger max_num_seqs")
    # seeds: pending-queue admission
    prefill_max_batch_size: int = Field(64, gt=0, description="requests per prefill round")
    prefill_max_tokens: int | None = Field(1024, gt=0, description="prompt-token budget per prefill round")
    chunked_prefill: bool = Field(False, description="split a prompt over several steps so that no step computes "
                                  "more than prefill_max_tokens of prompt (vLLM's chunked prefill); a prompt in "
                                  "progress goes first in each step's budget")
    enable_prefix_caching: bool = Field(True, description="keep each full block of computed tokens' KV for later "
                                        "requests that start with the same tokens (vLLM's automatic prefix caching: a "
                                        "shared system prompt or an earlier turn is computed once); blocks nobody "
                                        "holds stay cached until a request needs them")
    prefill_admission_policy: Literal["fifo", "pack"] | None = None
    prefill_admission_lookahead: int = Field(64, gt=0)
    prefill_force_fifo_every: int | None = Field(None, ge=0, description="every N-th round is FIFO (0: never)")
    # SCORPIO TTFT guard
    queue_order: Literal["fifo", "ldf"] | None = None
    ttft_reject: bool | None = None
    ttft_margin_ms: float = Field(50.0, ge=0, description="the TTFT guard's margin (ms): a waiting request is "
                                  "rejected once its prefill plus this no longer fits before its deadline. With "
                                  "measured_margin, the margin until enough admissions are measured")
    measured_margin: bool | None = Field(None, description="the TTFT guard's margin is a high quantile of the "
                                         "measured (first token - admission) - predicted prefill of the requests "
                                         "admitted lately, of about the request's predicted prefill or less "
                                         "(ttft_guard.MeasuredMargin; kairos)")
    ttft_margin_quantile: float = Field(0.99, gt=0, le=1, description="measured_margin: the quantile of those errors")
    ttft_margin_window_s: float = Field(60.0, gt=0, description="measured_margin: errors older than this (s) no "
                                        "longer count (a burst's errors do not outlive it on an idle replica)")
    sort_before_reject: bool | None = None
    # SCORPIO TPOT guard
    credit_batching: bool | None = None
    vbs_gate: bool | None = None
    vbs_margin: float | None = Field(None, gt=0, description="k in ITL(VBS, L) * k < slack * T_min (default: "
                                     "the policy's, 1.3 as SCORPIO published, 1.05 for kairos; on a GPU "
                                     "kairos's is 1.0: engine.config.GPU_POLICY_DEFAULTS)")
    vbs_slack: float = Field(0.99, gt=0, le=1)
    tpot_on_fail: Literal["reject", "hold"] = "reject"
    monotone_skip: bool | None = None
    best_effort_trp: float = Field(0.5, gt=0, le=1, description="decode rate of requests without a TPOT SLO")
    # step composition and the gate's correction
    hybrid_steps: bool | None = Field(None, description="decode running requests in the same forward as prefills")
    itl_correction: bool | None = Field(None, description="scale the gate's ITL by measured/predicted step time")
    correction_tau_ms: float = Field(2000.0, gt=0, description="window of the ITL correction (wall ms)")
    correction_idle_prior_ms: float = Field(1000.0, gt=0, description="the ITL correction of an idle replica (the "
                                            "steps of a request decoding alone) starts at the profile's 1, weighing "
                                            "as this much predicted decode time of them")
    correction_by_rows: bool = Field(False, description="the ITL correction measured per decode-rows bucket (powers "
                                     "of two) and applied to steps of that many rows, where the model errs "
                                     "differently by batch size; the factor over all steps while a bucket has few. "
                                     "Opt-in: on the 2-core CPU, whose few-row steps run slower than its fit, one "
                                     "paired run gave fewer TPOT misses at about the same goodput")
    correction_max: float = Field(2.5, ge=1, description="upper bound of the ITL correction factor")
    correction_stall_share: float = Field(1.0, ge=0, le=1, description="the share of the prefill stalls measured "
                                          "over the ITL correction's window that the VBS gate's factor counts: the "
                                          "factor runs from the model's error on the decode-only steps (0: the stalls "
                                          "are left to catch-up and the pace guard) to every step's wall time over "
                                          "the decode the steps predicted (1: the pace a reply decoded every step "
                                          "lives). A GPU replica's default is 0.5 (engine.config."
                                          "GPU_SCHEDULER_DEFAULTS; bench/README). A step's own plan (pace guard, "
                                          "fill, catch-up) scales the model by its decode-only error and adds the "
                                          "step's prefill itself")
    stall_share_target: float | None = Field(None, gt=0, lt=1, description="the stall share rises while the paced "
                                             "replies miss their TPOT: each that ends over its TPOT SLO raises it by "
                                             "stall_share_step x (1 - this), each within lowers it by "
                                             "stall_share_step x this, between correction_stall_share and 1, so that "
                                             "no more than about this share of them miss. A GPU replica's default is "
                                             "0.01 (engine.config.GPU_SCHEDULER_DEFAULTS; bench/README); None: the "
                                             "share stays as set")
    stall_share_step: float = Field(0.05, gt=0, le=1, description="stall_share_target: how far one reply moves "
                                    "the share")
    tier_floor: bool | None = Field(None, description="keep every TPOT tier that is feasible on an idle replica "
                                    "above a share of its admission decisions (scheduling/tier_floor.py)")
    pace_guard: bool | None = Field(None, description="decode a paced request its credit would skip when skipping "
                                    "would put its mean TPOT over its SLO, while the step's predicted time stays "
                                    "within T_min (tpot_guard.behind_pace)")
    fill_steps: bool | None = Field(None, description="with credit batching: a request its credit would skip "
                                    "decodes anyway while the step, one request larger, is still predicted within "
                                    "what the VBS gate plans a step at the strictest TPOT to take (work-conserving "
                                    "decode where the step hardly grows with the batch, as on a GPU); paused for "
                                    "fill_pause_s after a paced reply ends over its TPOT SLO")
    pace_slack: bool | None = Field(None, description="with credit batching and the VBS gate: a running reply "
                                    "ahead of its pace counts at the TPOT it still needs (its banked time spread "
                                    "over the tokens it is expected to have left; tpot_guard.paced_tpot_ms) instead "
                                    "of its SLO's, in its credits and in the gate, so that the room it leaves goes "
                                    "to a fresh request. Opt-in: more goodput in bench.sim, less and more TPOT misses "
                                    "in a paired bench.slo run on a 2-core CPU, where steps drift")
    pace_slack_share: float = Field(0.5, ge=0, le=1, description="pace_slack: the share of a reply's banked time the "
                                    "gate and its credits may spend (the TPOT it counts at: its SLO's + this x (paced "
                                    "- SLO's)); the rest stays as a buffer for steps longer than planned")
    fill_pause_s: float = Field(10.0, ge=0, description="fill_steps pauses this long after a paced reply ends "
                                "over its TPOT SLO: filled steps leave a strict reply no room for a stall")
    tier_floor_share: float = Field(0.3, ge=0, le=1, description="a TPOT tier admitted in less than this share "
                                    "of its recent admit/reject decisions is starved")
    tier_floor_window_s: float = Field(10.0, gt=0, description="window of the tier shares (seconds)")
    tier_floor_mode: Literal["reserve", "hold", "both"] = Field(
        "both", description="reserve: keep VBS room for a starved tier; hold: drain the batch for its request")
    work_shedding: bool | None = Field(None, description="under overload, shed the fresh requests with the most "
                                       "work (expected output tokens / TPOT SLO) first, so that what the replica "
                                       "can decode goes to as many requests as fit (scheduling/shedding.py; on in "
                                       "the kairos preset, off in the others)")
    catch_up: bool | None = Field(None, description="leave out of a step the requests ahead of their pace when "
                                  "a request behind its TPOT needs a shorter step (tpot_guard.trim_for_catch_up)")
    prefill_hold: bool | None = Field(None, description="keep a fresh prompt waiting while the step it would make "
                                      "would end after a running reply's next token is due and its TTFT deadline "
                                      "leaves room to wait (tpot_guard.hold_prefill); a best-effort prompt (no "
                                      "deadline to wait against) admitted beside running replies is instead "
                                      "computed in chunks of at most prefill_max_tokens, each within such a step, "
                                      "at least a block a step (Scheduler._best_effort_end)")
    prefill_hold_replies: int = Field(0, ge=0, description="with prefill_hold: a fresh prompt whose TTFT deadline "
                                      "leaves no room to wait is held anyway when the step it would make would "
                                      "bring at least this many running paced replies' next tokens late (more "
                                      "replies put behind their TPOT than the one prompt served; it then waits "
                                      "for room, and the TTFT guard rejects it once its deadline is out of reach; "
                                      "only with ttft_reject, which bounds that wait); "
                                      "0: its deadline always wins (on a GPU replica 3: "
                                      "engine.config.GPU_SCHEDULER_DEFAULTS)")
    short_first: bool | None = Field(None, description="opt-in: a fresh request the VBS gate turns away waits "
                                     "(while its TTFT SLO allows) instead of being rejected, and the waiting queue "
                                     "is offered room least work first: expected output tokens left / TPOT SLO "
                                     "(queues.order_least_work)")
    impatient_reserve: bool | None = Field(None, description="a fresh request whose TTFT deadline is further away "
                                           "than the measured time between finished replies is admitted only if the "
                                           "VBS gate would still pass a typical request whose TTFT SLO is shorter "
                                           "than that; else it waits (scheduling/reserve.py). kairos's with length "
                                           "information (its short_first queue holds the waiting ones)")
    urgent_first: bool | None = Field(None, description="with short_first: the waiting fresh requests whose TTFT "
                                      "deadline comes before the next room is expected (the measured time between "
                                      "finished replies: reserve.py) are offered room before the others, least work "
                                      "first among them (queues.order_least_work); kairos's with length information")
    impatient_window_s: float = Field(10.0, gt=0, description="window of the finishes and arrivals it measures (s)")
    pace_work: bool | None = Field(None, description="work shedding and least-work order weigh a request by the "
                                   "machine time it takes (shedding.PaceCost): its tokens at the pace it decodes "
                                   "at, and, if it would set a faster pace for the batch, the throughput the others "
                                   "lose meanwhile; instead of tokens / TPOT SLO")
    shed_target: float = Field(1.0, gt=0, description="shed above the work at which the lighter arrivals offer "
                               "this multiple of the work per second measured while saturated")
    shed_window_s: float = Field(20.0, gt=0, description="window of the arrivals' works (seconds)")
    shed_pace_factor: float = Field(1.0, gt=0, le=1, description="work shedding: a fresh request whose TPOT would "
                                    "set a faster pace for the whole batch is shed above this share of the "
                                    "threshold (shedding.sheds)")
    correction_safety: float = Field(1.0, ge=1, description="multiplies the measured factor f; the gate "
                                     "uses k * f when f < 1, else max(k, f) (k = vbs_margin); 1.0 did best on the "
                                     "SLO benchmark")
    predictor_path: str | None = None
    # reply lengths (scheduling/length_predictor.py)
    length_predictor: bool | None = Field(None, description="predict each request's reply length from its prompt "
                                          "at admission (Request.predicted_len): the expected length everywhere the "
                                          "scheduler plans with one (VBS gate, work estimates, least-work order, "
                                          "pace) is then the client's output-length hint if given, else the "
                                          "prediction capped by max_tokens, else max_tokens")
    ignore_eos_length: bool = Field(True, description="with the length predictor: a request that nothing but "
                                    "max_tokens ends (ignore_eos with no stop strings or stop_token_ids, or "
                                    "min_tokens = max_tokens) is planned for exactly max_tokens, its length, "
                                    "instead of a prediction. Off for a benchmark that forces its replies' lengths "
                                    "with ignore_eos and ends them itself (bench.slo's hidden and predicted arms)")
    length_predictor_path: str | None = Field(None, description="the predictor's .npz (default: the one shipped in "
                                              "the package, trained on ShareGPT in kairos-tiny's tokens, and on "
                                              "another model the shipped words-only one, bound to its tokenizer; a "
                                              "words-only file given here is bound likewise)")
    length_predictor_quantile: float | None = Field(None, gt=0, lt=1, description="plan everywhere for this "
                                                    "quantile of the predicted length distribution instead of its "
                                                    "mean (and its mean above the tokens out so far)")
    gate_context: Literal["batch", "horizon"] | None = Field(None, description="the mean context the VBS gate "
                                                             "predicts a candidate's steps at: batch (SCORPIO's: "
                                                             "every running reply grows by half the candidate's "
                                                             "reply) or horizon (each by half of what it has left or "
                                                             "of the candidate's reply, whichever is less; opt-in, "
                                                             "bench/README)")
    length_calibration: bool | None = Field(None, description="with the length predictor: scale its lengths by "
                                            "the served replies' over what it expected of them "
                                            "(length_predictor.LengthCalibration; kairos's): a served model that "
                                            "answers shorter or longer than ShareGPT's references did")
    length_calibration_half_life: float = Field(200.0, gt=0, description="length_calibration: the replies over "
                                                "which a reply's weight halves")
    length_gate_quantile: float | None = Field(None, ge=0, lt=1, description="with the length predictor: the VBS "
                                               "gate admits a fresh request against this quantile of its predicted "
                                               "length distribution (a conservative bound: a reply longer than "
                                               "planned slows the whole batch), while work estimates, order and pace "
                                               "use the expected length; 0: the expected length there too")
    bench_stop: bool = Field(False, description="BENCHMARK ONLY: honour Request.bench_stop_after, a reply length "
                             "the benchmark sets in-process and no policy reads (bench.slo --lengths hidden|"
                             "predicted). Off in serving")

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if self.prefill_max_batch_size > 4096:
            raise ValueError("prefill_max_batch_size is unreasonably large (> 4096)")
        return self

    @property
    def by_priority(self) -> bool:
        """Whether requests are ranked by their priority (vLLM's scheduling_policy "priority")."""
        return self.scheduling_policy == "priority"

    def flags(self) -> PolicyFlags:
        """The policy's preset with every explicitly set knob applied."""
        preset = PRESETS[self.policy]
        set_ = {flag: getattr(self, knob) for flag, knob in _OVERRIDES.items() if getattr(self, knob) is not None}
        return replace(preset, **set_)
