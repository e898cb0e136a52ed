#!/usr/bin/env bash
# Redis-backed vs SQLite-backed sidecar, same load, one run (issue 51 point 7: target Redis
# with slices ≥ 80 % of SQLite's req/s). Three release sidecars on loopback with the default
# policy's shape (bench/policy-default.yaml): SQLite state; Redis with `state.slices: true`;
# Redis per request (`slices: false`, for reference). wrk (one thread, $CONNS connections,
# $DUR each) takes turns on them for $PASSES passes; the median pass per target is reported,
# then the ratios. Needs wrk, nginx (the mock upstream) and Redis on 127.0.0.1:6379; the
# bench's Redis keys (a fresh namespace) are deleted at the end. Bounded: 3 × $PASSES × $DUR.
#   bench/redis-vs-sqlite.sh          (DUR=10s PASSES=3 CONNS=16)
#   BIN=path bench/redis-vs-sqlite.sh (bench that binary instead of building)
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${DUR:-10s}
PASSES=${PASSES:-3}
CONNS=${CONNS:-16}
REDIS=${REDIS:-redis://127.0.0.1:6379/}
command -v wrk >/dev/null && command -v nginx >/dev/null || { echo "needs wrk and nginx (apt-get install wrk nginx)"; exit 2; }
command -v redis-cli >/dev/null || { echo "needs redis-cli"; exit 2; }
BIN=${BIN:-./target/release/tollgate}
[ "$BIN" != ./target/release/tollgate ] || cargo build --release --quiet --bin tollgate
NS=bench-$RANDOM$RANDOM
TMP=$(mktemp -d /tmp/tollgate-rvs.XXXXXX)
rm -f /tmp/tollgate-bench.db*

. bench/mock.sh
drop_keys() { redis-cli -u "$REDIS" --scan --pattern "{tollgate:$NS}*" | xargs -r redis-cli -u "$REDIS" del >/dev/null; }
trap 'cleanup; drop_keys; rm -rf "$TMP"' EXIT

# The SQLite policy as is; two Redis variants of it on other ports.
redis_policy() { # port admin_port slices
  sed -e "s#127.0.0.1:18788#127.0.0.1:$1#; s#127.0.0.1:19465#127.0.0.1:$2#" \
      -e "s#^state: .*#state: {backend: redis, redis_url: \"$REDIS\", namespace: $NS, slices: $3}#" \
      -e "s#tollgate-bench-default-audit#tollgate-bench-redis-$1-audit#" bench/policy-default.yaml
}
redis_policy 18791 19467 true >"$TMP/slices.yaml"
redis_policy 18792 19468 false >"$TMP/per-request.yaml"
TOLLGATE_LOG=warn "$BIN" serve --policy bench/policy-default.yaml & pids+=($!)
TOLLGATE_LOG=warn "$BIN" serve --policy "$TMP/slices.yaml" & pids+=($!)
TOLLGATE_LOG=warn "$BIN" serve --policy "$TMP/per-request.yaml" & pids+=($!)
for port in 18788 18791 18792; do   # wait (bounded) until each answers
  for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
done

url_of() {
  case $1 in
    sqlite) echo http://127.0.0.1:18788/v1/chat/completions ;;
    redis-slices) echo http://127.0.0.1:18791/v1/chat/completions ;;
    redis-per-request) echo http://127.0.0.1:18792/v1/chat/completions ;;
  esac
}
run() { # url -> "rps errors non2xx"
  local out; out=$(wrk -t1 -c"$CONNS" -d"$DUR" -s bench/post.lua "$1")
  local res; res=$(echo "$out" | grep '^RESULT')
  eval "$(echo "$res" | sed 's/^RESULT //; s/ /;/g')"
  local non2xx; non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}'); non2xx=${non2xx:-0}
  awk -v r="$requests" -v d="$duration_us" -v e="$errors" -v n="$non2xx" 'BEGIN{printf "%.0f %d %d\n", r/(d/1e6), e, n}'
}
TARGETS="sqlite redis-slices redis-per-request"
declare -A RPS
for pass in $(seq "$PASSES"); do
  for t in $TARGETS; do
    read -r rps err non2xx <<<"$(run "$(url_of "$t")")"
    echo "pass $pass $t: $rps req/s (socket errors $err, non-2xx $non2xx)"
    RPS[$t]+="$rps "
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
echo
echo "host $(hostname) $(nproc) cores, $(date -u +%FT%TZ), wrk -t1 -c$CONNS -d$DUR, $PASSES passes (median)"
S=$(echo "${RPS[sqlite]}" | median)
for t in $TARGETS; do
  M=$(echo "${RPS[$t]}" | median)
  echo "$t: $M req/s (passes: ${RPS[$t]}) ratio to sqlite $(awk -v a="$M" -v b="$S" 'BEGIN{printf "%.2f", a/b}')"
done
