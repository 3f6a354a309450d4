#!/bin/bash
# A stuck engine, by hand: `mtpipe serve --stall-timeout 3` on the demo model, a stream opened, then
# the engine's process stopped (SIGSTOP). The stream must end with an error saying the engine is stuck,
# a few seconds later, and the command must exit 1 once the process runs again.
# Usage: bash benchmarks/stall_check.sh [port]
set -u
PORT=${1:-18431}
OUT=$(mktemp -d)
python -m mtpipe serve --port "$PORT" --stall-timeout 3 > "$OUT/serve.out" 2> "$OUT/serve.err" &
PID=$!
for _ in $(seq 120); do curl -s "localhost:$PORT/health" > /dev/null && break; sleep 0.5; done
curl -s -N "localhost:$PORT/v1/completions" -H 'content-type: application/json' \
  -d '{"prompt": "def f(x):", "max_tokens": 3000, "stream": true, "temperature": 0}' > "$OUT/stream.out" &
CURL=$!
sleep 1.5
kill -STOP $PID
T0=$(date +%s.%N)
wait $CURL
echo "the stream ended $(echo "$(date +%s.%N) - $T0" | bc) s after the engine stopped; its last event:"
grep '"error"' "$OUT/stream.out" | tail -1
kill -CONT $PID
wait $PID
echo "mtpipe serve exited $?"
