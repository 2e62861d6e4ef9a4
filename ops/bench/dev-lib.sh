# Sourced by scale.sh and chaos.sh: the binaries they run, and the
# `walship dev` cluster they start.

# Sets `walship` when empty (target/release/walship when built, else
# target/debug/walship) and `history_bin` beside it; exits 1 when there is
# no walship binary.
pick_walship() {
  if [ -z "$walship" ]; then
    walship=target/release/walship
    [ -x "$walship" ] || walship=target/debug/walship
  fi
  [ -x "$walship" ] || { echo "no walship binary at $walship: cargo build --release" >&2; exit 1; }
  history_bin="$(dirname "$walship")/walship-history"
}

# Exits 1 unless walship-history is beside walship (after pick_walship).
need_history() {
  [ -x "$history_bin" ] || { echo "no walship-history beside $walship: cargo build --release -p walship-compare --bin walship-history" >&2; exit 1; }
}

# The dashboard URL that `walship dev` (process PID, writing LOG) prints
# once its cluster is up; nothing when it exits first, or after 10 minutes.
dev_dashboard() {
  local log=$1 pid=$2 admin=""
  for _ in $(seq 1 3000); do
    admin=$(grep -o 'dashboard: http://[0-9.:]*/' "$log" | head -1 | sed 's/dashboard: //' || true)
    [ -n "$admin" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  echo "$admin"
}
