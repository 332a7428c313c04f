#!/usr/bin/env bash
# scripts/need_disk.sh GB WHAT: fail at once, naming the numbers, where the disk holding the
# work tree has less than GB GiB free (a venv install that runs out of disk half-way fails later,
# deep in pip, with "No space left on device").
set -euo pipefail
need_gb=$1
what=$2
free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ "$free_kb" -lt $(( need_gb * 1024 * 1024 )) ]; then
  echo "error: $what needs about $need_gb GiB of free disk; $(( free_kb / 1024 / 1024 )) GiB free on $(df -P . | awk 'NR == 2 {print $6}')" >&2
  exit 1
fi
