#!/usr/bin/env bash
# A full disk during a checkpoint: checkpoint.dir on a small tmpfs that holds one checkpoint file
# but not two, so the second write (step 6) runs out of space — once with less room than the
# data (refused before writing), once with room for the data but not the whole file (the disk
# fills in the middle of the parallel HDF5 write). Expect: exit 2 within a bounded time, one
# message naming the file and the system's reason ("No space left on device"); the step-3
# checkpoint intact, still `latest`, verified by trellis inspect; no temporary file left behind.
# Then the recovery the README gives: make room (here: the tmpfs grown) and resubmit — the job
# resumes from step 3 and finishes.
# Needs root to mount the tmpfs (CI runs as root); where it cannot mount one it says so and
# counts nothing. Usage: test_full_disk.sh BUILD_DIR. Ends with "fulldisk: N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-full-XXXXXX) || exit 1
small="$work/small"
cleanup() {
  pkill -9 -f "${work:?}" 2>/dev/null
  mountpoint -q "$small" && umount "$small"
  rm -rf "$work"
}
trap cleanup EXIT
[ -n "${KEEP_WORK:-}" ] && trap - EXIT
source "$(dirname "$0")/lib/common.sh"
limit=60
cat > "$work/full.deck" <<'DECK'
[model]
layers = 2
d_model = 32
heads = 2
seq_len = 8
vocab = 29
[parallel]
dp = 2
zero = 1
[train]
steps = 10
global_batch = 4
micro_batch = 1
[checkpoint]
every = 3
[data]
synthetic_tokens = 8192
DECK

mkdir -p "$small"
if [ "$(id -u)" -ne 0 ] || ! mount -t tmpfs -o size=64k tmpfs "$small" 2> "$work/mount.err"; then
  echo "fulldisk: SKIPPED: cannot mount a tmpfs here (needs root): $(cat "$work/mount.err" 2>/dev/null)"
  echo "fulldisk: 0 passed, 0 failed"
  exit 0
fi
umount "$small"

# The size of one checkpoint of this deck and of its data alone, from a short run on the ordinary disk.
timeout 120 mpirun "${flags[@]}" -np 2 "$build/trellis" train "$work/full.deck" --train.steps=3 \
  --run.dir="$work/probe" > "$work/probe.log" 2>&1
one=$(stat -c %s "$work/probe/ckpt/step_00000003.h5" 2>/dev/null || echo 0)
data=$(( $("$build/trellis" inspect "$work/probe/ckpt/step_00000003.h5" | sed -nE 's/.* datasets, ([0-9]+) elements.*/\1/p') * 4 ))
check_log="$work/probe.log"
check "a checkpoint of this deck is written (${one} bytes, ${data} bytes of data)" '[ "$one" -gt 0 ] && [ "$data" -gt 0 ]'
# What the room check asks for one (more than the file: its metadata counted twice), from its
# refusal on a tmpfs of 64 KiB.
mount -t tmpfs -o size=64k tmpfs "$small"
timeout 120 mpirun "${flags[@]}" -np 2 "$build/trellis" train "$work/full.deck" --train.steps=3 \
  --run.dir="$work/probe2" --checkpoint.dir="$small/ckpt" > "$work/probe2.log" 2>&1
umount "$small"
need=$(sed -nE 's/.*it needs ([0-9.]+) KiB.*/\1/p' "$work/probe2.log" | head -1)
need=$(awk -v k="${need:-0}" 'BEGIN { printf "%d", k * 1024 + 1023 }')
check_log="$work/probe2.log"
check "the room check asks for ${need} bytes: more than the file" '[ "$need" -gt "$one" ]'

