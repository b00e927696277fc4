#!/bin/bash
# tiny (untuned: no [batching] table) under perf_analyzer at each concurrency in CS for
# each `--frontends N` in NS; per run: req/s, p50, p99, and frontend 0's rows per batch
# and per forward (batchd_forward_rows_total). With RATES (say "2000 4000") each N also
# takes an open-loop load at each rate (batchd bench --rate, 8 connections a process), the same
# offered load for every N: target 5 compares rows per forward there. Run from the
# repository root:
#
#   PA=/work/pa/perf_analyzer PY=.venv/bin/python SKIP_PIP=1 CS="64 256" NS="1 2 4 8" RATES=2000 \
#     bash bench/frontends_curve.sh
#
# On a machine with no package index (the GPU machines lent to this work) it installs
# the wheels in .whl/ first (`bash .ci/gpu-wheels` downloads them), and takes
# perf_analyzer from .pa/ (perf_analyzer.bin, and in .pa/lib the libcudart.so.12 and
# libb64.so.0d it links). LABEL prefixes each line; CODE runs another checkout's batchd.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PY=${PY:-python3}
[ -n "${SKIP_PIP:-}" ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "${CODE:-$PWD}" /tmp/pkg/batchd
export PYTHONPATH=/tmp/site:/tmp/pkg
export LD_LIBRARY_PATH=$PWD/.pa/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
PA=${PA:-$PWD/.pa/perf_analyzer.bin}
nproc; lscpu | grep -m1 "Model name"; nvidia-smi -L 2>/dev/null
$PY -c "import torch, grpc, zmq, google.protobuf as p; print('torch', torch.__version__, torch.cuda.is_available(), 'grpc', grpc.__version__, 'pb', p.__version__)" || exit 1
$PA --version 2>&1 | head -2
# tiny as a model.py (the .pt2 was exported by a newer torch); no [batching] table (untuned)
mkdir -p /tmp/models/tiny
sed '/^\[batching\]/,$d' examples/models/tiny/model.toml > /tmp/models/tiny/model.toml
cat > /tmp/models/tiny/model.py <<'PY'
import torch
def load(device):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16).to(device).eval()
    return lambda x: layer(x)
PY
# frontend 0's own series: with N > 1 each carries a frontend label, and it comes first
scrape() {
  curl -s -m 10 localhost:18192/metrics | awk -v n="$1" '$1 ~ "^batchd_"n"_total[{]" &&
    $1 ~ "model=\"tiny\"" && ($1 !~ "frontend=" || $1 ~ "frontend=\"0\"") {print $2}'
}
RUN=0
for C in ${CS:-256}; do
for N in ${NS:-1 2 4 8}; do
  RUN=$((RUN + 1))  # NS may name an N twice: each run keeps its own files
  $PY -m batchd.server --model-repository /tmp/models --grpc-port 18191 --metrics-port 18192 --http-port -1 \
    --log-level WARNING --jobs-dir /tmp/jobs-$RUN-$C --frontends $N > $OUT/server-$RUN-$N-$C.log 2>&1 &
  SP=$!
  for i in $(seq 120); do [ -n "$(scrape inference_count)" ] && break; sleep 0.5; done
  $PA -i grpc -u 127.0.0.1:18191 -m tiny --concurrency-range 16:16 --measurement-interval 1000 --max-trials 2 > /dev/null 2>&1
  for LOAD in "c:$C" $(for R in ${RATES:-}; do echo "r:$R"; done); do
    a=($(scrape inference_count) $(scrape inference_exec_count) $(scrape forward_rows))
    case $LOAD in
      r:*)  # open loop from batchd bench: perf_analyzer's fell short of 2,000 req/s there
        TAG=r${LOAD#r:}; $PY -m batchd.client.bench --url 127.0.0.1:18191 --model tiny \
          --rate ${LOAD#r:} --connections 8 --duration 5 --quiet --json $OUT/pa-$RUN-$N-$TAG.json \
          > $OUT/pa-$RUN-$N-$TAG.log 2>&1 ;;
      *) TAG=c$C; $PA -i grpc -u 127.0.0.1:18191 -m tiny --concurrency-range $C:$C \
          --measurement-interval 4000 --stability-percentage 25 --max-trials 4 \
          -f $OUT/pa-$RUN-$N-$TAG.csv > $OUT/pa-$RUN-$N-$TAG.log 2>&1 ;;
    esac
    b=($(scrape inference_count) $(scrape inference_exec_count) $(scrape forward_rows))
    $PY - "$N" "$TAG" "${a[*]}" "${b[*]}" $OUT/pa-$RUN-$N-$TAG <<'PY'
import csv, json, os, sys
n, load, a, b, f = sys.argv[1:]
a = [float(x) for x in a.split()]; b = [float(x) for x in b.split()]
d = [y - x for x, y in zip(a, b)]
try:
    if load[0] == "c":
        row = next(csv.DictReader(open(f + ".csv")))
        got = float(row["Inferences/Second"]), float(row["p50 latency"]) / 1e3, float(row["p99 latency"]) / 1e3
        load = f"c={load[1:]}"
    else:
        lv = json.load(open(f + ".json"))["levels"][0]
        got = lv["throughput"], lv["p50_ms"], lv["p99_ms"]
        load = f"{load[1:]} req/s offered"
except (OSError, StopIteration, KeyError, IndexError, ValueError):
    why = open(f + ".log", errors="replace").read().strip().splitlines()[-1:] or ["(no log)"]
    sys.exit(print(f"{os.environ.get('LABEL', '')} N={n} {load}: the load tool gave no result: "
                   f"{why[0][:200]}"))
rows = ("frontend 0's counters could not be read from its /metrics" if len(d) < 3 else
        f"frontend 0: rows/batch {d[0]/d[1]:.1f}, rows/forward {d[2]/d[1]:.1f}" if d[1]
        else "frontend 0 ran no batch (the kernel gave the load's connections to the others)")
print(f"{os.environ.get('LABEL', '')} N={n} {load}: req/s {got[0]:,.0f} p50 {got[1]:.2f} ms "
      f"p99 {got[2]:.2f} ms; {rows}")
PY
  done
  kill -INT $SP; wait $SP
done
done
