#!/usr/bin/env bash
# Run GPU checks and benchmarks in ONE call on a GPU machine.
#
#   bash scripts/gpu.sh "python3 -m pytest -q -m gpu tests/test_mosaic_decode.py" \
#                       "python3 -m jattn bench decode"
#
# Sets up the machine, then runs each argument as a shell command. Setup: the wheels in
# .whl/ (jax-triton; fetched there with `pip download` when missing and a package index is
# reachable) are installed into /tmp/site, which goes on PYTHONPATH, and jattn is installed
# editable without its dependencies. The machine needs python3 with pip, setuptools and a
# CUDA build of jax already installed; one without a package index needs .whl/ copied into
# the checkout beforehand (without jax-triton the triton backend is unavailable).
# Full logs go to $OUT/stepN.log ($OUT defaults to /tmp/jattn_gpu_out); the last
# GPU_SH_TAIL lines (default 60) of each step and a summary are printed at the end, so
# that the end of the output alone shows every step's result.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/jattn_gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ ! -d .whl ] || ! ls .whl/jax_triton-*.whl >/dev/null 2>&1; then
  # One-time, on a machine with a package index (the GPU machine has none).
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  python3 -m pip download -q --no-deps -d .whl jax-triton==0.3.1 \
    || echo "gpu.sh: no .whl/jax-triton wheel and no index: triton backend unavailable"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >"$OUT/setup.log" 2>&1 && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/setup.log" 2>&1 \
  || { echo "gpu.sh: editable install failed"; tail -20 "$OUT/setup.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  git log -1 --format='commit %h %s' 2>/dev/null; } | tee "$OUT/env.log"

i=0; summary=()
for cmd in "$@"; do
  i=$((i + 1))
  log="$OUT/step$i.log"
  t0=$(date +%s)
  bash -c "$cmd" >"$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  echo "===== step $i (rc=$rc, ${dt}s): $cmd"
  tail -n "${GPU_SH_TAIL:-60}" "$log"
  summary+=("step $i rc=$rc ${dt}s :: $cmd")
done
echo "===== summary"
printf '%s\n' "${summary[@]}"
