#!/usr/bin/env bash
# A walship node's resident memory per retained record, and single-record
# read latency from the middle of the log (see ops/bench/README.md).
#
#   ops/bench/memory.sh                                     # 180 s of load, target/release/walship
#   ops/bench/memory.sh --baseline /path/to/older/walship   # the same again with an older binary, and ratios
#   ops/bench/memory.sh --duration 20 --reads 300 --out /tmp/mem
#
# Builds the release binaries and runs walship-memory, which starts three
# `walship node`s and a `walship coord` on free loopback ports and stops them
# before it exits (Ctrl-C too). Results: ops/bench/results/memory.{md,json}
# and memory-samples.csv (--out elsewhere). `--walship` measures another
# binary than target/release/walship.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --locked -p walship -p walship-compare
exec target/release/walship-memory "$@"
