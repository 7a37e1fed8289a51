#!/usr/bin/env bash
# Alternate a benchmark between this checkout and another commit, on the same machine, in
# turn (this machine's speed drifts by tens of percent within minutes: one run each would
# compare moments, not code). The other commit is checked out in a git worktree under /tmp
# that shares this checkout's .venv.
#
#   bash bench/compare_commits.sh COMMIT RUNS -- python -m bench.router_overhead ARGS...
#
# e.g. bash bench/compare_commits.sh 63da72b 3 -- -m bench.router_overhead --ks 0,8 \
#          --rounds 1 --no-sglang --throughput-seconds 0 --requests 800 --no-write
# Prints each run's output (filtered to lines with "over" and "A/B"), marked with its tree.
set -euo pipefail
commit=$1 runs=$2
shift 2
[ "${1:-}" = "--" ] && shift
here=$(cd "$(dirname "$0")/.." && pwd)
other=/tmp/compare-$(git -C "$here" rev-parse --short "$commit")
if [ ! -d "$other" ]; then
  git -C "$here" worktree add -q --detach "$other" "$commit"
fi
[ -e "$other/.venv" ] || ln -s "$here/.venv" "$other/.venv"
for i in $(seq 1 "$runs"); do
  for tree in "$here" "$other"; do
    label=$([ "$tree" = "$here" ] && git -C "$here" rev-parse --short HEAD || echo "$commit")
    echo "== run $i: $label ($tree)"
    (cd "$tree" && .venv/bin/python "$@" 2>&1 | grep -E "over [0-9]+ rounds|A/B" || true)
  done
done
