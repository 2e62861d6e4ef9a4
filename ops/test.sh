#!/usr/bin/env bash
# The whole walship test suite: formatting, lints, unit, conformance and
# black-box tests (real `walship node` processes on free loopback ports).
# Installs what the tests need when the machine lacks it; starts and stops
# its own servers. `.ci/run` runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "cargo is required (stable Rust 1.95)" >&2
  exit 1
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "installing cargo-nextest ..." >&2
  cargo install cargo-nextest --locked
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo nextest run --workspace --all-targets --locked --no-fail-fast "$@"
