#!/bin/bash
# Run THERE (a lent device host, `carry: [".dev"]`, after bench/device/bundle.sh here): two kairos-tiny replicas with
# a core each over HTTP, `python -m bench.route` with the given arms; what it measured comes back under $OUT.
#   ROUTERS  arms, run in this order (default pow2,slo; e.g. slo+reroute_rejected=1)
#   LOADS    multiples of lambda* (default 1.5,1)   SEEDS  default 0   NUM_REQUESTS  a point (default 242)
#   LAMBDA   lambda* in req/s, with TIERS a tiers-profile.json: skip the FCFS capacity probe (~3 minutes)
#   LIMIT_S  seconds bench.route may run (default 500; it writes route.json after each arm)
#   SUMMARY  a bench/summaries name (default route-2replicas-device)
. bench/device/common.sh
unpack_site
lscpu | grep -E "Model name|^CPU\(s\)"
python3 -c "import ray, pydantic; from ray import serve; print('ray', ray.__version__, 'pydantic', pydantic.VERSION)" || exit 4
fixed=()
if [ -n "${LAMBDA:-}" ]; then fixed=(--lambda-star "$LAMBDA" --predictor-json "${TIERS:?TIERS with LAMBDA}"); fi
rm -rf /tmp/r  # a host can come back with an earlier lease's /tmp (the third did): no stale arms in the tally
timeout "${LIMIT_S:-500}" python3 -m bench.route --routers "${ROUTERS:-pow2,slo}" --loads "${LOADS:-1.5,1}" \
  --seeds "${SEEDS:-0}" --num-requests "${NUM_REQUESTS:-242}" --dataset-path .dev/sharegpt-sub.json "${fixed[@]}" --out /tmp/r \
  --summary "${SUMMARY:-route-2replicas-device}" 2>&1 | tee "$OUT/route.log"
echo "bench.route exit ${PIPESTATUS[0]}, $(( $(date +%s) - T0 )) s in all"
cp /tmp/r/route.json bench/summaries/"${SUMMARY:-route-2replicas-device}".json "$OUT"/ 2>/dev/null
tar --exclude='*.png' -czf "$OUT/route-out.tgz" -C /tmp r
