#!/usr/bin/env bash
# `make bench`: the benchmark model's step time (the median of 9 rounds of 3 steps) next to this
# machine's sgemm GFLOP/s, measured by the same program. Usage: scripts/bench.sh [BUILD_DIR] [DECK]
set -euo pipefail
# BUILD_DIR and DECK as given are relative to where it was called from; the defaults to the repo.
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
build=${1:+$(abs "$1")}
deck=${2:+$(abs "$2")}
cd "$(dirname "$0")/.."
build=${build:-build}
deck=${deck:-inputs/bench.deck}
[ -x "$build/trellis" ] || { echo "bench.sh: no $build/trellis (build first: make)" >&2; exit 2; }
flags=(--bind-to none)
[ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
mpirun "${flags[@]}" -np 1 "$build/trellis" bench "$deck"
