#!/usr/bin/env bash
# What OTLP export costs in CPU time per request (user + system, the issue's measure), under
# load: two tollgate processes on the same policy, one exporting every span and metric to the
# nginx mock (which answers 200 like a collector) and one not, loaded in turns by wrk
# (one thread, C connections, DUR each); PASSES passes that alternate which goes first. Each
# pass compares two runs seconds apart; the overhead printed is the median of the passes'
# overheads. Wall-clock figures move with the machine (a pass's overhead scatters by several
# %, hence the many passes); bench/otel-cost.sh counts instructions instead, repeatably.
#   bench/otel-cpu.sh        (PASSES=9 DUR=3s C=16; needs nginx and wrk)
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${DUR:-3s}
PASSES=${PASSES:-9}
C=${C:-16}
POLICY=${POLICY:-bench/policy.yaml}
BIN=${BIN:-./target/release/tollgate}
TICK=$(getconf CLK_TCK)
command -v wrk >/dev/null && command -v nginx >/dev/null || { echo "needs wrk and nginx"; exit 2; }
[ -x "$BIN" ] || cargo build --release --quiet --bin tollgate

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -f "$ON_POLICY"; }
ON_POLICY=$(mktemp /tmp/tollgate-otel-cpu.XXXXXX.yaml)
trap cleanup EXIT

PORT=$(sed -n 's/.*{listen: 127.0.0.1:\([0-9]*\),.*/\1/p' "$POLICY" | head -1)
ADMIN=$(sed -n 's/.*admin_listen: 127.0.0.1:\([0-9]*\).*/\1/p' "$POLICY" | head -1)
ON_PORT=$((PORT + 1))
# The same policy on the next ports, with its own state file.
sed -e "s/127.0.0.1:$PORT/127.0.0.1:$ON_PORT/" -e "s/127.0.0.1:$ADMIN/127.0.0.1:$((ADMIN + 1))/" \
  -e 's#/tmp/tollgate-bench.db#/tmp/tollgate-bench-otel.db#' "$POLICY" > "$ON_POLICY"
rm -f /tmp/tollgate-bench.db* /tmp/tollgate-bench-otel.db*

: > /tmp/tollgate-bench-otlp.log   # (an earlier nginx may hold it open: truncate, do not remove)
nginx -c "$PWD/bench/nginx-mock.conf" -p /tmp & NGINX=$!
unset OTEL_EXPORTER_OTLP_ENDPOINT OTEL_EXPORTER_OTLP_TRACES_ENDPOINT OTEL_EXPORTER_OTLP_METRICS_ENDPOINT
TOLLGATE_LOG=warn "$BIN" serve --policy "$POLICY" & OFF=$!; pids+=($OFF)
OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:18080 OTEL_TRACES_SAMPLER=always_on \
  TOLLGATE_LOG=warn "$BIN" serve --policy "$ON_POLICY" & ON=$!; pids+=($ON)
pids+=($NGINX)   # stopped last: the exporter's last batch is not refused
sleep 1.5

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# load PORT PID -> CPU µs per request over one wrk run.
load() {
  local before after out requests
  before=$(ticks "$2")
  out=$(wrk -t1 -c"$C" -d"$DUR" -s bench/post.lua "http://127.0.0.1:$1/v1/chat/completions")
  after=$(ticks "$2")
  requests=$(sed -n 's/.*RESULT requests=\([0-9]*\).*/\1/p' <<<"$out")
  errors=$(sed -n 's/.*errors=\([0-9]*\).*/\1/p' <<<"$out")
  [ "${errors:-1}" = 0 ] || { echo "wrk saw errors: $out" >&2; exit 1; }
  awk -v a="$after" -v b="$before" -v t="$TICK" -v r="$requests" 'BEGIN{printf "%.2f\n", (a-b)/t*1e6/r}'
}
load "$PORT" "$OFF" >/dev/null; load "$ON_PORT" "$ON" >/dev/null   # warm-up
offs=(); ons=(); pcts=()
for i in $(seq "$PASSES"); do
  if [ $((i % 2)) = 1 ]; then a=$(load "$PORT" "$OFF"); b=$(load "$ON_PORT" "$ON")
  else b=$(load "$ON_PORT" "$ON"); a=$(load "$PORT" "$OFF"); fi
  offs+=("$a"); ons+=("$b"); pcts+=("$(awk -v a="$a" -v b="$b" 'BEGIN{printf "%.1f", 100 * (b - a) / a}')")
done
median() { printf '%s\n' "$@" | sort -g | sed -n "$(( ($# + 1) / 2 ))p"; }
traces=$(grep -c 'POST /v1/traces HTTP[^"]*" 200' /tmp/tollgate-bench-otlp.log 2>/dev/null || true)
echo "CPU µs/request by pass, export off: ${offs[*]}"
echo "CPU µs/request by pass, export on:  ${ons[*]}"
echo "overhead by pass (%): ${pcts[*]}; the collector took ${traces:-0} span exports"
echo "at $C connections, CPU per request: export off $(median "${offs[@]}") µs, on $(median "${ons[@]}") µs (medians); OTLP export overhead $(median "${pcts[@]}") % (median of the passes)"
