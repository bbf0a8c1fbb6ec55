#!/usr/bin/env bash
# Draws a run's metrics as PNG files with gnuplot (Debian: gnuplot-nox).
#   scripts/plot.sh RUN [OUTDIR]      RUN: a run directory (run.dir); OUTDIR defaults to RUN/plots
# Writes loss.png (with the held-out loss of eval.csv and the data's entropy floor where the run
# has them), throughput.png (tokens/s, MFU), time.png (where each step's time went: compute,
# communication per group, pipeline bubble; averaged over ranks) and memory.png (peak bytes per
# rank, min and max).
# Columns are found by name in metrics.csv's header, so older runs get the plots they can.
set -euo pipefail

die() { echo "plot.sh: $1" >&2; exit "${2:-2}"; }
[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: scripts/plot.sh RUN [OUTDIR]"
run=$1
out=${2:-$run/plots}
metrics=$run/metrics.csv
[ -d "$run" ] || die "$run: no such run directory"
[ -f "$metrics" ] || die "$metrics: no such file (is $run a run directory?)"
[ "$(wc -l < "$metrics")" -ge 2 ] || die "$metrics: no steps logged yet"
command -v gnuplot > /dev/null || die "gnuplot not found (Debian: apt-get install gnuplot-nox)" 1
mkdir -p "$out" || die "$out: cannot create the output directory"

# Column number (1-based) of a header name, or empty.
col() { head -1 "$metrics" | tr ',' '\n' | grep -nx "$1" | cut -d: -f1 || true; }
floor=""
if [ -f "$run/summary.json" ]; then
  floor=$(sed -n 's/.*"loss_floor": *\([-0-9.eE+]*\).*/\1/p' "$run/summary.json" | head -1)
fi

step=$(col step) loss=$(col loss) toks=$(col tokens_per_s) mfu=$(col mfu)
[ -n "$step" ] && [ -n "$loss" ] || die "$metrics: no step/loss columns"

common="set datafile separator ','; set key top right; set grid; set xlabel 'step';
set terminal pngcairo size 900,540 noenhanced font 'sans,10'"
made=()

# The held-out loss ([eval]: eval.csv, columns step and eval_loss) over the training loss.
evals=$run/eval.csv
held_out=""
if [ -f "$evals" ] && [ "$(wc -l < "$evals")" -ge 2 ]; then
  held_out=", '$evals' every ::1 using 1:2 with linespoints pt 7 ps 0.6 lw 1.5 title 'held-out loss'"
fi
{
  echo "$common; set output '$out/loss.png'; set title 'loss ($run)'; set ylabel 'loss (nats/token)'"
  if [ -n "$floor" ]; then
    echo "plot '$metrics' every ::1 using $step:$loss with lines lw 1.5 title 'loss'$held_out, \\"
    echo "     $floor with lines dt 2 lw 1.5 title 'entropy floor ($floor)'"
  else
    echo "plot '$metrics' every ::1 using $step:$loss with lines lw 1.5 title 'loss'$held_out"
  fi
} | gnuplot && made+=(loss.png)

if [ -n "$toks" ]; then
  {
    echo "$common; set output '$out/throughput.png'; set title 'throughput ($run)'"
    echo "set ylabel 'tokens/s'; set yrange [0:*]"
    if [ -n "$mfu" ] && awk -F, -v c="$mfu" 'NR > 1 && $c != "" { found = 1 } END { exit !found }' "$metrics"; then
      echo "set y2label 'MFU'; set y2tics; set y2range [0:*]"
      echo "plot '$metrics' every ::1 using $step:$toks with lines title 'tokens/s', \\"
      echo "     '' every ::1 using $step:$mfu axes x1y2 with lines title 'MFU'"
    else
      echo "plot '$metrics' every ::1 using $step:$toks with lines title 'tokens/s'"
    fi
  } | gnuplot && made+=(throughput.png)
fi

# Stacked areas: each curve is the sum of its part and the parts drawn below it.
parts=(compute_ms comm_dp_ms comm_tp_ms comm_pp_ms bubble_ms)
labels=("compute" "communication dp" "communication tp" "communication pp" "pipeline bubble")
cols=() names=()
for i in "${!parts[@]}"; do
  c=$(col "${parts[$i]}")
  [ -n "$c" ] && cols+=("$c") && names+=("${labels[$i]}")
done
if [ ${#cols[@]} -gt 0 ]; then
  {
    echo "$common; set output '$out/time.png'; set title 'where each step went, average over ranks ($run)'"
    echo "set ylabel 'ms per step'; set yrange [0:*]; set style fill solid 0.6 noborder"
    plot="plot"
    for ((i = ${#cols[@]} - 1; i >= 0; i--)); do
      sum=""
      for ((j = 0; j <= i; j++)); do sum+="${sum:+ + }\$${cols[$j]}"; done
      plot+=" '$metrics' every ::1 using $step:($sum) with filledcurves x1 title '${names[$i]}',"
    done
    echo "${plot%,}"
  } | gnuplot && made+=(time.png)
fi

mem_min=$(col mem_peak_min_bytes) mem_max=$(col mem_peak_max_bytes)
if [ -n "$mem_min" ] && [ -n "$mem_max" ]; then
  {
    echo "$common; set output '$out/memory.png'; set title 'peak memory per rank ($run)'"
    echo "set ylabel 'MiB'; set yrange [0:*]"
    echo "plot '$metrics' every ::1 using $step:(\$$mem_max/1048576) with lines lw 1.5 title 'max over ranks', \\"
    echo "     '' every ::1 using $step:(\$$mem_min/1048576) with lines dt 2 lw 1.5 title 'min over ranks'"
  } | gnuplot && made+=(memory.png)
fi

[ ${#made[@]} -gt 0 ] || die "no plot could be drawn" 1
echo "plot.sh: wrote ${made[*]} to $out"
