# Sourced by the benches: the fixed-answer nginx mock upstream (bench/nginx-mock.conf) started
# in the background, and everything in `pids` (the mock, and what the bench adds) stopped when
# the bench exits. Expects the working directory at the repository root.
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
nginx -c "$PWD/bench/nginx-mock.conf" -p /tmp & pids+=($!)
