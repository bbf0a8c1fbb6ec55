#!/usr/bin/env bash
# slurm/train.sbatch under a real Slurm on this machine: munged, slurmctld and slurmd are started
# on localhost from a slurm.conf in a temporary directory, the script is submitted for a tiny deck
# with a one-minute time limit, so that the stop signal (--signal=B:USR1) arrives mid-run; the job
# must checkpoint, requeue itself, resume from `latest` and finish with the same final loss as an
# uninterrupted mpirun run of the same deck, bitwise. The daemons are stopped at the end, by PID.
# Needs root (the daemons run as root) and Debian's slurm-wlm and munge (installed when missing).
# Where Slurm cannot run here, prints why and reports "slurm: 0 passed, 0 failed".
# Usage: test_slurm.sh BUILD_DIR. Ends with "slurm: N passed, M failed".
set -u
build=$(cd "${1:-build}" && pwd) || { echo "slurm: no build directory ${1:-build}"; echo "slurm: 0 passed, 1 failed"; exit 1; }
cd "$(dirname "$0")/../.."
repo=$(pwd)
steps=${TRELLIS_SLURM_STEPS:-3000}     # at step_ms each, over a minute: the signal comes mid-run
step_ms=${TRELLIS_SLURM_STEP_MS:-20}   # the job's steps sleep this long first (TRELLIS_FAULT_STEP_MS),
                                       # so its length does not depend on this machine's speed
wait_s=${TRELLIS_SLURM_WAIT:-300}      # the most the job may take, requeue included
t0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t0 ))s"; }

skip() {   # Slurm cannot run in this environment: say why, count nothing
  echo "slurm: SKIPPED: $*"
  echo "slurm: 0 passed, 0 failed"
  exit 0
}

[ "$(id -u)" -eq 0 ] || skip "needs root to run munged, slurmctld and slurmd"
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null ||
   ! command -v munged >/dev/null; then
  echo "slurm: installing slurm-wlm and munge"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge > /tmp/trellis-slurm-apt.log 2>&1 ||
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge > /tmp/trellis-slurm-apt.log 2>&1; } ||
    { tail -5 /tmp/trellis-slurm-apt.log; skip "could not install slurm-wlm and munge (log above)"; }
fi

work=$(mktemp -d /tmp/trellis-slurm-XXXXXX) || exit 1
chmod 700 "$work"
pids=()      # daemons and background runs this test started
jobid=""
cleanup() {
  if [ -n "$jobid" ]; then scancel "$jobid" 2>/dev/null; sleep 2; fi
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq 1 50); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
  [ -n "${TRELLIS_SLURM_KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT

passed=0 failed=0
check() { if eval "$2"; then passed=$((passed + 1)); echo "ok   $1"; else failed=$((failed + 1)); echo "FAIL $1"; fi; }
final_loss() { python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["final_loss"]))' "$1" 2>/dev/null; }
logs() {
  local f
  for f in munged.log slurmctld.log slurmd.log; do
    echo "----- $f (last 40 lines)"; tail -n 40 "$work/$f" 2>/dev/null
  done
}

cat > "$work/slurm.deck" <<DECK
[model]
layers = 2
d_model = 16
heads = 2
seq_len = 8
vocab = 29
[parallel]
dp = 1
[train]
steps = $steps
global_batch = 4
micro_batch = 1
[data]
synthetic_tokens = 8192
[checkpoint]
every = 0
[log]
every = 500
DECK

# The uninterrupted run, alongside the Slurm job (one rank each; the result does not depend on timing).
mpi_flags=(--oversubscribe --bind-to none --allow-run-as-root -x OPENBLAS_NUM_THREADS=1)
timeout 300 mpirun "${mpi_flags[@]}" -np 1 "$build/trellis" train "$work/slurm.deck" --run.dir="$work/whole" \
  > "$work/whole.log" 2>&1 &
whole_pid=$!
pids+=("$whole_pid")

# munged on a private socket with its own key, so that it neither needs nor disturbs a system one.
mkdir -p "$work/munge" "$work/state" "$work/spool"
chmod 700 "$work/munge"
if command -v mungekey >/dev/null; then
  mungekey --create --keyfile="$work/munge/munge.key" >/dev/null 2>&1
