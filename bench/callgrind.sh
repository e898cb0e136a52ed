#!/usr/bin/env bash
# Instructions per request (user space), tollgate against nginx as a bare reverse proxy: the
# noise-free figure to steer by (timings on a shared box move 20-30 % between runs; these
# counts move < 0.1 %). Each proxy runs under `valgrind --tool=callgrind` in front of the
# fixed-answer nginx mock; after a warm-up the counters are zeroed, N sequential keep-alive
# requests (the bench request of bench/post.lua) are sent, and the dump's total is divided by N.
#   bench/callgrind.sh                     (N=500; POLICY=bench/policy.yaml; needs nginx, valgrind)
#   POLICY=bench/policy-default.yaml bench/callgrind.sh     (the SQLite default-state target)
#   KEEP=1 bench/callgrind.sh             (keep the dumps in /tmp/tollgate-cg/ for callgrind_annotate)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-500}
POLICY=${POLICY:-bench/policy.yaml}
BIN=${BIN:-./target/release/tollgate}
OUT=/tmp/tollgate-cg
command -v valgrind >/dev/null && command -v nginx >/dev/null || { echo "needs valgrind and nginx"; exit 2; }
[ -x "$BIN" ] || cargo build --release --quiet --bin tollgate
rm -rf "$OUT"; mkdir -p "$OUT"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

nginx -c "$PWD/bench/nginx-mock.conf" -p /tmp & pids+=($!)

# send PORT COUNT: COUNT sequential POSTs on one keep-alive connection; fails on a non-200.
send() {
  python3 - "$1" "$2" <<'PY'
import http.client, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
body = open("bench/post.lua").read().split("wrk.body = '", 1)[1].split("'\n", 1)[0].encode()
hdrs = {"Content-Type": "application/json", "x-tollgate-consumer": "bench"}
c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
for _ in range(n):
    c.request("POST", "/v1/chat/completions", body, hdrs)
    r = c.getresponse(); r.read()
    if r.status != 200: sys.exit(f"status {r.status}")
PY
}

wait_port() { for _ in $(seq 600); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }

# measure NAME PORT CMD...: runs CMD under callgrind, prints instructions per request.
measure() {
  local name=$1 port=$2; shift 2
  env ${VG_PRELOAD:+LD_PRELOAD=$VG_PRELOAD} valgrind --tool=callgrind --callgrind-out-file="$OUT/$name.%p" "$@" >"$OUT/$name.log" 2>&1 &
  local vg=$!; pids+=($vg)
  wait_port "$port"
  send "$port" 20
  callgrind_control -z "$vg" >/dev/null 2>&1
  send "$port" "$N"
  callgrind_control -d "$vg" >/dev/null 2>&1
  sleep 0.5
  local total
  total=$(cat "$OUT/$name".*.[0-9]* 2>/dev/null | awk '/^totals:/{s+=$2} END{print s+0}')
  [ "$total" -gt 0 ] || total=$(awk '/^summary:|^totals:/{s+=$2} END{print s+0}' "$OUT/$name".* )
  kill "$vg" 2>/dev/null || true; wait "$vg" 2>/dev/null || true
  echo $(( total / N ))
}

ng=$(measure nginx 18090 nginx -c "$PWD/bench/nginx-proxy.conf" -p /tmp -g 'master_process off;')
PORT=$(sed -n 's/.*{listen: 127.0.0.1:\([0-9]*\),.*/\1/p' "$POLICY" | head -1)
rm -f /tmp/tollgate-bench.db*
# PRELOAD=/path/to/lib.so: try another allocator under the same binary (valgrind's LD_PRELOAD).
tg=$(TOLLGATE_LOG=warn VG_PRELOAD=${PRELOAD:-} measure tollgate "$PORT" "$BIN" serve --policy "$POLICY")
echo "policy: $POLICY, $N requests"
echo "nginx    instructions/request: $ng"
echo "tollgate instructions/request: $tg"
awk -v t="$tg" -v n="$ng" 'BEGIN{printf "ratio: %.2fx\n", t/n}'
[ -n "${KEEP:-}" ] || rm -rf "$OUT"
