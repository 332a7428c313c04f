#!/usr/bin/env bash
# make test: the suites in lanes at once (2 cores: one suite alone leaves about 45 % of them idle:
# its ranks wait on each other, on servers starting, on the timeouts it tests). Each lane takes
# the next suite not yet started, in the order given (one that keeps the lanes' sums close: see
# the Makefile's test target); each suite's output goes to
# .test-logs/<suite>.log and is printed whole once it ends, then every suite's exit code, its
# seconds, and the time in all.
# Usage: scripts/run_suites.sh LANES SUITE... (make targets)
set -u
lanes=$1
shift
mkdir -p .test-logs
rm -f .test-logs/*.rc .test-logs/*.seconds .test-logs/next .test-logs/next.lock
echo 0 > .test-logs/next
suites=("$@")
take() {  # the index of the next suite not yet started (one lane at a time), or nothing
  (
    flock 9
    i=$(cat .test-logs/next)
    echo $((i + 1)) > .test-logs/next
    [ "$i" -lt ${#suites[@]} ] && echo "$i"
  ) 9> .test-logs/next.lock
}
run_lane() {
  while i=$(take) && [ -n "$i" ]; do
    suite=${suites[$i]} t0=$(date +%s)
    make --no-print-directory "$suite" > ".test-logs/$suite.log" 2>&1
    echo $? > ".test-logs/$suite.rc"
    echo $(( $(date +%s) - t0 )) > ".test-logs/$suite.seconds"
    cat ".test-logs/$suite.log"
  done
}
# Each lane gets its share of the cores: torch in every test process and rank uses that many
# threads (REFIT_CORES, megatron_refit/local/launch.py; OMP_NUM_THREADS); more would spin on
# cores the other lane is using (a one-rank bf16 test ran 3.3x its time alone).
share=$(( $(nproc) / lanes )); [ "$share" -ge 1 ] || share=1
export REFIT_CORES=${REFIT_CORES:-$share} OMP_NUM_THREADS=${OMP_NUM_THREADS:-$share}
start=$(date +%s)
pids=()
for _ in $(seq "$lanes"); do run_lane & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid"; done
rc=0
for suite in "${suites[@]}"; do
  code=$(cat ".test-logs/$suite.rc" 2>/dev/null || echo 1)
  echo "$suite: exit $code ($(cat ".test-logs/$suite.seconds" 2>/dev/null || echo '?') s)"
  [ "$code" = 0 ] || rc=1
done
echo "make test: $(( $(date +%s) - start )) s of tests after setup (budget 900 s)"
exit $rc
