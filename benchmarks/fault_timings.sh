#!/bin/bash
# Diagnostic, not a benchmark: two cluster faults on loopback, timed (nodes as processes, the demo model).
#   back PORTBASE DOWN_S  2 nodes under `serve --nodes`; one is killed, restarted DOWN_S later: seconds until
#                         /health is 200 again after the restart
#   hung PORTBASE         3 nodes with a cluster secret under `serve --nodes --heal-after 5`; a greedy stream of
#                         64 tokens, the middle node stopped (SIGSTOP) after its 3rd chunk: when the stream ended
#                         and how (resumed over the nodes left, or an error)
# PYTHONPATH picks the code (a worktree of an older commit, for a side by side run).
#   bash benchmarks/fault_timings.sh back 52900 60
#   bash benchmarks/fault_timings.sh hung 53000
set -u
MODE=$1; B=$2; D=$(mktemp -d); trap 'kill -9 $(jobs -p) 2>/dev/null; rm -rf "$D"' EXIT
up() { for _ in $(seq 600); do [ "$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:$1/health)" = 200 ] && return; sleep 0.25; done; }
if [ "$MODE" = back ]; then
  mtpipe node --host 127.0.0.1 --port $((B+1)) > $D/n1.log 2>&1 &
  mtpipe node --host 127.0.0.1 --port $((B+2)) > $D/n2.log 2>&1 & N2=$!
  sleep 4
  mtpipe serve --nodes 127.0.0.1:$((B+1)),127.0.0.1:$((B+2)) --port $((B+10)) > $D/serve.log 2>&1 &
  up $((B+10)); kill -9 $N2; sleep "$3"
  mtpipe node --host 127.0.0.1 --port $((B+2)) > $D/n2b.log 2>&1 &
  T0=$(date +%s.%N); up $((B+10)); T1=$(date +%s.%N)
  echo "down $3 s: /health 200 again $(echo "$T1 - $T0" | bc) s after the node was restarted"
else
  export MTPIPE_SECRET=$(openssl rand -hex 32)
  for i in 1 2 3; do mtpipe node --host 127.0.0.1 --port $((B+i)) > $D/n$i.log 2>&1 & echo $! > $D/n$i.pid; done
  sleep 5
  mtpipe serve --nodes 127.0.0.1:$((B+1)),127.0.0.1:$((B+2)),127.0.0.1:$((B+3)) --port $((B+10)) --heal-after 5 \
    > $D/serve.log 2>&1 &
  up $((B+10))
  python - $((B+10)) $(cat $D/n2.pid) <<'PY'
import http.client, json, os, signal, sys, time
port, victim = int(sys.argv[1]), int(sys.argv[2])
t0, n, text = time.time(), 0, ""
c = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
c.request("POST", "/v1/completions", json.dumps({"prompt": "def fib(n):", "max_tokens": 64, "stream": True,
                                                 "temperature": 0}), {"content-type": "application/json"})
for line in c.getresponse():
    line = line.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    d = json.loads(line[6:])
    if "error" in d:
        print(f"{time.time() - t0:.2f} s: error: {d['error']['message']}")
    for ch in d.get("choices") or []:
        n += 1
        if n == 3:
            os.kill(victim, signal.SIGSTOP)
        if ch.get("finish_reason"):
            print(f"{time.time() - t0:.2f} s: finished ({ch['finish_reason']}) after {n} chunks")
PY
  kill -CONT $(cat $D/n2.pid)
fi
