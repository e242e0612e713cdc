#!/bin/bash
# SCORPIO's experiment on one GPU replica over Ray Serve (issue 55): an 8B-shaped bf16 Llama with random weights
# built on the device (no download), lambda* over HTTP (FCFS's capacity: its completion rate under overload, its
# search starting where FCFS's batch holds STRICT_BATCH requests), then fcfs, scorpio and kairos at the highest of
# LOADS x lambda*, kairos and fcfs at the lower ones, SEEDS, ShareGPT prompts with their reference reply lengths
# hidden from the scheduler (the predicted arm: every policy's length predictor on), and last kairos with exact
# lengths as the bound; each arm's decode step / latency model by decode rows (the server's /metrics). One summary
# JSON under $OUT.
#
# The protocol is the regime SCORPIO's claims are about (bench/README.md, "SLO serving on a GPU replica"):
# TPOT tiers a full batch meets (T_strict = the gate's headroom x ITL at the seats, max_num_seqs, T_loose at twice
# that: in about the ratio of the paper's strict and loose TPOT types), so FCFS's lambda* is its throughput, not its
# strict tier, and points of a few times the seats, so that past lambda* FCFS's queue builds as a served load's does
# (sized to the time left once lambda* is known, NUM_REQUESTS down to MIN_REQUESTS; the fourth lease's first call
# spent all its time on fcfs's 1,000-request points and probes).
# One server runs every policy: the next policy's scheduler knobs go to the running replica as its LLM deployment's
# user_config (a redeploy with only that changed; the engine swaps its scheduler once drained), so no server starts or
# stops between policies (ONE_SERVER=0: a fresh server each, as the first three leases ran). Call 1 of lease.sh runs
# it, and call 2 resumes what call 1's time did not hold. The first three leases ran
# STRICT_BATCH=32 LOOSE_BATCH=128 NUM_REQUESTS=240 LAMBDA_DEF=adherence (tiers a batch of 32 meets, 240-request
# points that 256 seats admit at once: FCFS never queues, and SCORPIO's gate holds its batch to 32).
#
# Run HERE first: bench/device/bundle.sh (builds .dev/site312.tar.xz, Ray Serve and pydantic for CPython 3.12, and
# .dev/sharegpt-sub.json). Then THERE (a lent GPU host, `carry: [".dev"]`):
#   bash bench/device/slo_gpu.sh
# The CPU dry run HERE (kairos-tiny's shape, float32, one engine thread, a few minutes; the local venv's Ray):
#   DRY_RUN=1 bash bench/device/slo_gpu.sh
# Knobs (environment): SHAPE (llama-8b | llama-1b | tiny), LOADS (1,1.5), SEEDS (0,1), NUM_REQUESTS (1000: a
#   point's requests at most; once lambda* is known they are sized so that every point fits LIMIT_S, down to
#   MIN_REQUESTS, 1000: what does not fit then is left to a resumed call),
#   PROBE_REQUESTS (800: lambda*'s probes as long as the shortest points, whose queues build as long; on the fourth
#   lease's replica profile bench.sim reads lambda* within 2% of 1,000-request probes', in 13 s less), LAMBDA
#   (skip the lambda* search), LAMBDA_DEF (capacity: FCFS's completion rate under overload; adherence: the highest
#   rate at which FCFS keeps 90% adherence, the reference protocol's CPU one), LAMBDA_REFINE (3, adherence only:
#   probes that halve the bracket around lambda*), LIMIT_S (540: the whole run, model build and server starts
#   included; the summary is rewritten after each policy, so a cut-off run keeps what it measured), STRICT_BATCH /
#   LOOSE_BATCH (256 / 512: the TPOT tiers are headroom x ITL(that batch, L) of the replica's own fit),
#   POLICIES (scorpio,kairos: after fcfs at each load, in this order, kairos's exact arm last; a label's knobs, as in
#   kairos+credit_batching=false, are its server's app arguments), RESUME=1 (a second call on the same warm host,
#   after a first that LIMIT_S cut off: its model, replica profile (so its tiers), lambda* and finished arms stay; the
#   rest runs, and the summary has both),
#   CLIENT_PROCS (bench.slo's HTTP client processes; default a quarter of the cores, 1 to 4), ONE_SERVER (1),
#   KEEP_SERVER (0; 1: a run that leaves arms undone leaves its server running, in a process session of its own, and
#   the RESUME=1 call takes it over instead of starting one: lease.sh's call 1),
#   ALL_LOADS (fcfs,kairos: the policies run at every load, the others at the highest only; fcfs,scorpio,kairos
#   runs scorpio at 1x too),
#   SERVE (more app arguments of every server), OUT (where results go; the device tool sets it).
. bench/device/common.sh
# Ray's agent exports what replicas report this often (default 10 s): bench.slo reads each server's decode step /
# latency model by decode rows from /metrics after its run
export RAY_metrics_report_interval_ms=${RAY_metrics_report_interval_ms:-2000}
OUT=${OUT:-bench/out/slo_gpu_out}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = 1 ]; then
  PY=${PY:-.venv/bin/python}
  args=(--shape "${SHAPE:-tiny}" --dtype float32 --device cpu --window 1024 --serve "num_threads=1 ${SERVE:-}"
        --max-num-seqs 16 --prefill-max-tokens 512 --strict-batch "${STRICT_BATCH:-16}" --loose-batch
        "${LOOSE_BATCH:-32}" --loads "${LOADS:-1.5}" --seeds "${SEEDS:-0}" --num-requests "${NUM_REQUESTS:-64}"
        --probe-requests "${PROBE_REQUESTS:-64}"
        --limit-s "${LIMIT_S:-900}" --model-dir "${MODEL_DIR:-/tmp/kairos-slo-gpu-dry}")
  [ -n "${DATASET_PATH:-}" ] && args+=(--dataset-path "$DATASET_PATH")
