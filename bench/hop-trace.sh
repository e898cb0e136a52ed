#!/usr/bin/env bash
# Where one connection's added latency goes: nginx as a bare reverse proxy and tollgate on
# bench/policy.yaml, each in front of the nginx mock at one connection (wrk), with the
# proxy's syscalls and the machine's wake-ups traced by `perf` (kernel tracepoints, ~1 µs
# resolution). For the thread that served the connection it prints the median time between
# one request's syscalls: from reading the request to sending it upstream and from reading
# the answer to sending it on are the proxy's own work; the sleeps in `epoll_wait` are the
# peers' work and the wake-ups. Tracing slows both proxies alike; compare them, not the
# absolute figures with bench/run.sh's.
#   bench/hop-trace.sh     (needs perf with tracepoint access (root), nginx, wrk, python3)
#   POLICY=bench/policy-default.yaml BIN=path DUR=3 bench/hop-trace.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${DUR:-3}   # seconds traced per proxy
POLICY=${POLICY:-bench/policy.yaml}
BIN=${BIN:-./target/release/tollgate}
for c in perf wrk nginx python3; do command -v $c >/dev/null || { echo "needs $c"; exit 2; }; done
[ "$BIN" != ./target/release/tollgate ] || cargo build --release --quiet --bin tollgate
OUT=/tmp/tollgate-hop; rm -rf "$OUT"; mkdir -p "$OUT"
rm -f /tmp/tollgate-bench.db*

. bench/mock.sh
nginx -c "$PWD/bench/nginx-proxy.conf" -p /tmp & pids+=($!)
TOLLGATE_LOG=warn "$BIN" serve --policy "$POLICY" & TG=$!; pids+=($TG)
sleep 1.5
PORT=$(sed -n 's/.*{listen: 127.0.0.1:\([0-9]*\),.*/\1/p' "$POLICY" | head -1)
NGINX_WORKERS=$(pgrep -P "$(cat /tmp/tollgate-bench-proxy.pid)" | paste -sd,)

EVENTS=syscalls:sys_enter_recvfrom,syscalls:sys_exit_recvfrom,syscalls:sys_enter_sendto,syscalls:sys_exit_sendto
EVENTS=$EVENTS,syscalls:sys_enter_writev,syscalls:sys_exit_writev,syscalls:sys_enter_write,syscalls:sys_exit_write
EVENTS=$EVENTS,syscalls:sys_enter_epoll_wait,syscalls:sys_exit_epoll_wait

trace() { # name port pids
  local name=$1 port=$2 p=$3 tids
  tids=$(for q in ${p//,/ }; do ls "/proc/$q/task"; done | paste -sd,)
  wrk -t1 -c1 -d"$((DUR + 2))s" -s bench/post.lua "http://127.0.0.1:$port/v1/chat/completions" >"$OUT/$name.wrk" &
  local w=$!
  sleep 1
  perf record -q -e "$EVENTS" -p "$p" -o "$OUT/$name.sys.data" -- sleep "$DUR" >/dev/null 2>&1 &
  local s=$!
  perf record -q -a -e sched:sched_wakeup -o "$OUT/$name.wake.data" -- sleep "$DUR" >/dev/null 2>&1
  wait "$s" "$w"
  perf script --ns -i "$OUT/$name.sys.data" >"$OUT/$name.sys.txt" 2>/dev/null
  perf script --ns -i "$OUT/$name.wake.data" >"$OUT/$name.wake.txt" 2>/dev/null
  echo "## $name ($(grep -o 'p50_us=[0-9]*' "$OUT/$name.wrk" | head -1 || true) under tracing)"
  python3 bench/hop-trace.py "$OUT/$name.sys.txt" "$OUT/$name.wake.txt" "$tids"
  echo
}
trace nginx 18090 "$NGINX_WORKERS"
trace tollgate "$PORT" "$TG"
