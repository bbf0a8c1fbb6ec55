# Shared by the whole-program tests in tests/cli/ (sourced, not run): mpirun flags and the
# pass/fail bookkeeping behind each test's last line "NAME: N passed, M failed".
flags=(--oversubscribe --bind-to none -x OPENBLAS_NUM_THREADS=1)
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