else
  dd if=/dev/urandom of="$work/munge/munge.key" bs=1 count=1024 status=none
fi
chmod 600 "$work/munge/munge.key"
sock="$work/munge/munge.socket"
munged --foreground --force --socket="$sock" --key-file="$work/munge/munge.key" \
  --pid-file="$work/munge/munged.pid" --seed-file="$work/munge/munged.seed" --log-file="$work/munged.log" \
  > "$work/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 1 50); do [ -S "$sock" ] && break; sleep 0.1; done
if ! munge --socket="$sock" -n 2>/dev/null | unmunge --socket="$sock" >/dev/null 2>&1; then
  cat "$work/munged.out"; logs
  skip "munged did not start (its output above)"
fi

host=$(hostname -s)
port=$((20000 + $$ % 20000))
export SLURM_CONF="$work/slurm.conf"
cat > "$SLURM_CONF" <<CONF
ClusterName=trellistest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock,cred_expire=10
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
JobRequeue=1
MinJobAge=60
KillWait=10
InactiveLimit=0
SlurmdTimeout=60
NodeName=$host NodeAddr=127.0.0.1 CPUs=4 RealMemory=1000 State=UNKNOWN
PartitionName=trellis Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF

slurmctld -D -i -f "$SLURM_CONF" > "$work/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" > "$work/slurmd.out" 2>&1 &
pids+=($!)
up=0
for _ in $(seq 1 60); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null)
  case $state in idle*|mix*|alloc*) up=1; break ;; esac
  sleep 0.5
done
if [ $up -eq 0 ]; then
  echo "node state: '${state:-none}'"; cat "$work/slurmctld.out" "$work/slurmd.out"; logs
  skip "slurmctld/slurmd did not bring the node up (logs above)"
fi
echo "slurm: daemons up after $(elapsed)"

# The job: a one-minute limit and the stop signal 50 s before it (slurmctld checks about every 30 s,
# so the signal comes 10 to 40 s into the run). The command line overrides the script's defaults.
mkdir -p "$work/run"
out="$work/run/slurm-job.out"
jobid=$(TRELLIS="$build/trellis" TRELLIS_FAULT_STEP_MS=$step_ms sbatch --parsable --chdir="$repo" --output="$out" \
  --time=00:01:00 --signal=B:USR1@50 --ntasks-per-node=1 --cpus-per-task=1 \
  slurm/train.sbatch "$work/slurm.deck" --run.dir="$work/run" 2>"$work/sbatch.err")
jobid=${jobid%%;*}
if [ -z "$jobid" ]; then
  cat "$work/sbatch.err"; logs
fi
check "sbatch accepts slurm/train.sbatch" '[ -n "$jobid" ]'

# Wait for the job to end, at most wait_s. Once it has requeued itself, give the next start a
# limit it will not reach, so that the test sees exactly one requeue. (The requeued job waits
# cred_expire seconds before it starts again, so the old step is gone by then.)
state="" restarts=0 extended=0
while [ -n "$jobid" ] && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do
  info=$(scontrol -o show job "$jobid" 2>/dev/null) || { state=PURGED; break; }
  state=$(sed -nE 's/.*JobState=([A-Z_]+).*/\1/p' <<< "$info")
  restarts=$(sed -nE 's/.*Restarts=([0-9]+).*/\1/p' <<< "$info")
  if [ "${restarts:-0}" -ge 1 ] && [ $extended -eq 0 ]; then
    echo "slurm: requeued after $(elapsed) (state $state)"
    scontrol update JobId="$jobid" TimeLimit=00:10:00 2>&1
    extended=1
  fi
  case $state in
    COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED) break ;;
  esac
  sleep 1
done
echo "slurm: job $jobid ended as ${state:-?} after $(elapsed), restarts ${restarts:-0}"
echo "----- job output"; cat "$out" 2>/dev/null | grep -v '^[│┌└├]'
if [ "$state" != COMPLETED ]; then
  scontrol -o show job "$jobid" 2>/dev/null; logs
