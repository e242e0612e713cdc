#!/bin/bash
# Issue 55's device work in one lease (15 minutes of device time, all calls together; a fresh host takes ~35 s to
# start), in two calls of this script, the second at once on the warm host (it goes back after 30 s idle):
#   here first: bash bench/device/bundle.sh
#   call 1: run(carry=[".dev"], timeout_s=590, command="bash bench/device/lease.sh 1")
#           slo_gpu.sh (the SLO experiment) within LIMIT_S (default 550 s)
#   call 2: run(carry=[".dev"], timeout_s=LEFT - 20, command="BUDGET_S=<LEFT - 40> KAIROS_COMMIT=<sha> bash
#           bench/device/lease.sh 2"), LEFT the device time the lease has left
#           slo_gpu.sh RESUME=1 (only what call 1 did not finish: all the time there is if that is much, else all
#           but 160 s), then overhead_gpu.sh (ROUNDS=1: the HTTP hop, the prefill model and hybrid steps), then
#           tests/gpu (gpu_check.sh BENCH=0), each in what BUDGET_S leaves
# Everything lands in $OUT: slo-gpu.json, overhead-http-gpu.json, prefill-model-*.json, gpu-check.json and logs.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET_S:-240} - ($(date +%s) - T0) )); }
case "${1:-}" in
  1)
    LIMIT_S=${LIMIT_S:-550} bash bench/device/slo_gpu.sh ;;
  2)
    l=$(left)
    RESUME=1 LIMIT_S=${SLO_S:-$(( l >= 320 ? l - 160 : l - 10 ))} bash bench/device/slo_gpu.sh
    [ -f /tmp/site/ray/__init__.py ] && export PYTHONPATH=/tmp/site:$PWD  # unpacked once (gpu_check.sh looks)
    l=$(left)
    if [ "$l" -gt 100 ]; then
      ROUNDS=${ROUNDS:-1} PREFILL_REPS=${PREFILL_REPS:-2} timeout $(( l > 170 ? 160 : l - 10 )) \
        bash bench/device/overhead_gpu.sh
    else
      echo "lease.sh: ${l} s left: no overhead_gpu.sh"
    fi
    l=$(left)
    if [ "$l" -gt 45 ]; then
      BENCH=0 TEST_LIMIT_S=$(( l - 15 )) TOTAL_S=$(( l - 5 )) bash bench/device/gpu_check.sh
    else
      echo "lease.sh: ${l} s left: no tests/gpu"
    fi ;;
  *)
    echo "usage: bash bench/device/lease.sh 1|2 (see its header)" >&2
    exit 2 ;;
esac
echo "lease.sh $1: $(( $(date +%s) - T0 )) s in all"
