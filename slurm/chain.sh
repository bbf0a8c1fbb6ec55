#!/bin/bash
# For sites that forbid requeue: submit N jobs, each starting only if the one before it did not
# succeed (--dependency=afternotok: it stopped with status 3 to be continued); each resumes from the
# newest checkpoint in RUN/ckpt. Once a link finishes the run (status 0), Slurm cancels the links
# left (--kill-on-invalid-dep=yes). A link that stops on bad input (status 2) cancels the links left
# itself: each would stop on the same input. (The links share a job name of their own,
# TRELLIS_CHAIN, by which train.sbatch finds them.)
#   slurm/chain.sh N inputs/default.deck [--section.key=value ...]
set -euo pipefail
n=${1:?usage: slurm/chain.sh N DECK [overrides]}; shift
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "slurm/chain.sh: N must be a positive count, not '$n'" >&2; exit 2; }
export TRELLIS_CHAIN="trellis-chain-$(date +%Y%m%d-%H%M%S)-$$"
script="$(cd "$(dirname "$0")" && pwd)/train.sbatch"
prev=""
for i in $(seq 1 "$n"); do
  dep=${prev:+--dependency=afternotok:$prev --kill-on-invalid-dep=yes}
  # shellcheck disable=SC2086  # $dep is two options or none
  prev=$(TRELLIS_CHAIN_LINK="$i/$n" sbatch --parsable --no-requeue --job-name="$TRELLIS_CHAIN" $dep \
         "$script" "$@")
  prev=${prev%%;*}   # "id;cluster" on federated sites
  echo "submitted $prev (link $i of $n, chain $TRELLIS_CHAIN)"
done
