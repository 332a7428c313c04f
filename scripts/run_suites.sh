#!/usr/bin/env bash
# make test: the suites in two lanes at once (2 cores: a suite alone leaves about 45 % of them
# idle: its ranks wait on each other, on servers starting, on timeouts it tests). The Makefile's
# lanes: the main tiers (unit, mp, megatron); vLLM, then the running vLLM server, then SGLang.
# Each suite's output goes to .test-logs/<suite>.log and is printed whole once it ends.
# Usage: scripts/run_suites.sh SUITE... (make targets; "-" separates the lanes).
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
lane1=() lane2=() current=1
for arg in "$@"; do
  if [ "$arg" = "-" ]; then current=2; continue; fi
  if [ $current = 1 ]; then lane1+=("$arg"); else lane2+=("$arg"); fi
done
start=$(date +%s)
run_lane "${lane1[@]}" &
first=$!
if [ ${#lane2[@]} -gt 0 ]; then run_lane "${lane2[@]}"; fi
wait $first
rc=0
for suite in "${lane1[@]}" "${lane2[@]}"; do
  code=$(cat ".test-logs/$suite.rc" 2>/dev/null || echo 1)
  echo "$suite: exit $code"
  [ "$code" = 0 ] || rc=1
done
echo "make test: $(( $(date +%s) - start )) s of tests after setup (budget 900 s)"
exit $rc