# full_case NAME ROOM_BYTES [RANKS]: a first job writes the step-3 checkpoint on a tmpfs with room
# for it; the tmpfs is then shrunk to ROOM_BYTES more than that file, and the job resubmitted: the
# step-6 checkpoint does not fit. RANKS: 2 (dp 2), or 1.
full_case() {
  local name=$1 room=$2 np=${3:-2}
  local kib=$(( (one + room) / 1024 ))
  mount -t tmpfs -o size=$(( (need + one) / 1024 ))k tmpfs "$small"
  timeout 300 mpirun "${flags[@]}" -np "$np" "$build/trellis" train "$work/full.deck" --run.dir="$work/run-$name" \
    --checkpoint.dir="$small/ckpt" --parallel.dp="$np" --train.steps=3 > "$work/$name.first.log" 2>&1
  check_log="$work/$name.first.log"
  check "$name: a first job writes the step-3 checkpoint" '[ "$(cat "$small/ckpt/latest")" = step_00000003.h5 ]'
  mount -o remount,size=${kib}k "$small"
  echo "     $name: checkpoint.dir on a tmpfs shrunk to ${kib} KiB"
  check_log="$work/$name.log"
  local start rc elapsed
  start=$(date +%s)
  timeout 300 mpirun "${flags[@]}" -np "$np" "$build/trellis" train "$work/full.deck" --run.dir="$work/run-$name" \
    --checkpoint.dir="$small/ckpt" --parallel.dp="$np" > "$check_log" 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  echo "     $name: the job ended with exit $rc after ${elapsed}s; it said:"
  grep -i "error" "$check_log" | sed 's/^/     | /'
  check "$name: the job ends with status 2 within ${limit}s (exit $rc, ${elapsed}s)" '[ $rc -eq 2 ] && [ $elapsed -lt $limit ]'
  check "$name: one message naming the step-6 file and 'No space left on device'" \
    '[ "$(grep -c "error:.*step_00000006.h5.*No space left on device" "$check_log")" -eq 1 ]'
  check "$name: latest still names step_00000003.h5" '[ "$(cat "$small/ckpt/latest")" = step_00000003.h5 ]'
  check "$name: no step-6 file and no temporary file left" '[ "$(ls "$small/ckpt" | tr "\n" " ")" = "latest step_00000003.h5 " ]'
  check "$name: step_00000003.h5 verifies (trellis inspect)" '"$build/trellis" inspect "$small/ckpt/step_00000003.h5" > "$work/$name.inspect"'

  # Recovery: room made (here the filesystem grown), the same job resubmitted.
  mount -o remount,size=$(( kib * 4 ))k "$small"
  check_log="$work/$name.resume.log"
  timeout 300 mpirun "${flags[@]}" -np "$np" "$build/trellis" train "$work/full.deck" --run.dir="$work/run-$name" \
    --checkpoint.dir="$small/ckpt" --parallel.dp="$np" > "$check_log" 2>&1
  rc=$?
  check "$name: with room again the job resumes at step 3 and finishes (exit $rc)" \
    '[ $rc -eq 0 ] && grep -q "at step 3 " "$check_log" && [ "$(cat "$small/ckpt/latest")" = step_00000010.h5 ]'
  umount "$small"
}

# Less room than the data: refused before HDF5 opens the file, by every rank alike.
full_case no-room $(( data / 2 ))
# Room for the data but not for the whole file: refused before writing too (the file's metadata
# counted).
full_case no-room-for-metadata $(( data + 64 * 1024 ))
# The disk fills as a checkpoint closes (another job takes the room meanwhile), at 2 ranks:
# TRELLIS_FAULT_FILL_DISK=close fills it but for 8 KiB just before HDF5's close. Without room
# taken before the data, HDF5 1.10's last metadata flush fails on a full disk and leaves the ranks
# in different collectives (a hang until system.hang_timeout_s). With it the file closes whole
# — the room in the file itself (blocks allocated past its end), or where the filesystem cannot
# allocate there (TRELLIS_FAULT_NO_FALLOCATE) the room for the metadata in a file beside it,
# removed just before the close. The next checkpoint is refused for want of room.
# fill_case NAME [ENV=VALUE ...]
fill_case() {
  local name=$1 env=() e
  shift
  for e in "$@"; do env+=(-x "$e"); done
  local kib=$(( (2 * one + 256 * 1024) / 1024 )) start rc elapsed
  mount -t tmpfs -o size=${kib}k tmpfs "$small"
  echo "     $name: checkpoint.dir on a tmpfs of ${kib} KiB, filled as the step-3 file closes"
  check_log="$work/$name.log"
  start=$(date +%s)
  timeout 300 mpirun "${flags[@]}" "${env[@]}" -x TRELLIS_FAULT_FILL_DISK=close -np 2 \
    "$build/trellis" train "$work/full.deck" --run.dir="$work/run-$name" \
    --checkpoint.dir="$small/ckpt" > "$check_log" 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  echo "     $name: the job ended with exit $rc after ${elapsed}s; it said:"
  grep -iE "error|checkpoint:" "$check_log" | sed 's/^/     | /'
  check "$name: the job ends with status 2 within ${limit}s (exit $rc, ${elapsed}s)" '[ $rc -eq 2 ] && [ $elapsed -lt $limit ]'
  check "$name: the step-3 file closed whole on the full disk: latest names it, inspect verifies it" \
    '[ "$(cat "$small/ckpt/latest")" = step_00000003.h5 ] &&
     "$build/trellis" inspect "$small/ckpt/step_00000003.h5" > "$work/$name.inspect"'
  check "$name: step 6 refused: one message naming step_00000006.h5 and 'No space left on device'" \
    '[ "$(grep -c "error:.*step_00000006.h5.*No space left on device" "$check_log")" -eq 1 ]'
  check "$name: no temporary file and no room left" \
    '[ "$(ls "$small/ckpt" | tr "\n" " ")" = "latest step_00000003.h5 " ]'
  rm -f "$small/ckpt/.trellis-fault-filler"
  mount -o remount,size=$(( kib * 4 ))k "$small"
  check_log="$work/$name.resume.log"
  timeout 300 mpirun "${flags[@]}" -np 2 "$build/trellis" train "$work/full.deck" \
    --run.dir="$work/run-$name" --checkpoint.dir="$small/ckpt" > "$check_log" 2>&1
  rc=$?
  check "$name: with room again the job resumes at step 3 and finishes (exit $rc)" \
    '[ $rc -eq 0 ] && grep -q "at step 3 " "$check_log" && [ "$(cat "$small/ckpt/latest")" = step_00000010.h5 ]'
  umount "$small"
}
fill_case fills-before-close
fill_case fills-before-close-room-beside TRELLIS_FAULT_NO_FALLOCATE=1

