#!/bin/bash
# The GPU check in one command (issues 53 and 54), on a lent device from the repo root: `pytest tests/gpu -rs`,
# then, while the time budget allows, the quick `python -m bench.engine --device cuda`, and ONE JSON summary,
# $OUT/gpu-check.json (pass/fail per test from pytest's junit XML, the device, torch/CUDA/Triton versions, commit,
# date, wall times, the benchmark's figures). Ray Serve, pydantic and FastAPI, which that host lacks, come from
# .dev/site312.tar.xz (build it here first: `bash bench/device/bundle.sh`).
#
# Call it with the device tool's `run` (the commit is written in here: the host gets no .git):
#   run(carry=[".dev"], timeout_s=480,
#       command="KAIROS_COMMIT=<git rev-parse --short HEAD, here> bash bench/device/gpu_check.sh")
# Knobs (environment): TOTAL_S the whole run's budget in seconds (default 400: tests then benchmark; the device's
# start and transfers come on top); TEST_LIMIT_S the tests' share (default 270); TESTS=0 / BENCH=0 skip either;
# SHAPE llama-8b (default) | llama-1b; BENCH_ARGS more bench.engine arguments; MIN_BENCH_S the least time left
# for the benchmark to start (default 120); SUMMARY the benchmark summary's name ($OUT/NAME.json, the schema of
# bench/summaries/; default engine-cuda-SHAPE). If the benchmark was cut short, a second call on the warm host
# with TESTS=0 gives it the whole budget.
# Dry run on a box without a GPU (tiny shapes, the CPU; ~5 minutes on 2 cores): KAIROS_GPU_TESTS_ON_CPU=1
# PY=.venv/bin/python TEST_LIMIT_S=1200 TOTAL_S=1800 bash bench/device/gpu_check.sh (OUT defaults to
# /tmp/gpucheck-out). What would travel (must be <= 64 MiB): bash bench/device/gpu_check.sh --carried-size
set -u
if [ "${1:-}" = "--carried-size" ]; then  # here: what travels (tracked + untracked not ignored files) + .dev
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
    awk '{s += $1} END {print s + 0}')
  dev=$(du -sb .dev 2>/dev/null | cut -f1)
  dev=${dev:-0}
  mib=1048576
  echo "working tree $((tree / mib)) MiB + .dev $((dev / mib)) MiB = $(((tree + dev) / mib)) MiB (limit 64 MiB)"
  [ $((tree + dev)) -le $((64 * mib)) ]
  exit
fi
T0=$(date +%s)
PY=${PY:-python3}
export OUT=${OUT:-/tmp/gpucheck-out}
TOTAL_S=${TOTAL_S:-400}
TEST_LIMIT_S=${TEST_LIMIT_S:-270}
MIN_BENCH_S=${MIN_BENCH_S:-120}
dflt=engine-cuda-${SHAPE:-llama-8b}; [ "${KAIROS_GPU_TESTS_ON_CPU:-}" = 1 ] && dflt=engine-cpu-tiny
SUMMARY=${SUMMARY:-$dflt}  # the benchmark's summary: $OUT/$SUMMARY.json (for bench/summaries/)
mkdir -p "$OUT" && rm -f "$OUT"/{junit.xml,pytest.log,bench.log,"$SUMMARY".json,bench-engine-full.json,gpu-check.json}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export KAIROS_CACHE=${KAIROS_CACHE:-/tmp/kairos-cache}  # latency profiles: fitted afresh, as on a new replica
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Ray Serve + pydantic + FastAPI from the bundle, where the host has none
if ! "$PY" -c "import ray, ray.serve, pydantic, fastapi, starlette, uvicorn" 2>/dev/null; then
  if [ -f .dev/site312.tar.xz ]; then
    mkdir -p /tmp/site && tar -xJf .dev/site312.tar.xz -C /tmp/site || echo "gpu_check: could not unpack the bundle"
    # without even an empty dashboard build, Ray waits ~60 s for its dashboard at every start
    mkdir -p /tmp/site/ray/dashboard/client/build/static
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "gpu_check: no .dev/site312.tar.xz (bash bench/device/bundle.sh here, carry .dev): Ray tests will skip"
  fi
fi
T_UNPACK=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$PY" -c "import ray, pydantic; print('ray', ray.__version__, 'pydantic', pydantic.VERSION)" 2>&1 | tail -1

# the tests: SIGINT at the limit, so that pytest still writes its junit XML and short summary
timeout_args=()
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_args=(--timeout 170)
set -o pipefail
if [ "${TESTS:-1}" = "1" ]; then
  timeout -s INT -k 20 "$TEST_LIMIT_S" "$PY" -m pytest tests/gpu -rs -rA -p no:cacheprovider "${timeout_args[@]}" \
    --continue-on-collection-errors --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
  TEST_RC=$?
else
  TEST_RC=""
fi
T_TESTS=$(date +%s)

# the benchmark, in what is left of TOTAL_S (it skips its remaining points past --time-limit-s, then writes)
BENCH_RC=""
BENCH_NOTE=""
left=$((TOTAL_S - (T_TESTS - T0)))
if [ "${BENCH:-1}" != "1" ]; then
  BENCH_NOTE="BENCH=0"
elif [ "$left" -lt "$MIN_BENCH_S" ]; then
  BENCH_NOTE="skipped: ${left} s left of TOTAL_S=${TOTAL_S}, under MIN_BENCH_S=${MIN_BENCH_S}"