else
  PY=${PY:-python3}
  unpack_site
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import ray, pydantic, torch; from ray import serve; print('ray', ray.__version__, 'pydantic',
pydantic.VERSION, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 4
  args=(--shape "${SHAPE:-llama-8b}" --dtype bfloat16 --device cuda --serve "${SERVE:-}" --loads "${LOADS:-1,1.5}"
        --seeds "${SEEDS:-0,1}" --num-requests "${NUM_REQUESTS:-1000}"
        --probe-requests "${PROBE_REQUESTS:-800}"
        --strict-batch "${STRICT_BATCH:-256}" --loose-batch "${LOOSE_BATCH:-512}" --limit-s "${LIMIT_S:-540}"
        --dataset-path .dev/sharegpt-sub.json)
fi
[ -n "${LAMBDA:-}" ] && args+=(--lambda-star "$LAMBDA")
[ -n "${MIN_REQUESTS:-}" ] && args+=(--min-requests "$MIN_REQUESTS")
[ -n "${LAMBDA_DEF:-}" ] && args+=(--lambda-def "$LAMBDA_DEF")
[ -n "${LAMBDA_REFINE:-}" ] && args+=(--lambda-refine "$LAMBDA_REFINE")
[ -n "${POLICIES:-}" ] && args+=(--policies "$POLICIES")
[ -n "${CLIENT_PROCS:-}" ] && args+=(--client-procs "$CLIENT_PROCS")
[ "${ONE_SERVER:-1}" = 0 ] && args+=(--no-one-server)
[ "${KEEP_SERVER:-0}" = 1 ] && args+=(--keep-server)
[ -n "${ALL_LOADS:-}" ] && args+=(--all-loads "$ALL_LOADS")
if [ "${RESUME:-0}" = 1 ]; then  # a second call on the same warm host: what the first did not finish
  args+=(--resume)
else
  rm -rf /tmp/slo_gpu  # a host can come back with an earlier lease's /tmp
fi
"$PY" bench/device/slo_gpu.py "${args[@]}" --out /tmp/slo_gpu --summary-out "$OUT/slo-gpu.json" 2>&1 | tee "$OUT/slo_gpu.log"
rc=${PIPESTATUS[0]}
echo "slo_gpu exit $rc, $(( $(date +%s) - T0 )) s in all"
tar --exclude='*.png' --exclude='*.safetensors' -czf "$OUT/slo_gpu-out.tgz" -C /tmp slo_gpu 2>/dev/null
ls -la "$OUT"
exit "$rc"
