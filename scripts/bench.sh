#!/usr/bin/env bash
# `make bench`: one training step of the benchmark model next to this machine's sgemm GFLOP/s,
# measured by the same program. Usage: scripts/bench.sh [BUILD_DIR] [DECK]
set -euo pipefail
build=${1:-build}
deck=${2:-inputs/bench.deck}
cd "$(dirname "$0")/.."
flags=(--bind-to none)
[ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
mpirun "${flags[@]}" -np 1 "$build/trellis" bench "$deck"
