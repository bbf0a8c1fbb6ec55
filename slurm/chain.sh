#!/bin/bash
# For sites that forbid requeue: submit N jobs, each starting only if the one before it did not
# succeed (--dependency=afternotok: it stopped with status 3 to be continued); each resumes from
# RUN/ckpt/latest. Once a link finishes the run (status 0), Slurm cancels the links left
# (--kill-on-invalid-dep=yes).
#   slurm/chain.sh N inputs/default.deck [--section.key=value ...]
set -euo pipefail
n=${1:?usage: slurm/chain.sh N DECK [overrides]}; shift
prev=""
for i in $(seq 1 "$n"); do
  dep=${prev:+--dependency=afternotok:$prev --kill-on-invalid-dep=yes}
  prev=$(sbatch --parsable --no-requeue $dep slurm/train.sbatch "$@")
  echo "submitted $prev (link $i of $n)"
done
