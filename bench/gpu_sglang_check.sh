#!/usr/bin/env bash
# The sglang generator against real SGLang servers (GPU machine with sglang installed).
#
#   bench/gpu_sglang_check.sh            # uses `python` on PATH; PYTHON=/path/to/python to choose
#
# 1. Builds a small local model (the embedded architecture and character tokenizer, head_dim 64 so
#    the GPU attention kernels take it), starts `python -m sglang.launch_server` on 127.0.0.1 with
#    the flags /work/shared/SGLANG_API.md names (integer --weight-version labels for per-token
#    versions; --enable-deterministic-inference so sampling_seed is honoured), waits for
#    /health_generate, then runs tests/integration/test_sglang_client.py with ASYNCRL_SGLANG_URL
#    and ASYNCRL_SGLANG_MODEL set (tests needing stand-in hooks skip themselves); then stops it.
# 2. Runs a short `asyncrl launch` in which the generator starts its own server
#    (generators.options.launch=1, the same flags through launch_args) and the learner pushes every
#    version over the servers' weight update group (weights.transport=broadcast: gloo from the CPU
#    learner; init_weights_update_group, begin/end_weight_update, update_weights_from_distributed),
#    and checks that the job completed and that the server it started is gone.
# Everything stays under 8 minutes (server start <= 200 s, client tests <= 110 s, the job <= 140 s
# including its own server start); exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
START_TIMEOUT_S=${START_TIMEOUT_S:-200}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-110}
JOB_TIMEOUT_S=${JOB_TIMEOUT_S:-140}
SERVER_FLAGS="--enable-deterministic-inference --disable-cuda-graph --skip-server-warmup --log-level warning"
WORK=$(mktemp -d -t asyncrl-gpu-sglang-XXXXXX)
SERVER_PID=""

cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

"$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA device'; print('sglang', sglang.__version__)"
"$PY" - "$WORK/model" <<'PY'
import sys
from pathlib import Path
from asyncrl.models.tiny import create_base
create_base(Path(sys.argv[1]), hidden_size=128, num_layers=2, num_heads=2, seed=0)
PY
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
URL="http://127.0.0.1:$PORT"

# Own process group (setsid) so the cleanup kill reaches the scheduler/detokenizer children too.
setsid "$PY" -m sglang.launch_server \
  --model-path "$WORK/model" --host 127.0.0.1 --port "$PORT" \
  --weight-version 0 \
  --mem-fraction-static 0.3 \
  $SERVER_FLAGS >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
cleanup_group() { kill -- "-$SERVER_PID" 2>/dev/null || true; }
trap 'cleanup_group; cleanup' EXIT

echo "waiting for $URL/health_generate (up to ${START_TIMEOUT_S}s)"
deadline=$((SECONDS + START_TIMEOUT_S))
until curl -fsS -o /dev/null "$URL/health_generate" 2>/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "sglang server exited during startup:"; tail -50 "$WORK/server.log"; exit 1
  fi
  if (( SECONDS > deadline )); then
    echo "sglang server not healthy after ${START_TIMEOUT_S}s:"; tail -50 "$WORK/server.log"; exit 1
  fi
  sleep 2
done
curl -fsS "$URL/model_info"; echo

status=0
ASYNCRL_SGLANG_URL="$URL" ASYNCRL_SGLANG_MODEL="$WORK/model" \
  timeout "$TEST_TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider -rs tests/integration/test_sglang_client.py \
  || status=$?
if (( status != 0 )); then
  echo "FAILED (pytest exit $status); server log tail:"; tail -50 "$WORK/server.log"
  exit "$status"
fi
cleanup_group  # the job below starts its own server
for _ in $(seq 1 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done

echo "short job: the generator launches its server, weights go over the weight update group"
job=0
timeout "$JOB_TIMEOUT_S" "$PY" -m asyncrl launch --no-tui \
  --set "model.path=\"$WORK/model\"" --set "run.out_dir=\"$WORK/runs\"" --set 'run.name="gpu"' \
  --set learner.steps=2 --set learner.groups_per_step=2 --set learner.samples_per_group=4 \
  --set sampling.max_new_tokens=8 --set task.num_eval=0 \
  --set 'generators.kind="sglang"' --set generators.options.launch=1 \
  --set generators.options.mem_fraction_static=0.3 \
  --set "generators.options.launch_args=\"$SERVER_FLAGS\"" \
  --set generators.options.startup_timeout_s=$((JOB_TIMEOUT_S - 20)) \
  --set weights.transport=broadcast --set weights.inflight=retract --set weights.bucket_bytes=67108864 \
  || job=$?
RUN="$WORK/runs/gpu"
if (( job == 0 )); then
  "$PY" - "$RUN" <<'PY' || job=$?
import json, os, sys
from pathlib import Path
run = Path(sys.argv[1])
summary = json.loads((run / "summary.json").read_text())
assert summary["status"] == "completed" and summary["policy_versions"] == 2, summary
assert summary["generator_restarts"] == 0, summary
publishes = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"publish"' in l]
assert sorted({p["version"] for p in publishes if p["transport"] == "broadcast"}) == [1, 2], publishes
for server in json.loads((run / "logs" / "sglang-gen-0.json").read_text()):
    try:
        os.kill(server["pid"], 0)
        raise AssertionError(f"launched server {server} outlived the run")
    except ProcessLookupError:
        pass
print("job OK:", json.dumps({k: summary[k] for k in ("status", "policy_versions", "wall_s")}))
PY
fi
if (( job != 0 )); then
  echo "FAILED (job exit $job); launched server log tail:"; tail -50 "$RUN/logs/sglang-gen-0-0.log" 2>/dev/null || true
  tail -30 "$RUN/logs/gen-0.log" 2>/dev/null || true
  tail -30 "$RUN/logs/learner.log" 2>/dev/null || true
fi
exit "$job"
