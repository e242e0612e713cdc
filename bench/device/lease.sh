#!/bin/bash
# Issue 55's device work in one lease (15 minutes of device time, all calls together; a fresh host takes ~35 s to
# start), in two calls of this script, the second at once on the warm host (it goes back after 30 s idle):
#   here first: bash bench/device/bundle.sh
#   call 1: run(carry=[".dev"], timeout_s=600, command="KAIROS_COMMIT=<sha> bash bench/device/lease.sh 1")
#           (<sha>: `git rev-parse --short HEAD` here; the device's copy has no .git)
#           the graphs' check (tests/gpu's graph tests, up to 180 s: without the mixed graphs if they fail), then
#           slo_gpu.sh (the SLO experiment) within what is left of 585 s (a call's most is 600 s; the summary is
#           rewritten after each arm, so even a call cut off keeps what it finished; what it did not finish,
#           call 2 resumes, on the server call 1 leaves running for it (KEEP_SERVER=1: in a process session of its
#           own, which the device's tool leaves running between calls), else on a server of its own)
#   call 2: run(carry=[".dev"], timeout_s=LEFT - 20, command="BUDGET_S=<LEFT - 40> KAIROS_COMMIT=<sha> bash
#           bench/device/lease.sh 2"), LEFT the device time the lease has left
#           slo_gpu.sh RESUME=1 (only what call 1 did not finish, with all the time there is: the experiment comes
#           first, and a server that would not fit is left out whole), then overhead_gpu.sh (ROUNDS=1: the HTTP
#           hop, the prefill model and hybrid steps), then
#           tests/gpu (gpu_check.sh BENCH=0), each in what BUDGET_S leaves (OVERHEAD=0 skips overhead_gpu.sh:
#           tests/gpu gets its time)
# Everything lands in $OUT: slo-gpu.json, overhead-http-gpu.json, prefill-model-*.json, gpu-check.json and logs
# (call 2's in logs-2.tgz: a call returns at most 8 files). Call 2 on a fresh host (the warm one went back) has no
# call-1 run to resume: it skips the SLO step (SLO_FRESH=1 runs one from scratch).
# Then here (after give_back): python bench/device/ingest.py <call 1's files_at> <call 2's files_at> keeps them as
# summaries and the replica profile, regenerates the READMEs' tables and prints what the issue's note wants.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET_S:-240} - ($(date +%s) - T0) )); }
case "${1:-}" in
  1)
    # first the decode CUDA graphs and those of steps with prefill rows (MixedGraphs, on by default) against the
    # torch reference: where the mixed ones fail, the SLO experiment serves without them (mixed_graph_tokens=0),
    # where the decode ones fail (or the check crashed), with no graph (enforce_eager=true), rather than on a broken
    # path (MIXED_CHECK=0 skips this)
    rm -f /tmp/kairos-lease-serve  # (a host may come back with an earlier lease's /tmp)
    t0=$T0
    . bench/device/common.sh  # (it sets T0: the lease's is kept)
    T0=$t0
    prewarm_libs  # torch's and CUDA's libraries into the page cache while the model builds and Ray starts
    if [ "${MIXED_CHECK:-1}" = 1 ]; then
      unpack_site
      mkdir -p "${OUT:-/tmp}"
      log="${OUT:-/tmp}/mixed-check.log"
      timeout -s INT -k 10 "${MIXED_CHECK_S:-180}" python3 -m pytest -q -rf -p no:cacheprovider \
        tests/gpu/test_backend_cuda.py -k "mixed_graph or graph_replays" > "$log" 2>&1
      rc=$?
      tail -4 "$log"
      # a failed test (1) or a crash (a signal, 128 + n) turns graphs off; running out of time (124, or 137: killed
      # after it; cold Triton compiles) or pytest's own trouble (2-5: interrupted, internal, usage, no test) says
      # nothing against them. Which graphs: the mixed ones where only their tests failed, else all
      if [ "$rc" -eq 1 ] || { [ "$rc" -ge 128 ] && [ "$rc" -ne 137 ]; }; then  # kept for call 2's resumed run
        # (the same server arguments)
        if [ "$rc" -eq 1 ] && ! grep -q "^FAILED .*::test_graph_replays" "$log"; then
          echo "mixed_graph_tokens=0" > /tmp/kairos-lease-serve
        else
          echo "enforce_eager=true" > /tmp/kairos-lease-serve
        fi
        echo "lease.sh: the graphs' check failed (exit $rc): the SLO experiment serves with" \
          "$(cat /tmp/kairos-lease-serve)"
      fi
    fi
    [ -f /tmp/kairos-lease-serve ] && export SERVE="$(cat /tmp/kairos-lease-serve) ${SERVE:-}"
    KEEP_SERVER=${KEEP_SERVER:-1} LIMIT_S=${LIMIT_S:-$(( 585 - ($(date +%s) - T0) ))} bash bench/device/slo_gpu.sh ;;
  2)
    [ -f /tmp/kairos-lease-serve ] && export SERVE="$(cat /tmp/kairos-lease-serve) ${SERVE:-}"  # call 1's decision
    l=$(left)
    if [ -f /tmp/slo_gpu/slo-gpu.json ] || [ "${SLO_FRESH:-0}" = 1 ]; then
      RESUME=1 LIMIT_S=${SLO_S:-$(( l - 10 ))} bash bench/device/slo_gpu.sh
    else  # a fresh host (call 1's went back): a run from scratch would not finish, and its few rows are no news
      echo "lease.sh: no call-1 run on this host to resume (a fresh host): no slo_gpu.sh (SLO_FRESH=1 runs one)"
    fi
    [ -f /tmp/site/ray/__init__.py ] && export PYTHONPATH=/tmp/site:$PWD  # unpacked once (gpu_check.sh looks)
    # the device free for what follows, whatever the resumed run left (call 1's server, where it never took it over)
    python3 -c "from bench.driver import stop_host; stop_host()" 2>/dev/null
    l=$(left)
    if [ "${OVERHEAD:-1}" = 0 ]; then
      echo "lease.sh: OVERHEAD=0: no overhead_gpu.sh"
    elif [ "$l" -gt 100 ]; then
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
    fi
    # the logs in one file: the device's tool returns at most 8 files of a call (this one's three steps make 9)
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
      (cd "$OUT" || exit 0
       logs=()
       for f in *.log junit.xml; do if [ -f "$f" ]; then logs+=("$f"); fi; done
       if [ "${#logs[@]}" -gt 0 ]; then tar czf logs-2.tgz "${logs[@]}" && rm -f "${logs[@]}"; fi)
    fi ;;
  *)
    echo "usage: bash bench/device/lease.sh 1|2 (see its header)" >&2
    exit 2 ;;
esac
echo "lease.sh $1: $(( $(date +%s) - T0 )) s in all"