# faulted_job NAME NP [MPIRUN ARGS] -- [TRELLIS ARGS]: the deck's job at NP ranks, checkpoint.dir
# on the small tmpfs, its output in $work/NAME.log (check_log); says how it ended and checks that
# it ended with status 2 within $limit seconds.
faulted_job() {
  local name=$1 np=$2 mpi=() start rc elapsed
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do mpi+=("$1"); shift; done
  shift
  check_log="$work/$name.log"
  start=$(date +%s)
  timeout 300 mpirun "${flags[@]}" "${mpi[@]}" -np "$np" "$build/trellis" train "$work/full.deck" \
    --run.dir="$work/run-$name" --checkpoint.dir="$small/ckpt" "$@" > "$check_log" 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  echo "     $name: the job ended with exit $rc after ${elapsed}s; it said:"
  grep -E "trellis: error|checkpoint:" "$check_log" | cut -c1-300 | sed 's/^/     | /'
  check "$name: the job ends with status 2 within ${limit}s (exit $rc, ${elapsed}s)" '[ $rc -eq 2 ] && [ $elapsed -lt $limit ]'
}

# The disk fills once the room of a small checkpoint is taken, before its data, at 4 ranks (what
# once ended in HDF5 1.10's hang at the close, by the watchdog with status 4): the file's blocks
# are its own before the first write, so the step-6 file is written whole and published; what
# it did not use of its room is freed (the tmpfs holds the files' bytes, no more). Step 9 is
# refused for want of room.
fill_room_case() {
  local name=fills-after-room rc
  local kib=$(( (2 * one + need + 256 * 1024) / 1024 ))
  mount -t tmpfs -o size=${kib}k tmpfs "$small"
  timeout 300 mpirun "${flags[@]}" -np 4 "$build/trellis" train "$work/full.deck" --parallel.dp=4 \
    --run.dir="$work/run-$name" --checkpoint.dir="$small/ckpt" --train.steps=3 \
    > "$work/$name.first.log" 2>&1
  check_log="$work/$name.first.log"
  check "$name: a first job writes the step-3 checkpoint" '[ "$(cat "$small/ckpt/latest")" = step_00000003.h5 ]'
  faulted_job "$name" 4 -x TRELLIS_FAULT_FILL_DISK=data -- --parallel.dp=4
  check "$name: the step-6 file written on the filled disk: latest names it, inspect verifies it" \
    '[ "$(cat "$small/ckpt/latest")" = step_00000006.h5 ] &&
     "$build/trellis" inspect "$small/ckpt/step_00000006.h5" > "$work/$name.inspect"'
  local files used
  files=$(cat "$small/ckpt"/step_*.h5 "$small/ckpt/.trellis-fault-filler" | wc -c)
  used=$(( $(df -B1 --output=used "$small" | tail -1) ))
  check "$name: the room it did not use was freed: ${used} bytes used on the tmpfs, ${files} in its files" \
    '[ "$used" -le $(( files + 64 * 1024 )) ]'
  check "$name: step 9 refused: one message naming step_00000009.h5 and 'No space left on device'" \
    '[ "$(grep -c "error:.*step_00000009.h5.*No space left on device" "$check_log")" -eq 1 ]'
  check "$name: no temporary file left" \
    '[ "$(ls "$small/ckpt" | tr "\n" " ")" = "latest step_00000003.h5 step_00000006.h5 " ]'
  rm -f "$small/ckpt/.trellis-fault-filler"
  mount -o remount,size=$(( kib * 4 ))k "$small"
  check_log="$work/$name.resume.log"
  timeout 300 mpirun "${flags[@]}" -np 4 "$build/trellis" train "$work/full.deck" --parallel.dp=4 \
    --run.dir="$work/run-$name" --checkpoint.dir="$small/ckpt" > "$check_log" 2>&1
  rc=$?
  check "$name: with room again the job resumes at step 6 and finishes (exit $rc)" \
    '[ $rc -eq 0 ] && grep -q "at step 6 " "$check_log" && [ "$(cat "$small/ckpt/latest")" = step_00000010.h5 ]'
  umount "$small"
}
fill_room_case

