#!/usr/bin/env bash
# Resident memory of tollgate after N requests (default 2000) on a policy, split into the
# binary's file pages (RssFile) and anonymous memory (RssAnon: heap, tokenizer tables).
#   bench/rss.sh [policy]      (BIN=./target/release/tollgate; needs nginx for the mock upstream)
set -euo pipefail
cd "$(dirname "$0")/.."
POLICY=${1:-bench/policy.yaml}
BIN=${BIN:-./target/release/tollgate}
N=${N:-2000}
. bench/mock.sh
PORT=$(sed -n 's/.*{listen: 127.0.0.1:\([0-9]*\),.*/\1/p' "$POLICY" | head -1)
rm -f /tmp/tollgate-bench.db*
TOLLGATE_LOG=warn "$BIN" serve --policy "$POLICY" & TG=$!; pids+=($TG)
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null && break; sleep 0.1; done
echo "idle:   $(grep -E 'VmRSS|RssAnon|RssFile' /proc/$TG/status | tr -s ' \t' ' ' | tr '\n' ' ')"
python3 - "$PORT" "$N" <<'PY'
import http.client, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
body = open("bench/post.lua").read().split("wrk.body = '", 1)[1].split("'\n", 1)[0].encode()
c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
for _ in range(n):
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", "x-tollgate-consumer": "bench"})
    r = c.getresponse(); r.read()
    assert r.status == 200, r.status
PY
echo "after $N requests: $(grep -E 'VmRSS|RssAnon|RssFile' /proc/$TG/status | tr -s ' \t' ' ' | tr '\n' ' ')"
