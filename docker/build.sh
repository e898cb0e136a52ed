#!/usr/bin/env bash
# The builder stage's steps (docker/Dockerfile runs them; scripts/docker-replay runs the same
# script on the same files outside a container, in CI).
#   docker/build.sh deps   compile the dependencies against stub sources (a cached layer)
#   docker/build.sh app    compile tollgate from src/ and policies/ into out/tollgate
# Environment: TOLLGATE_BUILD_PROFILE (default release), CARGO_TARGET_DIR (default target).
# Nothing here lists the manifest's targets: `--bin tollgate` builds the library and the one
# binary, and benches/ is copied whole because Cargo wants every [[bench]] file to exist.
set -euo pipefail
profile=${TOLLGATE_BUILD_PROFILE:-release}
target=${CARGO_TARGET_DIR:-target}
case "$profile" in
  dev) dir=debug ;;
  *) dir=$profile ;;
esac
build() { cargo build --profile "$profile" --locked --bin tollgate; }
case "${1:-}" in
  deps)
    mkdir -p src
    echo 'fn main() {}' > src/main.rs
    : > src/lib.rs
    build
    rm -rf src
    ;;
  app)
    # The copied sources may be older than the stubs' build: make Cargo see them as new.
    touch src/main.rs src/lib.rs
    build
    mkdir -p out
    cp "$target/$dir/tollgate" out/tollgate
    if command -v strip >/dev/null; then strip out/tollgate; fi
    ;;
  *)
    echo "usage: docker/build.sh deps|app" >&2
    exit 2
    ;;
esac
