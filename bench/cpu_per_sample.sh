#!/usr/bin/env bash
# CPU per trained sample of every thread of the async pipeline (launcher, learner, generator),
# from /proc over a steady window: the overhead figures in bench/README.md, "Pipeline".
#   bench/cpu_per_sample.sh [--set key=value ...]    (extra overrides for the run)
# Workers start as fresh processes (run.spawn=exec) so that they are found by their command lines.
# Runs the bench's default workload at generators.max_batch_groups=5 (what it calibrates to on the
# 2-core VM) in a temporary directory.
set -euo pipefail
OUT=$(mktemp -d)
trap 'kill "$LAUNCH" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$OUT"' EXIT
asyncrl launch --no-tui --set learner.steps=100 --set learner.groups_per_step=32 \
  --set learner.samples_per_group=8 --set sampling.max_new_tokens=16 --set sampling.ignore_eos=true \
  --set staleness.max_staleness=2 \
  --set generators.num_generators=1 --set generators.threads=1 --set learner.threads=1 \
  --set task.num_eval=0 --set generators.max_batch_groups=5 --set run.spawn=exec "$@" \
  --set run.out_dir="$OUT" --set run.name=run > "$OUT/launch.log" 2>&1 &
LAUNCH=$!
METRICS="$OUT/run/metrics.jsonl"
# Steady state: wait for step 4's record (start-up and the pipeline fill are over by then).
until [ -f "$METRICS" ] && [ "$(grep -c '"type": "step"' "$METRICS")" -ge 4 ]; do
  kill -0 "$LAUNCH" 2>/dev/null || { echo "the run ended early; see $OUT/launch.log"; exit 1; }
  sleep 0.5  # polling the run's metrics file
done
LEARNER=$(pgrep -P "$LAUNCH" -f asyncrl.learner.service)
GEN=$(pgrep -P "$LAUNCH" -f asyncrl.generators.service)
snap() {  # role pid tid name cpu-ticks, one line per thread
  for pair in "launcher:$LAUNCH" "learner:$LEARNER" "gen:$GEN"; do
    role=${pair%%:*}; pid=${pair#*:}
    for t in /proc/"$pid"/task/*; do  # a thread that ends meanwhile is left out
      name=$(tr ' ' _ 2>/dev/null < "$t/comm") && ticks=$(awk '{print $14 + $15}' "$t/stat" 2>/dev/null) \
        && echo "$role $pid $(basename "$t") $name $ticks" || true
    done
  done
}
trained() { python3 -c "import json,sys; print(sum(r['num_trajectories'] for r in map(json.loads, open(sys.argv[1])) if r.get('type') == 'step'))" "$METRICS"; }
n0=$(trained); snap > "$OUT/a"; t0=$(date +%s.%N)
sleep 12  # the measured window
n1=$(trained); snap > "$OUT/b"; t1=$(date +%s.%N)
python3 - "$OUT/a" "$OUT/b" "$n0" "$n1" "$t0" "$t1" "$(getconf CLK_TCK)" <<'PY'
import sys
a_path, b_path, n0, n1, t0, t1, hz = sys.argv[1:]
n, dt, hz = int(n1) - int(n0), float(t1) - float(t0), float(hz)
before = {tuple(l.split()[:3]): int(l.split()[4]) for l in open(a_path)}
print(f"{n} samples trained in {dt:.1f} s ({n / dt:.0f} samples/s)")
total = 0.0
for line in open(b_path):
    role, pid, tid, name, ticks = line.split()
    used_s = (int(ticks) - before.get((role, pid, tid), 0)) / hz
    name = "main (event loop)" if tid == pid else f"{name} {tid}"
    if used_s * hz < 3:
        continue
    total += used_s
    print(f"  {role:9s} {name[:18]:18s} {used_s * 1e6 / n:7.1f} us/sample  {100 * used_s / dt:5.1f}% of a core")
print(f"  total {total * 1e6 / n:.0f} us/sample")
PY
