#!/usr/bin/env bash
# make test: the suites in lanes at once (2 cores: one suite alone leaves about 45 % of them idle:
# its ranks wait on each other, on servers starting, on the timeouts it tests). Each lane runs its
# suites in order; each suite's output goes to .test-logs/<suite>.log and is printed whole once
# it ends, then every suite's exit code and the time in all.
# Usage: scripts/run_suites.sh SUITE... (make targets; "-" starts the next lane).
set -u
mkdir -p .test-logs
rm -f .test-logs/*.rc
run_lane() {
  for suite in "$@"; do
    make --no-print-directory "$suite" > ".test-logs/$suite.log" 2>&1
    echo $? > ".test-logs/$suite.rc"
    cat ".test-logs/$suite.log"
  done
}
# Each lane gets its share of the cores: torch in every test process and rank uses that many
# threads (REFIT_CORES, megatron_refit/testing/launch.py; OMP_NUM_THREADS); more would spin on
# cores the other lane is using (a one-rank bf16 test ran 3.3x its time alone).
lanes=1
for arg in "$@"; do [ "$arg" = "-" ] && lanes=$((lanes + 1)); done
share=$(( $(nproc) / lanes )); [ "$share" -ge 1 ] || share=1
export REFIT_CORES=${REFIT_CORES:-$share} OMP_NUM_THREADS=${OMP_NUM_THREADS:-$share}
start=$(date +%s)
suites=() lane=() pids=()
for arg in "$@" -; do
  if [ "$arg" = "-" ]; then
    if [ ${#lane[@]} -gt 0 ]; then run_lane "${lane[@]}" & pids+=($!); fi
    lane=()
  else
    lane+=("$arg") suites+=("$arg")
  fi
done
for pid in "${pids[@]}"; do wait "$pid"; done
rc=0
for suite in "${suites[@]}"; do
  code=$(cat ".test-logs/$suite.rc" 2>/dev/null || echo 1)
  echo "$suite: exit $code"
  [ "$code" = 0 ] || rc=1
done
echo "make test: $(( $(date +%s) - start )) s of tests after setup (budget 900 s)"
exit $rc
