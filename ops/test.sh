#!/usr/bin/env bash
# The whole walship test suite: formatting, lints, unit, conformance and
# black-box tests (real `walship node` / `walship coord` processes, a real
# NATS server, a real S3-compatible server (s3s-fs), and for the comparison
# benchmark's smoke run a PostgreSQL primary with two standbys, each on free
# loopback ports, started and stopped by the tests; the partition tests run
# each process as a Unix user of its own and cut links with nftables, which
# needs root).
# Installs what the tests need when the machine lacks it. `.ci/run` runs
# exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

if ! command -v cargo >/dev/null; then
  echo "cargo is required (stable Rust 1.95)" >&2
  exit 1
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "installing cargo-nextest ..." >&2
  cargo install cargo-nextest --locked
fi

# shellcheck source=ops/install.sh
. "$root/ops/install.sh"
install_nats
install_schemathesis
install_pyarrow # tests/arrow_pyarrow.rs reads an export with it
install_promtool
install_nftables # the partition tests (they also need root)
install_browser
install_postgres # the comparison benchmark's smoke test
install_fonts
install_curl # the walkthroughs tests run as printed
install_valgrind # ops/bench/callgrind.sh, run by tests/bench_smoke.rs
install_s3s_fs # objstore's S3Store runs its conformance suite against it

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo nextest run --workspace --all-targets --locked --no-fail-fast "$@"