# The disk filled to its last byte once the step-3 file is closed and the room it did not use
# freed (another job taking that room at once; TRELLIS_FAULT_FILL_DISK=closed), at 2 ranks: its
# `latest` was written beside it before the checkpoint (a rename needs no room), so step 3 is
# still published whole; step 6 is refused for want of room.
closed_case() {
  local name=fills-when-closed
  local kib=$(( (2 * one + need + 256 * 1024) / 1024 ))
  mount -t tmpfs -o size=${kib}k tmpfs "$small"
  faulted_job "$name" 2 -x TRELLIS_FAULT_FILL_DISK=closed --
  check "$name: step 3 published on the full disk: latest names it, inspect verifies it" \
    '[ "$(cat "$small/ckpt/latest")" = step_00000003.h5 ] &&
     "$build/trellis" inspect "$small/ckpt/step_00000003.h5" > "$work/$name.inspect"'
  check "$name: step 6 refused: one message naming step_00000006.h5 and 'No space left on device'" \
    '[ "$(grep -c "error:.*step_00000006.h5.*No space left on device" "$check_log")" -eq 1 ]'
  check "$name: no temporary file left" \
    '[ "$(ls "$small/ckpt" | tr "\n" " ")" = "latest step_00000003.h5 " ]'
  umount "$small"
}
closed_case

# The disk filled to its last byte just before the file's room is taken in it
# (TRELLIS_FAULT_FILL_DISK=room), at 2 and 4 ranks: the take fails, nothing more is written, and
# the file (its superblock and root group) closes on the metadata's room taken beside it before
# it was created — without that room HDF5 1.10's close ended in a crash at 2 ranks (status 139)
# and a hang at 4. Status 2 naming the file's room; the step-3 checkpoint stays latest.
room_taken_case() {
  local np=$1 name=full-at-room-np$1
  local kib=$(( (2 * one + need + 256 * 1024) / 1024 ))
  mount -t tmpfs -o size=${kib}k tmpfs "$small"
  timeout 300 mpirun "${flags[@]}" -np "$np" "$build/trellis" train "$work/full.deck" \
    --parallel.dp="$np" --run.dir="$work/run-$name" --checkpoint.dir="$small/ckpt" \
    --train.steps=3 > "$work/$name.first.log" 2>&1
  faulted_job "$name" "$np" -x TRELLIS_FAULT_FILL_DISK=room -- --parallel.dp="$np"
  check "$name: one message naming step_00000006.h5, its room and 'No space left on device'" \
    '[ "$(grep -c "error:.*step_00000006.h5: cannot set aside .* for the file .*No space left on device" "$check_log")" -eq 1 ]'
  check "$name: latest still names step_00000003.h5, nothing else left" \
    '[ "$(cat "$small/ckpt/latest")" = step_00000003.h5 ] && [ "$(ls "$small/ckpt" | tr "\n" " ")" = "latest step_00000003.h5 " ]'
  umount "$small"
}
room_taken_case 2
room_taken_case 4

