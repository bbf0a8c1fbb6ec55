#!/bin/bash
# For sites that forbid requeue: submit N jobs chained with --dependency=afterany; each resumes
# from RUN/ckpt/latest and the chain ends early once the run has finished (summary.json exists).
#   slurm/chain.sh N inputs/default.deck [--section.key=value ...]
set -euo pipefail
n=${1:?usage: slurm/chain.sh N DECK [overrides]}; shift
prev=""
for i in $(seq 1 "$n"); do
  dep=${prev:+--dependency=afterany:$prev}
  prev=$(sbatch --parsable --no-requeue $dep slurm/train.sbatch "$@")
  echo "submitted $prev (link $i of $n)"
done
