#!/usr/bin/env bash
# Instructions per request (user space), tollgate against nginx as a bare reverse proxy: the
# noise-free figure to steer by (timings on a shared box move 20-30 % between runs; these
# counts move < 0.1 %). Each proxy runs under `valgrind --tool=callgrind` in front of the
# fixed-answer nginx mock; after a warm-up the counters are zeroed, N sequential keep-alive
# requests (the bench request of bench/post.lua) are sent, and the dump's total is divided by N.
#   bench/callgrind.sh                     (N=500; POLICY=bench/policy.yaml; needs nginx, valgrind)
#   POLICY=bench/policy-default.yaml bench/callgrind.sh     (the SQLite default-state target)
#   VARY=1 bench/callgrind.sh             (every request's prompt differs: no count from the memo)
#   KEEP=1 bench/callgrind.sh             (keep the dumps in /tmp/tollgate-cg/ for callgrind_annotate)
#   VG_ARGS=--separate-threads=yes KEEP=1 bench/callgrind.sh   (one dump per thread)
#   WARM=500 bench/callgrind.sh            (500 warm-up requests before counting, not 20; bench/otel-cost.sh too)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-500}
POLICY=${POLICY:-bench/policy.yaml}
BIN=${BIN:-./target/release/tollgate}
OUT=/tmp/tollgate-cg
command -v valgrind >/dev/null && command -v nginx >/dev/null || { echo "needs valgrind and nginx"; exit 2; }
[ -x "$BIN" ] || cargo build --release --quiet --bin tollgate
rm -rf "$OUT"; mkdir -p "$OUT"

. bench/callgrind-lib.sh

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