fi
check "job completed within ${wait_s}s" '[ "$state" = COMPLETED ]'
if [ "$state" = COMPLETED ] && [ "${restarts:-0}" -eq 0 ]; then
  echo "slurm: the run finished before the stop signal came; raise TRELLIS_SLURM_STEPS (now $steps) or TRELLIS_SLURM_STEP_MS (now $step_ms)"
fi
check "checkpointed before the time limit and requeued, once" \
  '[ "$(grep -c "checkpointed before the time limit; requeueing" "$out" 2>/dev/null)" = 1 ]'
check "second start resumed from the checkpoint" \
  'sed -n "/requeueing/,\$p" "$out" | grep -q "restart count 1" && sed -n "/restart count 1/,\$p" "$out" | grep -q "resumed from"'
check "second start finished" 'sed -n "/restart count 1/,\$p" "$out" | grep -q "^trellis: finished"'

wait "$whole_pid"
whole_rc=$?
[ $whole_rc -eq 0 ] || tail -20 "$work/whole.log"
check "uninterrupted run finishes" '[ $whole_rc -eq 0 ] && [ -f "$work/whole/summary.json" ]'
a=$(final_loss "$work/run/summary.json") b=$(final_loss "$work/whole/summary.json")
echo "final loss: slurm job ${a:-none}, uninterrupted ${b:-none}"
check "same final loss as the uninterrupted run" '[ -n "$a" ] && [ "$a" = "$b" ]'
# slurm/chain.sh, for sites that forbid requeue: links that end on bad input (status 2) cancel the
# links left; a link that finishes the run leaves the next one's dependency unmet, which Slurm
# cancels (--kill-on-invalid-dep). Both chains run from a directory of their own, where the
# links write their output.
job_state() {   # JOBID: its state, once it has ended (at most 120 s); PURGED once Slurm forgot it
  local st=""
  for _ in $(seq 1 240); do
    local info
    info=$(scontrol -o show job "$1" 2>&1)
    grep -q "Invalid job id" <<< "$info" && { echo PURGED; return; }
    st=$(sed -nE 's/.*JobState=([A-Z_]+).*/\1/p' <<< "$info")   # ("": slurmctld slow to answer)
    case $st in
      COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED)
        echo "$st"; return ;;
    esac
    sleep 0.5
  done
  echo "$st"
}
chain_links() { sed -nE 's/^submitted ([0-9]+) .*/\1/p' "$1"; }
mkdir -p "$work/chain"
(cd "$work/chain" && TRELLIS="$build/trellis" bash "$repo/slurm/chain.sh" 2 "$work/slurm.deck" \
   --run.dir="$work/chain/bad" --train.steps=many > submitted-bad.txt 2>&1)
(cd "$work/chain" && TRELLIS="$build/trellis" bash "$repo/slurm/chain.sh" 2 "$work/slurm.deck" \
   --run.dir="$work/chain/ok" --train.steps=20 > submitted-ok.txt 2>&1)
cat "$work/chain/submitted-bad.txt" "$work/chain/submitted-ok.txt"
mapfile -t bad < <(chain_links "$work/chain/submitted-bad.txt")
mapfile -t ok < <(chain_links "$work/chain/submitted-ok.txt")
bad1=$(job_state "${bad[0]:-none}") bad2=$(job_state "${bad[1]:-none}")
ok1=$(job_state "${ok[0]:-none}") ok2=$(job_state "${ok[1]:-none}")
echo "chain on bad input: $bad1, $bad2; chain that finishes: $ok1, $ok2"
for f in "$work"/chain/*.out; do echo "----- $(basename "$f")"; grep -v '^[│┌└├]' "$f"; done
check "chain: a link ending on bad input cancels the links left, which never start" \
  '[ "$bad1" = FAILED ] && [ "$bad2" = CANCELLED ] && ! ls "$work"/chain/*-"${bad[1]:-none}".out >/dev/null 2>&1'
check "chain: the links after the one that finishes are cancelled" \
  '[ "$ok1" = COMPLETED ] && [ "$ok2" = CANCELLED ] && [ -f "$work/chain/ok/summary.json" ] &&
   ! ls "$work"/chain/*-"${ok[1]:-none}".out >/dev/null 2>&1'

echo "slurm: took $(elapsed)"
echo "slurm: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
