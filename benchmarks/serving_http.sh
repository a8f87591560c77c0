#!/usr/bin/env bash
# The serving study's point over HTTP, beside its in-process twin (issue 35), on a GPU, in one call:
#   HISPARSE_COMMIT=$(git rev-parse --short=12 HEAD) OUT=out bash benchmarks/serving_http.sh
# Serves the sweep's random DSA study model (experiments.sweep.build: 61 layers, hidden 1024, the
# in-process study's weights, no checkpoint) with `python -m hisparse.serve`'s options set as
# experiments/configs/h200_serving.toml runs a point (hisparse, B = 4096, 4 GiB GPU, 8 GiB host,
# chunks of 8192, one graph, every request its own draw of dsa_100k), then runs
# `python -m hisparse.serve.bench` at CONCURRENCY clients (default 8) into $OUT/serving.csv
# (transport=http), then SIGTERM and a clean exit. DRAW_CACHE (default /tmp/draws) is the sweep's
# --draw-cache: run the sweep first in the same call and the server reads its draws. MODE (default
# hisparse), INPUT_LEN / OUTPUT_LEN (16384 / 1024) and LAYERS (61) change the point. Needs a CUDA GPU.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
clients=${CONCURRENCY:-8}
mode=${MODE:-hisparse}
n_in=${INPUT_LEN:-16384}
n_out=${OUTPUT_LEN:-1024}
log="$OUT/serving_http_server.txt"

"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'serving_http.sh needs a CUDA GPU')" || exit 1
"$py" - "$mode" "$clients" "$n_in" "$n_out" "${DRAW_CACHE:-/tmp/draws}" "${LAYERS:-61}" > "$log" 2>&1 <<'EOF' &
import sys, torch
from experiments.sweep import build
from hisparse.serve.__main__ import main
mode, cache = sys.argv[1], sys.argv[5]
clients, n_in, n_out, layers = (int(a) for a in (sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[6]))
model = build(dict(kind="serving", model="dsa", layers=layers, hidden=1024), torch.device("cuda"))
workload = ["--workload", "dsa_100k", "--workload-input-len", str(n_in), "--workload-output-len", str(n_out),
            "--workload-draws", str(2 * clients), "--draw-cache", cache]
slots = [] if mode == "resident" else ["--cache-slots", "4096", "--host-budget-gib", "8"]
sys.exit(main(["--mode", mode, "--kv-budget-gib", "4", "--max-context", str(n_in + n_out), "--max-batch", str(clients),
               "--prefill-chunk", "8192", "--graph", "--port", "0", *slots, *workload],
              model=model, name="dsa"))
EOF
server=$!
port=""
for _ in $(seq 600); do                 # the model, the draws and the warm-up: minutes at most
  port=$(grep -oE 'on http://127\.0\.0\.1:[0-9]+' "$log" | grep -oE '[0-9]+$' | head -1)
  [ -n "$port" ] && break
  kill -0 $server 2>/dev/null || break
  sleep 1
done
if [ -z "$port" ]; then
  echo "!! the server did not start:"; tail -20 "$log"; kill $server 2>/dev/null; exit 1
fi
echo "server on port $port ($mode, $clients clients, $n_in in / $n_out out)"
"$py" -m hisparse.serve.bench --url "http://127.0.0.1:$port" --concurrency "$clients" --requests-per-client 2 \
  --input-len "$n_in" --output-len "$n_out" --out "$OUT"
status=$?
kill -TERM $server
wait $server || status=1
tail -3 "$log"
exit $status
