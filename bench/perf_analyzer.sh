#!/usr/bin/env bash
# Serve examples/models (one CPU worker, one torch thread: shared/BENCH.md's set-up)
# and run Triton's perf_analyzer against one model at the given concurrencies.
#
#   bench/perf_analyzer.sh [MODEL] [CONCURRENCY_RANGE]     e.g. bench/perf_analyzer.sh mlp 1:32:31
#
# perf_analyzer comes from bench/get-perf-analyzer (PA_DIR, default .perf_analyzer).
# Prints perf_analyzer's report, which includes the server's inference and execution
# counts: average batch size = inference count / execution count.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-mlp}
RANGE=${2:-1:32:31}
PORT=${PORT:-18001}
PA_DIR=${PA_DIR:-.perf_analyzer}
PA=$(bench/get-perf-analyzer "$PA_DIR")
make -s install
.venv/bin/batchd serve --model-repository examples/models --workers 1 --threads-per-worker 1 \
    --grpc-port "$PORT" --log-level WARNING &
SERVER=$!
trap 'kill -INT $SERVER; wait $SERVER' EXIT
.venv/bin/python - "$PORT" <<'PY'
import sys, time
from batchd.client import Client
with Client(f"127.0.0.1:{sys.argv[1]}") as c:
    end = time.monotonic() + 120
    while not c.ready():
        if time.monotonic() > end:
            sys.exit("server not ready after 120 s")
        time.sleep(0.1)
PY
"$PA" -i grpc -u "127.0.0.1:$PORT" -m "$MODEL" --concurrency-range "$RANGE" \
    --measurement-interval 4000
