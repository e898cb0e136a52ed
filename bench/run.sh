#!/usr/bin/env bash
# Loopback load bench: direct-to-upstream, nginx as a bare reverse proxy, and tollgate with a
# realistic policy (bench/policy.yaml) and tollgate on the default policy's shape
# (bench/policy-default.yaml: SQLite state, JSONL audit), each at 1, 16 and 64 connections with
# wrk (one thread). Three passes, the targets taking turns within each pass; the median pass
# (by requests/s) is reported. Then the one-connection runs again with every process on a
# fixed core (PLACED=0 skips them). Bounded: 4 targets × 4 runs × 3 passes of $DUR. Ratios to
# nginx are printed at the end.
#   bench/run.sh            (DUR=10s by default; needs nginx and wrk: apt-get install nginx wrk)
#   CALLGRIND=1 bench/run.sh   (also instructions per request: bench/callgrind.sh, needs valgrind)
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${DUR:-10s}
PASSES=${PASSES:-3}
CONNS=${CONNS:-1 16 64}   # CONNS=1: the latency figure alone
TICK=$(getconf CLK_TCK)
command -v wrk >/dev/null && command -v nginx >/dev/null || { echo "needs wrk and nginx (apt-get install wrk nginx)"; exit 2; }
BIN=${BIN:-./target/release/tollgate}   # BIN=path: bench that binary instead of building
[ "$BIN" != ./target/release/tollgate ] || cargo build --release --quiet --bin tollgate
rm -f /tmp/tollgate-bench.db*

. bench/mock.sh
nginx -c "$PWD/bench/nginx-proxy.conf" -p /tmp & pids+=($!)
TOLLGATE_LOG=warn "$BIN" serve --policy bench/policy.yaml & TG=$!; pids+=($TG)
TOLLGATE_LOG=warn "$BIN" serve --policy bench/policy-default.yaml & TGD=$!; pids+=($TGD)
sleep 1.5
NGINX_PROXY=$(cat /tmp/tollgate-bench-proxy.pid)

# CPU ticks (user+system) of a process and its children processes (nginx workers).
cpu_ticks() {
  local total=0 p
  for p in "$@" $(pgrep -P "$1" 2>/dev/null || true); do
    [ -r "/proc/$p/stat" ] || continue
    total=$(( total + $(awk '{print $14 + $15}' "/proc/$p/stat") ))
  done
  echo "$total"
}

run() { # name url pid connections -> "rps p50 p99 cpu_us_per_req errors"
  local name=$1 url=$2 pid=$3 c=$4
  local before after out
  before=$([ "$pid" = - ] && echo 0 || cpu_ticks "$pid")
  out=$(${WRK_ON:-} wrk -t1 -c"$c" -d"$DUR" -s bench/post.lua "$url" | grep '^RESULT')
  after=$([ "$pid" = - ] && echo 0 || cpu_ticks "$pid")
  eval "$(echo "$out" | sed 's/^RESULT //; s/ /;/g')"
  local secs rps cpu
  secs=$(awk -v d="$duration_us" 'BEGIN{print d/1e6}')
  rps=$(awk -v r="$requests" -v s="$secs" 'BEGIN{printf "%.0f", r/s}')
  cpu=$(awk -v a="$after" -v b="$before" -v t="$TICK" -v r="$requests" 'BEGIN{ if (r==0) print "n/a"; else printf "%.1f", (a-b)/t*1e6/r}')
  echo "$rps $p50_us $p99_us $cpu $errors"
}

url_of() {
  case $1 in
    direct) echo "http://127.0.0.1:18080/v1/chat/completions -" ;;
    nginx) echo "http://127.0.0.1:18090/v1/chat/completions $NGINX_PROXY" ;;
    tollgate) echo "http://127.0.0.1:18787/v1/chat/completions $TG" ;;
    tollgate-sqlite) echo "http://127.0.0.1:18788/v1/chat/completions $TGD" ;;
  esac
}
TARGETS="direct nginx tollgate tollgate-sqlite"
# The targets take turns within each pass (direct, nginx, tollgate, … at one connection count,
# then the next), so the machine's drift over minutes falls on all of them alike and the
# ratios compare runs seconds apart; each figure is the median pass.
declare -A RESULTS
for _ in $(seq "$PASSES"); do
  for c in $CONNS; do
    for target in $TARGETS; do
      read -r url pid <<<"$(url_of "$target")"
      RESULTS[$target/$c]+="$(run "$target" "$url" "$pid" "$c")"$'\n'
    done
  done
