#!/bin/bash
# The HTTP hop on a GPU host (issue 55's "adds <= 2 ms p50 TTFT and <= 0.5 ms p50 ITL over in-process"):
# `python -m bench.overhead` on a random-weight Llama built on the device, the in-process engine and a fresh
# `serve run deployments:app` (defaults) in turn, on the GPU, ROUNDS rounds; its summary goes to
# $OUT/overhead-http-gpu.json; then bench.prefill_model on the same model (the prefill model against measured
# steps), its summary to $OUT/prefill-model-SHAPE-DEVICE.json.
#
# Run HERE first: bench/device/bundle.sh (Ray Serve and pydantic for CPython 3.12 in .dev/site312.tar.xz). Then
# THERE, best on the host slo_gpu.sh just ran on (it reuses the 8B model's config that one wrote under /tmp; every
# engine builds its random weights on the device, load_format=dummy, none written or read):
#   run(carry=[".dev"], timeout_s=300, command="bash bench/device/overhead_gpu.sh")
# The CPU dry run HERE (kairos-tiny's shape, float32): DRY_RUN=1 bash bench/device/overhead_gpu.sh
# Knobs (environment): SHAPE (llama-8b if slo_gpu.sh built it on this host, else llama-1b), ROUNDS (2),
#   NUM_REQUESTS (60), INTERVAL_MS (150), MAX_NEW_TOKENS (32), PREFILL_REPS (3), MIXED_GRAPH_TOKENS (the prefill
#   model's engine's mixed_graph_tokens: its mixed-graph table measures graph against eager up to it; default the
#   engine's), OUT (where results go; the device tool sets it).
. bench/device/common.sh
OUT=${OUT:-bench/out/overhead_gpu_out}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = 1 ]; then
  PY=${PY:-.venv/bin/python}
  SHAPE=${SHAPE:-tiny} DTYPE=float32 DEVICE=cpu
else
  PY=${PY:-python3}
  unpack_site
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  DTYPE=bfloat16 DEVICE=cuda
  if [ -z "${SHAPE:-}" ]; then
    SHAPE=llama-1b
    [ -f /tmp/kairos-llama-8b-bfloat16/config.json ] && SHAPE=llama-8b
  fi
fi
MODEL=/tmp/kairos-$SHAPE-$DTYPE
"$PY" - "$SHAPE" "$MODEL" "$DTYPE" "$DEVICE" <<'EOF' || exit 5
import sys
from pathlib import Path
sys.path.insert(0, "bench/device")
from slo_gpu import build_model  # noqa: E402 (the same model slo_gpu.sh serves, built once per shape and dtype)
shape, out, dtype, device = sys.argv[1:]
build_model(shape, Path(out), dtype, device, 4096, weights=False)  # (its config: the engines build the weights)
EOF
# the in-process engine with the threads a GPU replica's engine runs (one: deployments.replica.engine_threads), so
# that the two differ by the HTTP hop only (the dry run passes it too: the same command line as on the device)
"$PY" -m bench.overhead --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --load-format dummy --serve "" \
  --num-threads 1 \
  --num-requests "${NUM_REQUESTS:-60}" --submit-interval-ms "${INTERVAL_MS:-150}" \
  --max-new-tokens "${MAX_NEW_TOKENS:-32}" --rounds "${ROUNDS:-2}" --summary overhead-http-gpu 2>&1 \
  | tee "$OUT/overhead_gpu.log"
rc=${PIPESTATUS[0]}
cp bench/summaries/overhead-http-gpu.json "$OUT/" 2>/dev/null
# the prefill model against measured steps on this host: single prompts to the window, rounds of short prompts, with
# the attention term and without (`bench.prefill_model`; its summary to $OUT, to commit here)
"$PY" -m bench.prefill_model --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --load-format dummy \
  --max-model-len 4096 --long 4095 \
  --round 2048 --profile-max 2048 --reps "${PREFILL_REPS:-3}" --hybrid-prompts 32,128,512,2048 \
  --hybrid-rows 8,32,64,128 ${MIXED_GRAPH_TOKENS:+--mixed-graph-tokens "$MIXED_GRAPH_TOKENS"} \
  --summary "$OUT/prefill-model-$SHAPE-$DEVICE.json" 2>&1 \
  | tee -a "$OUT/overhead_gpu.log"
[ "${DRY_RUN:-0}" = 1 ] && rm -f bench/summaries/overhead-http-gpu.json  # a dry run's figures are not kept
echo "overhead_gpu exit $rc ($SHAPE, $DEVICE), $(( $(date +%s) - T0 )) s in all"
exit "$rc"
