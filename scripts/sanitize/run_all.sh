#!/usr/bin/env bash
# Runs every kernel script of this folder under compute-sanitizer, once per tool, each run
# with a time limit, and prints one line per (kernel, tool):
#
#   bash scripts/sanitize/run_all.sh                      # all scripts, memcheck + racecheck
#   bash scripts/sanitize/run_all.sh mosaic_fp8.py        # some scripts
#   TOOLS="memcheck racecheck synccheck" LIMIT=150 JOBS=4 bash scripts/sanitize/run_all.sh
#   SANITIZER=none bash scripts/sanitize/run_all.sh       # no sanitizer: the scripts' logic
#                                                         # only (on a CPU: interpreted)
# On a GPU machine, through scripts/gpu.sh (which first installs the wheels in .whl/ and
# jattn):
#   bash scripts/gpu.sh "bash scripts/sanitize/run_all.sh"
#
# Environment: SANITIZER (default /usr/local/cuda/bin/compute-sanitizer, or "none"), TOOLS
# (default "memcheck racecheck"), LIMIT (seconds per run, default 150), JOBS (runs at
# once, default 4), KERNEL_FILTER (passed as compute-sanitizer's --kernel-name, e.g.
# kns=jattn_paged_decode: only kernels whose name holds that are checked). Full logs go
# to $OUT/sanitize/<script>.<tool>.log ($OUT defaults to /tmp/jattn_sanitize).
#
# A result line: PASS (exit 0, the script's "ok" line printed, 0 errors / hazards),
# ERRORS (the sanitizer reported some), TIMEOUT (past LIMIT), FAIL (anything else: the
# script's own check failed or it crashed; see the log).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
export SAN_BIN="${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}"
export SAN_LIMIT="${LIMIT:-150}"
export SAN_LOGS="${OUT:-/tmp/jattn_sanitize}/sanitize"
export SAN_FILTER="${KERNEL_FILTER:-}"
export SAN_PY="${PYTHON:-python3}"
TOOLS="${TOOLS:-memcheck racecheck}"
JOBS="${JOBS:-4}"
mkdir -p "$SAN_LOGS"

# One compile and one launch per process: no preallocated arena (each buffer its own
# allocation, so memcheck sees a buffer's true bounds), no autotuning, no command buffers.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}"
export TF_CPP_MIN_LOG_LEVEL=2
export PYTHONPATH="$HERE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ "$SAN_BIN" != none ] && [ ! -x "$SAN_BIN" ]; then
  echo "run_all.sh: no compute-sanitizer at $SAN_BIN (set SANITIZER=none to run the scripts alone)"
  exit 2
fi

one() {
  local script="$1" tool="$2"
  local name log t0 rc dt errs status ok
  name="$(basename "$script" .py)"
  log="$SAN_LOGS/$name.$tool.log"
  t0=$(date +%s)
  if [ "$SAN_BIN" = none ]; then
    timeout -k 10 "$SAN_LIMIT" "$SAN_PY" "$script" >"$log" 2>&1
  else
    # shellcheck disable=SC2086
    timeout -k 10 "$SAN_LIMIT" "$SAN_BIN" --tool "$tool" --error-exitcode 9 --print-limit 50 \
      ${SAN_FILTER:+--kernel-name "$SAN_FILTER"} "$SAN_PY" "$script" >"$log" 2>&1
  fi
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  ok=no
  grep -q '^ok ' "$log" && ok=yes
  grep -q '^skip ' "$log" && ok=skip
  # memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
  errs="$(grep -Eo '(ERROR SUMMARY: [0-9]+ errors?|RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?, [0-9]+ warnings?\))' "$log" | tail -1)"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    status=TIMEOUT
  elif [ "$rc" = 9 ]; then
    status=ERRORS
  elif [ "$rc" = 0 ] && [ "$ok" = skip ]; then
    status=SKIP
  elif [ "$rc" = 0 ] && [ "$ok" = yes ]; then
    status=PASS
  else
    status="FAIL(rc=$rc)"
  fi
  if [ "$status" = PASS ] && printf '%s' "$errs" | grep -Eq '(: [1-9][0-9]* hazard|[1-9][0-9]* warning)'; then
    status=WARNINGS
  fi
  printf '%-26s %-10s %-13s %4ss  %s\n' "$name" "$tool" "$status" "$dt" "${errs:-no summary}"
}
export -f one

if [ "$#" -gt 0 ]; then
  scripts=()
  for s in "$@"; do scripts+=("$HERE/$(basename "$s")"); done
else
  scripts=("$HERE"/mosaic_*.py "$HERE"/combine_*.py)
fi

echo "compute-sanitizer: $SAN_BIN; tools: $TOOLS; limit ${SAN_LIMIT}s; $JOBS at once; logs in $SAN_LOGS"
[ "$SAN_BIN" != none ] && "$SAN_BIN" --version 2>/dev/null | tail -1
results="$SAN_LOGS/results.txt"
: >"$results"
for tool in $TOOLS; do
  for s in "${scripts[@]}"; do
    printf '%s %s\n' "$s" "$tool"
  done
done | xargs -P "$JOBS" -L 1 bash -c 'one "$0" "$1"' | tee -a "$results"
echo "===== results (kernel, tool, result, seconds, sanitizer summary)"
sort "$results"
! grep -Eqv ' (PASS|SKIP) ' "$results"