done
# One connection again, every process on a fixed core, the same for every
# target: wrk and the proxy on the first core (a sidecar shares its pod with its client), the
# mock upstream on the last. Left free, which of the three processes share a core is up to
# the scheduler (mostly settled as wrk starts: at one connection one process runs at a time,
# and a woken one stays on its idle core), and it decides how many of a request's four
# hand-overs cross cores. On a 2-core VM one that does costs ~20-30 µs, so the free figure
# follows the placement more than the proxy (docs/performance.md, twenty-eighth round).
# PLACED=0: skip this.
declare -A PLACED_RESULTS
if [ "${PLACED:-1}" = 1 ] && [[ " $CONNS " == *" 1 "* ]] && command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then
  CLIENT_CORE=0; UPSTREAM_CORE=$(( $(nproc) - 1 ))
  pin() { # core pid...: the processes, their threads and their children's, on one core
    local core=$1 p q; shift
    for p in "$@"; do for q in "$p" $(pgrep -P "$p" || true); do taskset -a -p -c "$core" "$q" >/dev/null; done; done
  }
  pin "$UPSTREAM_CORE" "$(cat /tmp/tollgate-bench-mock.pid)"
  pin "$CLIENT_CORE" "$NGINX_PROXY" "$TG" "$TGD"
  for _ in $(seq "$PASSES"); do
    for target in $TARGETS; do
      read -r url pid <<<"$(url_of "$target")"
      PLACED_RESULTS[$target]+="$(WRK_ON="taskset -c $CLIENT_CORE" run "$target" "$url" "$pid" 1)"$'\n'
    done
  done
fi

# median_pass RUNS: of a target's runs (one line a pass), the pass with the median req/s.
median_pass() { printf '%s' "$1" | sort -n -k1 | sed -n "$(( (PASSES + 1) / 2 ))p"; }
# p50s RUNS: the p50 of each run, in pass order.
p50s() { printf '%s' "$1" | awk '{print $2}'; }

# latency NAME LABEL RESULT-ARRAY KEY-SUFFIX: the added p50 latency at one connection of
# target NAME against nginx's, from the median pass (by req/s) and as the median of each
# pass's own ratio (its runs seconds apart, so the machine's drift over the minutes falls on
# all three alike).
latency() {
  local t=$1 label=$2 sfx=$4 a n d
  local -n res=$3
  [ -n "${res[$t$sfx]:-}" ] || return 0
  a=$(p50s "$(median_pass "${res[$t$sfx]}")")
  n=$(p50s "$(median_pass "${res[nginx$sfx]}")")
  d=$(p50s "$(median_pass "${res[direct$sfx]}")")
  awk -v t="$t" -v l="$label" -v a="$a" -v n="$n" -v d="$d" \
    'BEGIN{printf "%s p50 added latency at 1 connection%s: %d µs (nginx: %d µs, %.2fx)\n", t, l, a-d, n-d, (n>d)?(a-d)/(n-d):0}'
  paste <(p50s "${res[direct$sfx]}") <(p50s "${res[nginx$sfx]}") <(p50s "${res[$t$sfx]}") |
    awk '$2>$1{print ($3-$1)/($2-$1)}' | sort -g |
    awk -v t="$t" -v l="$label" '{r[NR]=$1; s=s sprintf(" %.2f", $1)} END{if (NR) printf "%s added latency ratio per pass%s:%s (median %.2fx)\n", t, l, s, (NR%2)?r[(NR+1)/2]:(r[NR/2]+r[NR/2+1])/2}'
}

echo "| target | conns | req/s | p50 µs | p99 µs | proxy CPU µs/req | errors |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
declare -A RPS CPU
for target in $TARGETS; do
  for c in $CONNS; do
    read -r rps p50 p99 cpu errors <<<"$(median_pass "${RESULTS[$target/$c]}")"
    RPS[$target/$c]=$rps; CPU[$target/$c]=$cpu
    echo "| $target | $c | $rps | $p50 | $p99 | $cpu | $errors |"
  done
  [ -n "${PLACED_RESULTS[$target]:-}" ] || continue
  read -r rps p50 p99 cpu errors <<<"$(median_pass "${PLACED_RESULTS[$target]}")"
  echo "| $target | 1, placed | $rps | $p50 | $p99 | $cpu | $errors |"
done
echo
for t in tollgate tollgate-sqlite; do
  for c in $CONNS; do
    [ "$c" != 1 ] || continue
    awk -v t="$t" -v c="$c" -v r="${RPS[$t/$c]}" -v rn="${RPS[nginx/$c]}" -v u="${CPU[$t/$c]}" -v un="${CPU[nginx/$c]}" \
      'BEGIN{printf "%s at %s connections: %.0f %% of nginx req/s, %.2fx nginx CPU per request\n", t, c, 100*r/rn, u/un}'
  done
  latency "$t" "" RESULTS /1
  latency "$t" ", placed" PLACED_RESULTS ""
done
echo "tollgate RSS after the runs: $(awk '/VmRSS/{print $2, $3}' /proc/$TG/status)"
echo "tollgate-sqlite RSS after the runs: $(awk '/VmRSS/{print $2, $3}' /proc/$TGD/status)"
if [ -n "${CALLGRIND:-}" ]; then
  cleanup; pids=()
  BIN=$BIN bench/callgrind.sh
  BIN=$BIN POLICY=bench/policy-default.yaml bench/callgrind.sh
fi
