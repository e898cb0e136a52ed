# Shared by bench/callgrind.sh and bench/otel-cost.sh: start the nginx mock, send requests,
# and count a process's user-space instructions per request under callgrind.
# Expects N, OUT (a scratch directory) and the working directory at the repository root.
. bench/mock.sh

# send PORT COUNT: COUNT sequential POSTs on one keep-alive connection; fails on a non-200.
# VARY=1: each request's user message ends in a number of its own (no text seen before).
send() {
  VARY=${VARY:-} python3 - "$1" "$2" <<'PY'
import http.client, os, random, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
body = open("bench/post.lua").read().split("wrk.body = '", 1)[1].split("'\n", 1)[0]
vary = bool(os.environ.get("VARY"))
hdrs = {"Content-Type": "application/json", "x-tollgate-consumer": "bench"}
c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
for _ in range(n):
    b = body.replace("two sentences.", "two sentences. %d" % random.getrandbits(40)) if vary else body
    c.request("POST", "/v1/chat/completions", b.encode(), hdrs)
    r = c.getresponse(); r.read()
    if r.status != 200: sys.exit(f"status {r.status}")
PY
}

wait_port() { for _ in $(seq 600); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }

# measure NAME PORT CMD...: runs CMD under callgrind, prints instructions per request.
measure() {
  local name=$1 port=$2; shift 2
  env ${VG_PRELOAD:+LD_PRELOAD=$VG_PRELOAD} valgrind --tool=callgrind ${VG_ARGS:-} --callgrind-out-file="$OUT/$name.%p" "$@" >"$OUT/$name.log" 2>&1 &
  local vg=$!; pids+=($vg)
  wait_port "$port"
  send "$port" "${WARM:-20}"
  # Background work the warm-up caused (span export) runs before the count starts.
  sleep "${PRE_SETTLE:-0}"
  callgrind_control -z "$vg" >/dev/null 2>&1
  # WINDOW_LOG: a log whose lines made inside the counted window are counted too.
  local before=0
  [ -z "${WINDOW_LOG:-}" ] || before=$(wc -l < "$WINDOW_LOG")
  send "$port" "$N"
  # Background work the requests caused (span export) is counted once it ran.
  sleep "${SETTLE:-0}"
  callgrind_control -d "$vg" >/dev/null 2>&1
  [ -z "${WINDOW_LOG:-}" ] || echo $(( $(wc -l < "$WINDOW_LOG") - before )) > "$OUT/$name.window-lines"
  sleep 0.5
  local total
  total=$(cat "$OUT/$name".*.[0-9]* 2>/dev/null | awk '/^totals:/{s+=$2} END{print s+0}')
  [ "$total" -gt 0 ] || total=$(awk '/^summary:|^totals:/{s+=$2} END{print s+0}' "$OUT/$name".* )
  kill "$vg" 2>/dev/null || true; wait "$vg" 2>/dev/null || true
  echo $(( total / N ))
}

