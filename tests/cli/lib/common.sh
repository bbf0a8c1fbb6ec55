# Shared by the whole-program tests in tests/cli/ (sourced, not run): mpirun flags, the
# pass/fail bookkeeping behind each test's last line "NAME: N passed, M failed", and cases run
# side by side.
flags=(--oversubscribe --bind-to none -x OPENBLAS_NUM_THREADS=1)
# When a rank ends with a non-zero status — most of these cases — mpirun waits
# odls_base_sigkill_timeout (1 s, twice over: 2 s a job) before it kills the ranks still running
# and returns. Here it kills them at once: by then they have finished what the cases check (their
# messages, their files) or wait for the one that ended. test_bad_input.sh: 59 s → 24 s.
export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-0}
[ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
passed=0 failed=0
# check DESCRIPTION CONDITION: evaluates the condition and counts it; on failure prints
# $check_log (when set) to show what the program said.
check() {
  if eval "$2"; then
    passed=$((passed + 1)); echo "ok   $1"
  else
    failed=$((failed + 1)); echo "FAIL $1"
    [ -n "${check_log:-}" ] && [ -f "$check_log" ] && head -20 "$check_log"
  fi
  return 0
}
# tiny_deck FILE: writes the tiny model the whole-program tests train (2 layers, d_model 16, 2 heads,
# seq_len 8, vocab 29, synthetic data, no resuming), with the [train]/[parallel] sections read from
# standard input.
tiny_deck() {
  { printf '[model]\nlayers = 2\nd_model = 16\nheads = 2\nseq_len = 8\nvocab = 29\n'
    cat
    printf '[checkpoint]\nresume = never\n[data]\nsynthetic_tokens = 8192\n'; } > "$1"
}
# small_deck FILE: the 4-layer model (d_model 64, 4 heads, seq_len 32, vocab 64; 2 steps of 8
# sequences in micro-batches of 2, synthetic data, no resuming) whose memory the plan and tune
# tests measure, with more sections ([system]) from standard input.
small_deck() {
  { printf '[model]\nlayers = 4\nd_model = 64\nheads = 4\nseq_len = 32\nvocab = 64\n'
    printf '[train]\nsteps = 2\nglobal_batch = 8\nmicro_batch = 2\n'
    printf '[checkpoint]\nresume = never\n[data]\nsynthetic_tokens = 16384\n'
    cat; } > "$1"
}
# in_background COMMAND...: runs the command (a function that checks one case, with check or its
# own "ok   " / "FAIL " lines) in the background, up to 3 at a time — most of a small case's time
# is mpirun starting the job and its ranks meeting, not CPU — with the environment and variables
# as they are at the call, and $case (0, 1, ...) naming it, for files of its own under $work.
# Its output goes to $work/case-$case.txt (its input is /dev/null: mpirun would read the caller's);
# collect prints them in order and counts their verdicts.
cases=0
in_background() {
  local n=$cases
  cases=$((cases + 1))
  while [ "$(jobs -rp | wc -l)" -ge 3 ]; do wait -n; done
  case=$n "$@" > "${work:?}/case-$n.txt" 2>&1 < /dev/null &
}
# collect: waits for every case in_background started, prints each one's output in the order
# they were started, and counts their ok and FAIL lines.
collect() {
  wait
  local n out
  for ((n = 0; n < cases; n++)); do
    out="$work/case-$n.txt"
    cat "$out"
    passed=$((passed + $(grep -c '^ok   ' "$out")))
    failed=$((failed + $(grep -c '^FAIL ' "$out")))
  done
  cases=0
}
# signal_when_caught SIGNAL PATTERN [LOG REGEX [COUNT]]: waits (up to 60 s) until LOG has a line
# matching REGEX (when given; "" for none) and every process whose command line starts with PATTERN
# (pgrep -f "^PATTERN": the ranks, not mpirun) — at least COUNT of them (default 1) — has a handler
# for SIGNAL in place (its bit in /proc/PID/status's SigCgt; before that the signal's default
# action would end it), then sends SIGNAL to them. Returns 1, sending nothing, when that did not
# happen in time.
signal_when_caught() {
  wait_until_caught "$@" && pkill "-$1" -f "^$2"
}
# wait_until_caught SIGNAL PATTERN [LOG REGEX]: signal_when_caught's wait alone (sends nothing).
wait_until_caught() {
  local sig=$1 pattern=$2 log=${3:-} regex=${4:-} count=${5:-1} number bit pids pid mask ready
  number=$(kill -l "$sig") || return 1
  bit=$((1 << (number - 1)))
  for _ in $(seq 1 600); do
    ready=0
    if [ -z "$log" ] || grep -qE "$regex" "$log" 2>/dev/null; then
      pids=$(pgrep -f "^$pattern")
      [ "$(printf '%s\n' $pids | grep -c .)" -ge "$count" ] && ready=1
      for pid in $pids; do
        mask=$(sed -n 's/^SigCgt:\s*//p' "/proc/$pid/status" 2>/dev/null)
        if [ -z "$mask" ] || [ $((0x$mask & bit)) -eq 0 ]; then ready=0; fi
      done
    fi
    [ $ready -eq 1 ] && return 0
    sleep 0.1
  done
  return 1
}
