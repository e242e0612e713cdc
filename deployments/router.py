"""SLO-aware request router for `LLMServer` (Ray Serve `RequestRouter`, an *alpha* API pinned to ray 2.60).

Runs inside every caller of the LLM deployment (the ingress replicas). For a `generate` request it reads the
SLO (and the replicas to avoid, where one turned it away already) from the `GenerateRequest`
(`pending_request.args[0]`) and, per replica, combines
  * the replica's `record_routing_stats()` (every `request_routing_stats_period_s`, 1 s by default):
    predicted TTFT for a ~median prompt and for a 1-token prompt (queue-ahead), VBS, strictest running TPOT
    SLO, decode step time (and the batch it was measured on), its VBS gate as a line in the batch (where it
    has one: a TPOT SLO looks attainable where the replica's own gate would admit the request), free KV blocks;
  * this router's own in-flight requests per replica (`on_request_routed` / `on_request_completed`, and the
    calls it chose a replica for that are not routed yet, so that requests arriving together spread), fresh
    between reports: requests routed since the last report add their predicted prefill time and their share of
    the batch, and the strictest TPOT SLO in flight counts as running. With several ingress replicas a report
    counts every router's calls: each counts its own since the report was taken, less its own in it that have
    ended since (a replica's clock is read against this process's through the lag of its reports, not taken as
    agreeing). Each report also corrects the count: calls it shows ended are dropped (`SLORouter._reconcile`), and
    a chosen call never routed stops counting after `CHOSEN_TTL_S`. A report that cannot be read (a key missing or
    of the wrong type) is no report; keys this version does not know are left out (a newer replica's).
Ranking: replicas where every SLO of the request looks attainable come first, most slack first; then the
rest, least loaded first. Replicas that turned the request away already (`GenerateRequest.avoid_replicas`, set
by the ingress when it reroutes) come last, and so do, until their next report, replicas that turned away a
request as strict (`refusals.note_refusal`, called by the ingress on every refusal it sees). The replicas whose
engine reported itself dead, those that stopped reporting (`Silence`: a stopped process or a partition, which Serve
replaces only after its health check has timed out three times) and those whose engine failed this request
(`GenerateRequest.failed_replicas`: its death reaches this router only with the next report) are left out where
another is there (a dead engine fails a request at once, a silent replica holds it: while the live ones are full,
Serve queues it for them, backing off between tries), else last. Each replica is its own rank, so Ray falls through
to the next one when the best is at `max_ongoing_requests`. Other methods (`stats`, ...) are spread uniformly at
random, dead and silent replicas last.
Prefix affinity (each replica keeps the prompts it served in its prefix cache): among the replicas whose slack is
within `AFFINITY_SLACK` of the best one's (best effort: whose load is within `AFFINITY_LOAD` of the least loaded),
the one this router last sent the longest prefix of the request's prompt (`prefix_keys`: its text cut at 256, 512,
1,024 ... characters) goes first, as Ray Serve LLM's PrefixCacheAffinityRouter does within its load imbalance bound.
Pace affinity (each TPOT tier first where it already sets the batch's pace) was tried twice and removed (git
history): ranking by slack already sends most strict requests to one replica, and affinity only cost the
interactive tier its TTFT.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from core.messages import GenerateRequest, ProtocolError, RejectReason, RoutingStats
from core.request import SLO
from deployments import refusals
from scheduling.predictor import prefill_time_ms

log = logging.getLogger("ray.serve")
# a call chosen this long ago and never routed was cancelled (a live one is chosen again at least every
# RAY_SERVE_ROUTER_RETRY_MAX_BACKOFF_S, 0.5 s, until a replica accepts it): stop counting it
CHOSEN_TTL_S = 5.0
ENDED_EARLY_KEEP = 4096  # calls remembered as ended before they were routed (kept for CHOSEN_TTL_S)
REPORT_LAG_S = 1.0  # a call routed this shortly before a replica's report may not be in it yet (transit, clocks)
# how fast the estimate of a replica's clock against this process's may rise per report (`SLORouter._reconcile`: the
# least lag seen, so that a replica's clock set back is followed, slowly)
OFFSET_CREEP_S = 0.01
ENDED_KEEP = 4096  # calls ended lately, per replica, kept to tell which of them a report (taken before) counted
REFUSED_TTL_S = 2.0  # a replica that turned a request away is passed over for as strict ones at most this long
# a replica whose last report is this much older than the freshest one of the others has stopped answering (a stopped
# process, a network partition: Serve's health check replaces it only after three timeouts, about 90 s)
SILENT_S = 15.0
PREFIX_CHARS = 256  # the shortest prefix of a prompt's text the router remembers and matches (then twice as long ...)
PREFIX_MAX_CHARS = 1 << 18  # and the longest (a prompt's first 256 KiB of text, its first ids as such)
PREFIX_KEEP = 8192  # prefixes remembered per replica, the least recently sent forgotten first
AFFINITY_SLACK = 0.1  # a replica holding a longer prefix goes first if its slack is at most this much below the best
AFFINITY_LOAD = 2.0  # (a best-effort request: if its load is at most this many requests above the least loaded)


class Silence:
    """Which replicas stopped reporting (`quiet`): those whose last routing-stats report reached this router
    `SILENT_S` (or three intervals between reports, where that is longer: a long `routing_stats_period_s`) before
    the freshest of the others' (the controller asks every replica each period and keeps a replica's last answer
    while it gets none). Timed on this process's clock as the reports change, since a replica on another node
    stamps its reports on a clock that need not agree with the others' by seconds; a replica first seen is as old as
    its report against the freshest one."""

    def __init__(self) -> None:
        # replica -> (its report's ts, when it changed here, the interval between its last two reports' ts)
        self._seen: dict[ReplicaID, tuple[float, float, float]] = {}

    def quiet(self, candidates: list[RunningReplica]) -> list[ReplicaID]:
        stamps = [(r.replica_id, (r.routing_stats or {}).get("ts")) for r in candidates]
        known = [(rid, float(t)) for rid, t in stamps if isinstance(t, (int, float)) and t > 0]
        if len(known) < 2:
            return []
        now, newest = time.monotonic(), max(t for _, t in known)
        for rid, ts in known:
            got = self._seen.get(rid)
            if got is None:
                self._seen[rid] = (ts, now - (newest - ts), 0.0)
            elif got[0] != ts:
                self._seen[rid] = (ts, now, ts - got[0])
        if len(self._seen) > 4 * len(known):  # (replicas gone: forgotten)
            ids = {rid for rid, _ in known}
            self._seen = {rid: v for rid, v in self._seen.items() if rid in ids}
        heard = [self._seen[rid] for rid, _ in known]
        latest = max(at for _, at, _ in heard)
        # (the period is the deployment's, every replica's: the longest interval seen stands for those not seen twice)
        limit = max(SILENT_S, 3 * max(every for _, _, every in heard))
        return [rid for (rid, _), (_, at, _) in zip(known, heard) if latest - at > limit]


def answering(r: RunningReplica, quiet: list[ReplicaID]) -> bool:
    """Whether `r` can serve, as far as the router knows: its engine is not reported dead, and it still reports."""
    return r.replica_id not in quiet and (r.routing_stats or {}).get("alive", True)


def refused_for(slo: SLO, old: SLO, reason: str, priority: int = 0, old_priority: int = 0) -> bool:
    """Whether a request of `slo` would likely be turned away too where one of SLO `old` was, for `reason` (a
    RejectReason value): a TPOT refusal for a TPOT SLO as strict or stricter, a TTFT refusal for a TTFT SLO as
    tight or tighter; a shed for any request with an SLO; a full queue for any request (one without an SLO too).
    Never, but for a TPOT refusal (the VBS gate judges each request alone), for a request of a lower `priority`
    value than the one turned away: priority scheduling queues it first, and sheds or turns away the other first."""
    if reason == RejectReason.TPOT_UNATTAINABLE:
        return slo.tpot_ms is not None and old.tpot_ms is not None and slo.tpot_ms <= old.tpot_ms
    if priority < old_priority:
        return False
    if reason == RejectReason.TTFT_UNATTAINABLE:
        return slo.ttft_ms is not None and old.ttft_ms is not None and slo.ttft_ms <= old.ttft_ms
    return reason == RejectReason.OVERLOADED or slo.ttft_ms is not None or slo.tpot_ms is not None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router believes about one replica right now."""

    load: float  # requests running + waiting (max of the stats report and our in-flight count)
    pred_ttft_ms: float | None  # for this request's prompt length, None when the replica reported no model
    itl_ms: float | None  # projected inter-token latency with this request added (the measured step, scaled)
    strictest_tpot_ms: float | None
    kv_free: float
    # the replica's VBS gate as a line (RoutingStats.gate_base_ms / gate_row_ms), None where it reported none; and
    # the batch it would judge: the running requests' sum of 1 / TPOT and best-effort share as reported, and the
    # requests not in its batch yet (waiting there, or routed here since the report), counted 1 each
    gate: tuple[float, float] | None = None
    tpot_inv_sum: float = 0.0
    best_effort_share: float = 0.0
    queued: float = 0.0
    alive: bool = True  # False once the replica reports its engine dead (until Serve replaces the replica)

    def itl_with(self, tpot_ms: float | None, t_min_ms: float) -> float | None:
        """The inter-token latency to hold against `t_min_ms` (the stricter of this request's TPOT SLO and the
        batch's) with this request added: where the replica reports its gate line, that line at the batch's virtual
        size as the gate counts it (a paced request at t_min / its TPOT, a best-effort one at the replica's share),
        the queued requests and a request without a TPOT SLO at 1; else the measured step scaled to the batch
        (`itl_ms`)."""
        if self.gate is None:
            return self.itl_ms
        base, row = self.gate
        batch = t_min_ms * (self.tpot_inv_sum + (1.0 / tpot_ms if tpot_ms else 0.0)) + self.best_effort_share \
            + self.queued + (0.0 if tpot_ms else 1.0)
        return base + row * batch


def generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    """The `GenerateRequest` of a `generate` call, None for other methods."""
    if pending is None or getattr(pending.metadata, "call_method", "") != "generate":
        return None
    req = pending.args[0] if pending.args else pending.kwargs.get("req")
    if not isinstance(req, GenerateRequest):
        raise ProtocolError(f"generate() takes a GenerateRequest, got {type(req).__name__}")
    return req


def prefix_keys(req: GenerateRequest) -> list[int]:
    """The request's prompt (its text, token ids, or chat turns after what its chat template shows first: the tools,
    documents, template arguments and a template of its own; after its LoRA adapter and cache_salt, where it gives
    them) cut at PREFIX_CHARS
    characters, twice that, and so on up to PREFIX_MAX_CHARS, each hashed: the longest first."""
    if req.messages is not None:
        o = req.options
        kwargs = json.dumps(o.chat_template_kwargs, sort_keys=True, default=str) if o.chat_template_kwargs else ""
        text = "\x00".join([o.chat_template or "", o.tools or "", o.documents or "", kwargs] + [
            f"{t.role}\x01{t.name or ''}\x01{t.content}\x01{t.tool_calls or ''}" for t in req.messages])
    elif isinstance(req.prompt, str):
        text = req.prompt
    else:
        text = ",".join(map(str, (req.prompt or ())[:PREFIX_MAX_CHARS // 2]))
    text = text[:PREFIX_MAX_CHARS]
    if req.lora is not None or req.cache_salt is not None:  # only requests of its adapter and salt share its KV
        text = f"{req.lora or ''}\x02{req.cache_salt or ''}\x02{text}"
    keys, k = [], PREFIX_CHARS
    while k <= len(text):
        keys.append(hash(text[:k]))
        k *= 2
    if req.lora is not None:  # last: a replica that ran the adapter holds it loaded (Ray Serve LLM's multiplexing)
        return keys[::-1] + [hash(f"\x03lora\x03{req.lora}")]
    return keys[::-1]


def prefix_match(keys: list[int], held: OrderedDict[int, None] | None) -> int:
    """How many of `keys` (`prefix_keys`) the prefixes `held` begin with: 0 for none, len(keys) for all."""
    if held:
        for i, key in enumerate(keys):
            if key in held:
                return len(keys) - i
    return 0


def view(report: RoutingStats | dict[str, Any] | None, inflight: int, prompt_tokens: int,
         inflight_tpot_ms: float | None = None, fresh: int | None = None) -> ReplicaView:
    """What to believe about a replica: its last `RoutingStats` report (None or {} before the first) plus the
    requests this router sent it since (`inflight`: this router's calls in flight there, and the strictest TPOT SLO
    among them). The arrivals the report does not show: `inflight` less the report's count, which holds where this
    router is the replica's only caller (one ingress replica: it is 0 where several call it), and at least `fresh`:
    this router's calls there that the report cannot count (routed since it was taken) less its calls the report
    counts that have ended since (`SLORouter._reconcile`)."""
    if not report:
        return ReplicaView(load=float(inflight), pred_ttft_ms=None, itl_ms=None, strictest_tpot_ms=inflight_tpot_ms,
                           kv_free=math.inf)
    st = report if isinstance(report, RoutingStats) else RoutingStats.from_dict(report)
    reported = float(st.inflight)
    extra = max(0.0, inflight - reported, float(fresh or 0))  # arrivals the report does not show
    q_ms, m_ms = st.predicted_queue_ms, st.predicted_ttft_ms
    pred = None
    terms = (st.prefill_c0_ms, st.prefill_theta, st.prefill_alpha_ms, st.prefill_beta_ms)
    if None not in terms and q_ms is not None:
        # the replica's own model (`prefill_time_ms`): its waiting prompts, each unreported arrival as a ~median one,
        # then this one, as the replica's `predict_ttft_ms` sums them
        m, n = max(st.median_prompt_tokens, 1), max(prompt_tokens, 1)
        pred = prefill_time_ms(st.waiting_tokens + extra * m + n, st.waiting_sq + extra * m * m + float(n) * n,
                               *terms, max(st.prefill_sq_ms, 0.0))  # type: ignore[arg-type]
    elif q_ms is not None and m_ms is not None:  # (a replica that reports no model's terms: the line through two)
        # q_ms and m_ms are the model at 1 and `median` prompt tokens, the queue included: alpha·n + gamma·n² above
        # the 1-token point, with gamma reported (a prompt's attention) and alpha the line left between the two
        median, gamma = max(st.median_prompt_tokens, 1), max(st.prefill_sq_ms, 0.0)
        per_tok = max(0.0, (m_ms - q_ms - gamma * (median * median - 1)) / max(median - 1, 1))
        prefill_ms = max(m_ms - q_ms, 0.0)  # one ~median request's prefill, for each unreported arrival
        n = max(prompt_tokens, 1)
        pred = q_ms + per_tok * (n - 1) + gamma * (n * n - 1) + extra * prefill_ms
    running = float(st.num_running) + extra
    vbs = max(st.vbs, running)
    # the step time belongs to the batches it was measured on: scale it to the batch now plus the arrivals not
    # yet in a report plus this request (scaling by (vbs + 1) / vbs made every unreported arrival *raise* the slack)
    proj_itl = None if st.itl_ms is None else st.itl_ms * (vbs + 1.0) / max(st.step_batch or 1.0, 1.0)
    strictest = min((t for t in (st.strictest_tpot_ms, inflight_tpot_ms) if t is not None), default=None)
    gate = None if st.gate_base_ms is None or st.gate_row_ms is None else (st.gate_base_ms, st.gate_row_ms)
    return ReplicaView(load=max(float(st.queue_len), reported) + extra, pred_ttft_ms=pred, itl_ms=proj_itl,
                       strictest_tpot_ms=strictest, kv_free=float(st.kv_blocks_free), gate=gate,
                       tpot_inv_sum=st.tpot_inv_sum, best_effort_share=st.best_effort_share,
                       queued=st.num_waiting + extra, alive=st.alive)


def slack(v: ReplicaView, slo: SLO) -> float | None:
    """Smallest relative slack over the request's SLOs (>= 0 attainable); None when unknown/not attainable."""
    slacks: list[float] = []
    ttft, tpot = slo.ttft_ms, slo.tpot_ms
    if ttft is not None:
        if v.pred_ttft_ms is None:
            return None
        slacks.append((ttft - v.pred_ttft_ms) / ttft)
    limits = [x for x in (tpot, v.strictest_tpot_ms) if x is not None]
    if limits:  # adding this request must keep every running TPOT SLO
        tightest = min(limits)
        itl = v.itl_with(tpot, tightest)
        if itl is not None:
            slacks.append((tightest - itl) / tightest)
        elif tpot is not None:  # its own TPOT SLO and nothing to check it against (no report yet): unknown, as
            return None  # a TTFT SLO is there, not infinite slack (a new replica took every TPOT request first)
    if not slacks:
        return math.inf  # no SLO (or nothing to check it against): every replica is fine
    s = min(slacks)
    return s if s >= 0 else None


def rank(candidates: list[RunningReplica], views: dict[ReplicaID, ReplicaView], slo: SLO,
         avoid: tuple[str, ...] = (), affinity: dict[ReplicaID, int] | None = None) -> list[RunningReplica]:
    """Replicas best first (see the module docstring); the ones in `avoid` (by unique id: they turned this request
    away already) last, in the same order among themselves, and after them the ones whose engine is dead (their
    report says so: Serve routes to them until their health checks fail, and they fail every request at once, which
    makes them look the least loaded). `affinity`: how much of the request's prompt each replica holds
    (`prefix_match`)."""
    dead = [r for r in candidates if not views[r.replica_id].alive]
    if dead:
        return rank([r for r in candidates if views[r.replica_id].alive], views, slo, avoid, affinity) + dead
    if avoid:
        ranked = rank(candidates, views, slo, affinity=affinity)
        return [r for r in ranked if r.replica_id.unique_id not in avoid] + \
            [r for r in ranked if r.replica_id.unique_id in avoid]
    shuffled = random.sample(candidates, len(candidates))  # random tie-break
    def load_key(r: RunningReplica) -> tuple[float, float, float]:
        v = views[r.replica_id]
        return (v.load, v.pred_ttft_ms if v.pred_ttft_ms is not None else 0.0, -v.kv_free)

    ok, rest = [], []
    for r in shuffled:
        s = slack(views[r.replica_id], slo)
        (ok if s is not None else rest).append((s, r))
    best_effort = slo.ttft_ms is None and slo.tpot_ms is None
    if best_effort:
        ok_sorted = sorted((r for _, r in ok), key=load_key)  # best effort: least loaded
    else:
        ok_sorted = [r for _, r in sorted(ok, key=lambda sr: (-min(sr[0], 1e9), load_key(sr[1])))]
    if affinity and len(ok_sorted) > 1:
        first = ok_sorted[0]
        held = max(ok_sorted, key=lambda r: affinity.get(r.replica_id, 0))  # (the best ranked of equals)
        if affinity.get(held.replica_id, 0) > affinity.get(first.replica_id, 0):
            slacks = {r.replica_id: min(s, 1e9) for s, r in ok}
            if views[held.replica_id].load <= views[first.replica_id].load + AFFINITY_LOAD if best_effort else \
                    slacks[held.replica_id] >= slacks[first.replica_id] - AFFINITY_SLACK:
                ok_sorted.remove(held)
                ok_sorted.insert(0, held)
    return ok_sorted + sorted((r for _, r in rest), key=load_key)


class SLORouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._silence = Silence()  # the replicas that stopped reporting
        # per replica, the TPOT SLOs (None: none) of the generate calls this router has in flight there: their
        # count is its in-flight load, their minimum its strictest pace before the next report
        self._inflight: dict[ReplicaID, Counter[float | None]] = {}
        # (request id, replica) -> (TPOT SLO, wall time routed) of the calls in flight: a rerouted request makes a
        # second call under the same request id (Serve's id of the HTTP request), so a call is only known by the pair
        self._calls: dict[tuple[str, ReplicaID], list[tuple[float | None, float]]] = {}
        # replica -> `ts` of the last report `_reconcile` checked our count against
        self._reconciled: dict[ReplicaID, float] = {}
        # replica -> its clock less this process's, as far as its reports show (the least lag seen, `_reconcile`),
        # and the time (this process's clock) its last report was taken: a replica on another node need not agree
        # with this node's clock, and a second apart would mistake which calls and refusals a report shows
        self._offset: dict[ReplicaID, float] = {}
        self._taken: dict[ReplicaID, float] = {}
        # replica -> this router's calls there that its last report cannot count (chosen, or routed since it was
        # taken) less its calls that report counts and that have ended since: the replica's load is the report's
        # plus this (every other ingress replica's calls since are unknown here); and (routed, ended) of the calls
        # that ended lately, for the next report's count
        self._fresh: dict[ReplicaID, int] = {}
        self._ended: dict[ReplicaID, deque[tuple[float, float]]] = {}
        self._unreadable: set[ReplicaID] = set()  # replicas whose report could not be read (logged once)
        # request id -> (replica ranked first, TPOT SLO, when) for the calls chosen but not yet routed. Serve calls
        # `on_request_routed` only once the replica has answered that it accepts the call (a round trip); every
        # request chosen meanwhile would see the same in-flight counts and go to the same replica. So the choice
        # counts at once where it will most likely land, and moves in `on_request_routed` if it landed elsewhere.
        self._chosen: dict[str, tuple[ReplicaID, float | None, float]] = {}
        # replica unique id -> (wall time, SLO, reason, priority) of the last refusal the ingress saw from it
        # (refusals.py)
        self._refused: dict[str, tuple[float, SLO, str, int]] = {}
        refusals.subscribe(self._refused)
        # replica -> the prompt prefixes (`prefix_keys`) this router sent it, least recently sent first: what its
        # prefix cache likely holds (prefix affinity); and those of the calls chosen but not yet routed, by call
        self._prefixes: dict[ReplicaID, OrderedDict[int, None]] = {}
        self._keys: dict[str, list[int]] = {}
        # (request id, replica) -> wall time of calls that completed before they were routed (Serve runs the two
        # callbacks apart: `on_request_completed` may come first): their routing is not counted
        self._ended_early: dict[tuple[str, ReplicaID], float] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        req = generate_request(pending_request)
        quiet = self._silence.quiet(candidate_replicas)
        if req is None:  # other methods: uniformly at random, the replicas whose engine is dead or silent last
            shuffled = random.sample(candidate_replicas, len(candidate_replicas))
            return [[r] for r in sorted(shuffled, key=lambda r: not answering(r, quiet))]
        call_id = pending_request.metadata.internal_request_id  # type: ignore[union-attr]
        self._unchoose(call_id)  # a retry (the replica ranked first was full): choose afresh
        if self._ended_early:  # (the attempt a replica turned away ended: its end is not this one's)
            for key in [k for k in self._ended_early if k[0] == call_id]:
                del self._ended_early[key]
        now = time.monotonic()
        for stale in [k for k, (_, _, t) in self._chosen.items() if now - t > CHOSEN_TTL_S]:
            self._unchoose(stale)  # chosen, then never routed (cancelled while routing)
            self._keys.pop(stale, None)
        views = {}
        for r in candidate_replicas:
            st = self._stats(r)
            self._reconcile(r.replica_id, st)
            tpots = self._inflight.get(r.replica_id) or Counter()
            views[r.replica_id] = view(st, tpots.total(), req.prompt_len_hint,
                                       min((t for t in tpots if t is not None), default=None),
                                       fresh=self._fresh.get(r.replica_id, 0))
            if r.replica_id in quiet:  # ranked with the dead: last
                views[r.replica_id] = replace(views[r.replica_id], alive=False)
        slo = req.engine_slo  # (a resent request's TTFT is what is left of it)
        avoid = req.avoid_replicas + self._refusing(candidate_replicas, slo, req.priority)
        keys = prefix_keys(req)
        affinity = {r.replica_id: prefix_match(keys, self._prefixes.get(r.replica_id)) for r in candidate_replicas} \
            if keys and self._prefixes else None
        ranked = rank(candidate_replicas, views, slo, avoid, affinity)
        gone = req.failed_replicas
        live = [r for r in ranked if views[r.replica_id].alive and not (gone and r.replica_id.unique_id in gone)]
        if live:  # a dead engine fails a request at once (a silent replica holds it), and one that failed this
            ranked = live  # request would again: where the others are full, Serve queues it for them (it went there)
        if pending_request is not None and getattr(pending_request, "routing_context", None) is not None:
            # (Serve backs off between tries only where the router says so: its locality and multiplex steps do,
            # which this router has none of; without, a full replica was asked again and again at once)
            pending_request.routing_context.should_backoff = True
        if keys:  # remembered where the call lands (`on_request_routed`)
            self._keys[call_id] = keys
        self._chosen[call_id] = (ranked[0].replica_id, slo.tpot_ms, now)
        self._count(ranked[0].replica_id, slo.tpot_ms, +1)
        self._fresh[ranked[0].replica_id] = self._fresh.get(ranked[0].replica_id, 0) + 1
        return [[r] for r in ranked]

    def _stats(self, r: RunningReplica) -> RoutingStats | None:
        """The replica's last report, None before its first or where it cannot be read (logged once: a malformed
        report must not fail the routing of every request, which Ray would leave waiting). Keys this version does
        not know (a newer replica's, during a rolling upgrade) are left out."""
        if not r.routing_stats:
            return None
        try:
            return RoutingStats.from_dict(r.routing_stats, unknown_ok=True)
        except ProtocolError as e:
            if r.replica_id not in self._unreadable:
                self._unreadable.add(r.replica_id)
                log.warning("router: the routing stats of %s cannot be read (%s): routed as a replica that has "
                            "not reported", r.replica_id, e)
            return None

    def _refusing(self, candidates: list[RunningReplica], slo: SLO, priority: int = 0) -> tuple[str, ...]:
        """The candidates that turned away a request as strict as `slo`, and of no higher `priority` value, since
        their last report (`refusals.note_refusal`)."""
        if not self._refused:
            return ()
        now, out = time.time(), []
        for r in candidates:
            uid = r.replica_id.unique_id
            got = self._refused.get(uid)
            if got is None:
                continue
            at, old, reason, old_priority = got
            taken = self._taken.get(r.replica_id, -math.inf)  # (on this process's clock, as `at`)
            if now - at > REFUSED_TTL_S or taken > at + REPORT_LAG_S:  # a report shows the replica since
                if self._refused.get(uid) is got:  # not a refusal noted meanwhile (the ingress's thread)
                    self._refused.pop(uid, None)
            elif refused_for(slo, old, reason, priority, old_priority):
                out.append(uid)
        return tuple(out)

    def _count(self, replica_id: ReplicaID, tpot: float | None, n: int) -> None:
        """Add n (+1 or -1) calls of TPOT SLO `tpot` to a replica's in-flight count; a count never goes below 0."""
        tpots = self._inflight.setdefault(replica_id, Counter()) if n > 0 else self._inflight.get(replica_id)
        if tpots is None:
            return
        tpots[tpot] += n
        if tpots[tpot] <= 0:
            del tpots[tpot]

    def _reconcile(self, replica_id: ReplicaID, st: RoutingStats | None) -> None:
        """Once per report of a replica:
        * when it was taken, on this process's clock: the report's `ts` plus the replica's clock offset, estimated as
          the least lag between a report's `ts` and the time it is first seen here (allowed to rise by
          `OFFSET_CREEP_S` a report, so that a clock set back is followed);
        * what this router knows the replica holds beyond the report (`_fresh`): its calls chosen or routed since it
          was taken, less its calls routed before and ended since;
        * drop calls the report proves finished. Serve schedules a call's completion callback and the routing
          coroutine that calls `on_request_routed` separately on the event loop: a call that ends at once (a 429, a
          400) can complete *before* it is routed, and would then count as in flight forever, steering every later
          request away from that replica. A call we routed well before the report (`REPORT_LAG_S`) and still count
          is in the report's `inflight` if it still runs there (other ingress replicas' calls only add to it); where
          we hold more such calls than the report counts, the oldest extra ones have ended and are dropped."""
        if st is None or self._reconciled.get(replica_id) == st.ts:
            return
        self._reconciled[replica_id] = st.ts
        now = time.time()
        old = self._offset.get(replica_id)
        offset = self._offset[replica_id] = now - st.ts if old is None else min(now - st.ts, old + OFFSET_CREEP_S)
        taken = self._taken[replica_id] = st.ts + offset
        ended = self._ended.get(replica_id)
        while ended and ended[0][1] < taken:  # ended before the report: it does not count them
            ended.popleft()
        mine = [(routed_at, key, i) for key, calls in self._calls.items() if key[1] == replica_id
                for i, (_, routed_at) in enumerate(calls)]
        self._fresh[replica_id] = sum(routed_at >= taken for routed_at, _, _ in mine) \
            + sum(c[0] == replica_id for c in self._chosen.values()) \
            - sum(routed_at < taken for routed_at, _ in ended or ())
        before = sorted((c for c in mine if c[0] < taken - REPORT_LAG_S), key=lambda c: c[0])
        extra = len(before) - st.inflight
        if extra <= 0:
            return
        gone = sorted(before[:extra], key=lambda c: -c[2])  # pop from the back so indices stay valid
        for _, key, i in gone:
            tpot, _ = self._calls[key].pop(i)
            if not self._calls[key]:
                del self._calls[key]
            self._count(replica_id, tpot, -1)
        log.warning("router: %d call(s) to %s counted as in flight had finished (the replica reports %d); "
                    "no longer counted", extra, replica_id, st.inflight)

    def _unchoose(self, call_id: str) -> None:
        chosen = self._chosen.pop(call_id, None)
        if chosen is not None:
            self._count(chosen[0], chosen[1], -1)
            self._fresh[chosen[0]] = self._fresh.get(chosen[0], 0) - 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        req = generate_request(pending_request)
        if req is None:
            return
        tpot, call_id = req.slo.tpot_ms, pending_request.metadata.internal_request_id
        self._unchoose(call_id)  # counted as chosen until now: from here on, as in flight where it landed
        if (keys := self._keys.pop(call_id, None)) is not None:  # its prompt is in that replica's cache now
            held = self._prefixes.setdefault(replica_id, OrderedDict())
            for key in keys:
                held[key] = None
                held.move_to_end(key)
            while len(held) > PREFIX_KEEP:
                held.popitem(last=False)
        now = time.time()
        if self._ended_early:
            if self._ended_early.pop((call_id, replica_id), None) is not None:
                return  # it has ended already
            for key in [k for k, t in self._ended_early.items() if now - t > CHOSEN_TTL_S]:
                del self._ended_early[key]
        self._calls.setdefault((call_id, replica_id), []).append((tpot, now))
        self._count(replica_id, tpot, +1)
        self._fresh[replica_id] = self._fresh.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = (internal_request_id, replica_id)
        calls = self._calls.get(key)
        if not calls:  # a generate call chosen and ended before it was routed: its routing, next, is not counted
            if internal_request_id in self._chosen and len(self._ended_early) < ENDED_EARLY_KEEP:
                self._ended_early[key] = time.time()
            return
        tpot, routed_at = calls.pop()
        if not calls:
            del self._calls[key]
        self._count(replica_id, tpot, -1)
        # routed since the last report: no longer an arrival it misses; routed before: an end it does not show yet
        self._fresh[replica_id] = self._fresh.get(replica_id, 0) - 1
        self._ended.setdefault(replica_id, deque(maxlen=ENDED_KEEP)).append((routed_at, time.time()))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of replicas: what the router kept of those no longer in it (stopped by a scale-down or a
        redeploy, not dead) goes with them."""
        gone = set(self._replica_id_set) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._forget(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        self._refused.pop(replica_id.unique_id, None)
        self._inflight.pop(replica_id, None)
        self._calls = {k: v for k, v in self._calls.items() if k[1] != replica_id}
        self._reconciled.pop(replica_id, None)
        for table in (self._offset, self._taken, self._fresh, self._ended):
            table.pop(replica_id, None)
        self._unreadable.discard(replica_id)
        self._prefixes.pop(replica_id, None)
        for call_id in [k for k, v in self._chosen.items() if v[0] == replica_id]:
            del self._chosen[call_id]
            self._keys.pop(call_id, None)
        self._ended_early = {k: t for k, t in self._ended_early.items() if k[1] != replica_id}


class Pow2Router(PowerOfTwoChoicesRequestRouter):
    """Serve's power of two choices (`router=pow2`), except that a `generate` call passes over the replicas it
    must avoid (`GenerateRequest.avoid_replicas`: they failed it or turned it away), those whose engine reported
    itself dead and those that stopped reporting (`Silence`), as `SLORouter` does. A replica whose engine died
    answers at once, so by queue length it looks the least loaded: a request resent away from it went straight
    back."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        req = generate_request(pending_request)
        avoid = set(req.avoid_replicas) if req is not None else set()

        if getattr(self, "_silence", None) is None:
            self._silence = Silence()
        quiet = self._silence.quiet(candidate_replicas)

        failed = set(req.failed_replicas) if req is not None else set()

        def passed_over(r: RunningReplica) -> bool:
            return r.replica_id.unique_id in avoid or not answering(r, quiet)

        def gone(r: RunningReplica) -> bool:  # (a dead or silent engine, or one that failed this request)
            return r.replica_id.unique_id in failed or not answering(r, quiet)

        chosen = [r for group in ranks for r in group]
        if not any(map(passed_over, chosen)):
            return ranks
        good = [r for r in chosen if not passed_over(r)]
        if not good:  # both picks passed over: two of the others, if any
            others = [r for r in candidate_replicas if not passed_over(r)]
            good = random.sample(others, min(2, len(others)))
        # after them those passed over; a dead or silent one, or one that failed this request, only where no other
        # can take it (Serve queues it for the others: a dead engine fails it at once, a silent replica holds it)
        last = [r for r in chosen if passed_over(r) and (req is None or not good or not gone(r))]
        return [g for g in (good, last) if g]
