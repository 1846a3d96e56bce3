#!/usr/bin/env bash
# The sglang client's tests against a real SGLang server (GPU machine with sglang installed).
#
#   bench/gpu_sglang_check.sh            # uses `python` on PATH; PYTHON=/path/to/python to choose
#
# Builds a small local model (the embedded architecture and character tokenizer, head_dim 64 so
# the GPU attention kernels take it), starts `python -m sglang.launch_server` on 127.0.0.1 with
# the flags /work/shared/SGLANG_API.md names (integer --weight-version labels for per-token
# versions; --enable-deterministic-inference so sampling_seed is honoured), waits for
# /health_generate, then runs tests/integration/test_sglang_client.py with ASYNCRL_SGLANG_URL and
# ASYNCRL_SGLANG_MODEL set (tests needing stand-in hooks skip themselves). Everything stays under
# 8 minutes (server start <= 5 min, tests <= 2.5 min); exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
START_TIMEOUT_S=${START_TIMEOUT_S:-300}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-150}
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
  --enable-deterministic-inference \
  --mem-fraction-static 0.3 \
  --disable-cuda-graph \
  --skip-server-warmup \
  --log-level warning >"$WORK/server.log" 2>&1 &
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
fi
exit "$status"