# The disk fills just before the data of a checkpoint is written, on a filesystem that cannot
# allocate the file's room in it (TRELLIS_FAULT_NO_FALLOCATE: the metadata's room alone, beside
# it), at 4 ranks: Open MPI's MPI-IO (OMPIO) drops the collective writes' errors, HDF5 sees none,
# the close succeeds on the metadata's room, and the file would be published with chunks never
# written. The file is read back before it is published (its content
# digests): status 2, nothing published. A model of 168 MiB files (rows of 300000 values), as
# small ones can end in HDF5 1.10's hang at the close instead (README, "When things go wrong").
# Under ROMIO the write's own error ends the job (status 2, another message).
fill_data_case() {
  local name=fills-before-data big=(--model.d_model=8 --model.heads=8 --model.d_ff=300000)
  local start rc elapsed
  mount -t tmpfs -o size=600m tmpfs "$small"
  timeout 300 mpirun "${flags[@]}" -np 4 "$build/trellis" train "$work/full.deck" --parallel.dp=4 \
    "${big[@]}" --run.dir="$work/run-$name" --checkpoint.dir="$small/ckpt" --train.steps=3 \
    > "$work/$name.first.log" 2>&1
  check_log="$work/$name.first.log"
  check "$name: a first job writes the step-3 checkpoint" '[ "$(cat "$small/ckpt/latest")" = step_00000003.h5 ]'
  check_log="$work/$name.log"
  start=$(date +%s)
  timeout 300 mpirun "${flags[@]}" -x TRELLIS_FAULT_FILL_DISK=data -x TRELLIS_FAULT_NO_FALLOCATE=1 \
    -np 4 "$build/trellis" train "$work/full.deck" --parallel.dp=4 "${big[@]}" --run.dir="$work/run-$name" \
    --checkpoint.dir="$small/ckpt" > "$check_log" 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  echo "     $name: the job ended with exit $rc after ${elapsed}s; it said:"
  grep "trellis: error" "$check_log" | cut -c1-300 | sed 's/^/     | /'
  check "$name: the job ends with status 2 within ${limit}s (exit $rc, ${elapsed}s)" '[ $rc -eq 2 ] && [ $elapsed -lt $limit ]'
  check "$name: step 6 refused (read back, under OMPIO): one message naming it and 'No space left on device'" \
    '[ "$(grep -c "error:.*step_00000006.h5: .*No space left on device" "$check_log")" -eq 1 ]'
  check "$name: latest still names step_00000003.h5, nothing else left" \
    '[ "$(cat "$small/ckpt/latest")" = step_00000003.h5 ] && [ "$(ls "$small/ckpt" | tr "\n" " ")" = "latest step_00000003.h5 " ]'
  rm -f "$small/ckpt/.trellis-fault-filler"
  mount -o remount,size=1200m "$small"  # (checkpoint.keep = 3 files, and one being written)
  check_log="$work/$name.resume.log"
  timeout 300 mpirun "${flags[@]}" -np 4 "$build/trellis" train "$work/full.deck" --parallel.dp=4 \
    "${big[@]}" --run.dir="$work/run-$name" --checkpoint.dir="$small/ckpt" > "$check_log" 2>&1
  rc=$?
  check "$name: with room again the job resumes at step 3 and finishes (exit $rc)" \
    '[ $rc -eq 0 ] && grep -q "at step 3 " "$check_log" && [ "$(cat "$small/ckpt/latest")" = step_00000010.h5 ]'
  umount "$small"
}
fill_data_case

# The disk fills in the middle of the HDF5 write, as when another job takes the room meanwhile:
# the check counts the data alone (TRELLIS_FAULT_ROOM_FOR_DATA).
flags+=(-x TRELLIS_FAULT_ROOM_FOR_DATA=1)
full_case fills-up $(( data + 64 * 1024 ))
# Room for all but the last metadata HDF5 writes as it closes the file, on one rank (no room
# taken under TRELLIS_FAULT_ROOM_FOR_DATA): its failed close would crash HDF5 1.10 in
# MPI_Finalize (a segmentation fault, 139); status 2 instead.
full_case fills-at-close $(( one - 4096 )) 1

echo "fulldisk: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