else
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    bench=(--device cuda --shape "${SHAPE:-llama-8b}")
  else  # the CPU dry run
    bench=(--device cpu --shape tiny --quick --dtype float32)
  fi
  # the start-up (build, write, load, profile) cannot be cut: stop adding points a minute before the end
  timeout -s INT -k 15 $((left - 5)) "$PY" -m bench.engine "${bench[@]}" --time-limit-s $((left - 60)) \
    --summary "$OUT/$SUMMARY.json" --json "$OUT/bench-engine-full.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  BENCH_RC=$?
fi
T_BENCH=$(date +%s)

# ONE summary: $OUT/gpu-check.json
T0=$T0 T_UNPACK=$T_UNPACK T_TESTS=$T_TESTS T_BENCH=$T_BENCH TEST_RC=$TEST_RC BENCH_RC=$BENCH_RC \
BENCH_NOTE=$BENCH_NOTE SUMMARY=$SUMMARY "$PY" - <<'EOF'
import datetime, json, os, platform, re, subprocess, time
import xml.etree.ElementTree as ET

out, env = os.environ["OUT"], os.environ
tests, source = [], None
try:
    root = ET.parse(os.path.join(out, "junit.xml")).getroot()
    for case in root.iter("testcase"):
        if not case.get("name"):  # the test a SIGINT cut short: pytest records it nameless
            continue
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "")[:500]
                break
        cls = case.get("classname") or ""  # empty for a collection error (its name is the module then)
        name = f"{cls.replace('.', '/')}.py::{case.get('name')}" if cls else case.get("name")
        tests.append({"test": name, "outcome": outcome, "time_s": round(float(case.get("time") or 0), 2),
                      "message": message})
    source = "junit.xml"
except (OSError, ET.ParseError):  # pytest killed before it wrote the XML: its log's -rA lines
    try:
        for line in open(os.path.join(out, "pytest.log"), errors="replace"):
            m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED)( \[\d+\])? (\S+)(?: - (.*))?", line)
            if m:
                tests.append({"test": m.group(3), "outcome": m.group(1).lower(), "time_s": None,
                              "message": (m.group(4) or "")[:500] or None})
        source = "pytest.log"
    except OSError:
        pass
try:
    log = open(os.path.join(out, "pytest.log"), errors="replace").read()
except OSError:
    log = ""
interrupted = env.get("TEST_RC") in ("124", "130", "137") or "KeyboardInterrupt" in log
counts = {}
for t in tests:
    counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1

versions = {"python": platform.python_version()}
device = {}
try:
    import torch
    versions.update(torch=torch.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        device = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                  "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count}
    else:
        device = {"name": "cpu (dry run: no CUDA)", "on_cpu": env.get("KAIROS_GPU_TESTS_ON_CPU") == "1"}
except ImportError:
    pass
for mod in ("triton", "transformers", "ray", "pydantic", "fastapi"):
    try:
        versions[mod] = __import__(mod).__version__ if mod != "pydantic" else __import__(mod).VERSION
    except Exception:  # noqa: BLE001 - absent here
        versions[mod] = None
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=20).stdout.strip() or None
except (OSError, subprocess.SubprocessError):
    driver = None
commit = env.get("KAIROS_COMMIT", "")
if not commit:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
bench = {"rc": int(env["BENCH_RC"]) if env.get("BENCH_RC") else None, "note": env.get("BENCH_NOTE") or None}
try:
    b = json.load(open(os.path.join(out, env["SUMMARY"] + ".json")))
    bench.update(summary=env["SUMMARY"] + ".json", headline=b["headline"], command=b["command"], figures=b["figures"])
except (OSError, ValueError, KeyError):
    bench.setdefault("headline", None)
try:  # the host's CPU, as every summary records it (bench.report.run_info's cpu, cpu_count, cpu_flags)
    from bench.report import cpu_flags, cpu_model
    host = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "cpu_flags": cpu_flags()}
except Exception:  # noqa: BLE001 - the summary is written regardless
    host = {}
t = {k: int(env[k]) for k in ("T0", "T_UNPACK", "T_TESTS", "T_BENCH")}
knobs = " ".join(f"{k}={env[k]}" for k in ("TOTAL_S", "TEST_LIMIT_S", "TESTS", "BENCH", "SHAPE", "BENCH_ARGS",
                                            "KAIROS_GPU_TESTS_ON_CPU") if env.get(k))
summary = {
    "name": "gpu-check", "command": f"{knobs + ' ' if knobs else ''}bash bench/device/gpu_check.sh",
    "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "device": dict(device, driver=driver), "versions": versions, "host": host,
    "tests": {"rc": int(env["TEST_RC"]) if env.get("TEST_RC") else None, "source": source, "counts": counts,
              "interrupted": interrupted, "results": tests},
    "bench": bench,
    "wall_s": {"unpack": t["T_UNPACK"] - t["T0"], "tests": t["T_TESTS"] - t["T_UNPACK"],
               "bench": t["T_BENCH"] - t["T_TESTS"], "total": int(time.time()) - t["T0"]},
}
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(f"\n== gpu-check {commit or '?'} on {device.get('name')} ({versions.get('torch')}, CUDA {versions.get('cuda')}, "
      f"Triton {versions.get('triton')}): tests {counts}{' INTERRUPTED at TEST_LIMIT_S' if interrupted else ''} "
      f"(pytest rc {env.get('TEST_RC') or '-'}), "
      f"wall {summary['wall_s']}")
for r in tests:
    if r["outcome"] != "passed":
        print(f"  {r['outcome'].upper():7} {r['test']}: {(r['message'] or '')[:160]}")
print(f"  bench: rc {bench['rc']} {bench.get('note') or ''} {bench.get('headline') or ''}")
print(f"  wrote {os.path.join(out, 'gpu-check.json')}")
EOF
