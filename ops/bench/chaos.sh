#!/usr/bin/env bash
# Random faults under load, every acknowledged record checked. Starts
# `walship dev --shards N` (3 nodes, RF=3; a node that exits is restarted
# after 1 s), runs `walship-history` on a sample of the shards (one QUORUM
# client a shard, one record in flight, unique payloads), and for
# --seconds hits a random node every 3 to 7 s with one of:
#   kill     SIGKILL
#   term     SIGTERM (a graceful stop)
#   freeze   SIGSTOP for 1 to 4 s, then SIGCONT (a stalled process: its
#            peers and the coordinator see it silent, then it wakes up
#            holding the leaderships it had)
#   kill2    SIGKILL of it and the next node together (a majority gone:
#            nothing can be acknowledged until one returns)
#   coord    SIGKILL of the coordinator instead (no failover until it is
#            back, 1 s later, from its file KV)
#   corrupt  one random byte of the node's WAL files flipped (a byte
#            already written, in a `*.raftlog` file); every other time the
#            node is SIGKILLed first, so that its restart reads the damage.
#            Not among the defaults: name it in --faults. The node must
#            find the damage (by a read, the scrubber or its restart) and
#            repair it from another replica; a record damaged on one node
#            is served by the others meanwhile.
#   rebalance  POST /v1/rebalance to the coordinator instead: the shards of
#            the nodes leading more than their share fail over to the
#            ones leading less, under load and between the other faults
#            (a move whose planned replica lacks an acknowledged record
#            leaves the shard where it is). Not among the defaults. The
#            answer's counts go to faults.txt.
# Then the load stops and every acknowledged record is read back from every
# node, once that node has committed it. Prints one JSON line: the faults
# made, the nodes that could not open their WAL at a start
# (`wal_unopenable`: damage recovery cannot cut away, which stops a node at
# every start until it is re-seeded), and `history` (acknowledged, unknown
# outcomes, refused, lost, the
# (shard, node) pairs checked and unchecked, and why any node could not be
# read). Exits 1 on a loss, a shard read on no node, or nothing
# acknowledged.
#
#   ops/bench/chaos.sh                                    # 300 shards, 32 sampled, 120 s
#   ops/bench/chaos.sh --shards 30 --sample 8 --seconds 20 --seed 7
#   ops/bench/chaos.sh --faults kill,freeze               # only these
#   ops/bench/chaos.sh --max-disk-mib 100                 # every disk fills up meanwhile
#   ops/bench/chaos.sh --keep /tmp/chaos                  # keep the data, the log, the faults
#
# The same --seed gives the same faults at the same moments (the cluster's
# timing still differs run to run). --max-disk-mib is `walship dev`'s cap
# (0, the default here: none); with a small cap the nodes fill their disks
# during the run, refuse appends, and must still serve every acknowledged
# record they hold (a replica that missed records before its disk filled
# cannot fetch them, and is unchecked for that shard). Uses target/release/walship when built, else target/debug/walship,
# and `walship-history` beside it (`cargo build --release -p walship-compare
# --bin walship-history`).
set -euo pipefail
cd "$(dirname "$0")/../.."

shards=300
sample=32
seconds=120
seed=$$
faults="kill,term,freeze,kill2,coord"
cap=0
walship=""
keep=""
while [ $# -gt 0 ]; do
  case "$1" in
    --shards) shards="$2"; shift 2 ;;
    --sample) sample="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --faults) faults="$2"; shift 2 ;;
    --max-disk-mib) cap="$2"; shift 2 ;;
    --walship) walship="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
number() { [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] || { echo "$1 takes a whole number of at least $3, not $2" >&2; exit 2; }; }
number --shards "$shards" 1
number --sample "$sample" 1
number --seconds "$seconds" 1
number --seed "$seed" 0
number --max-disk-mib "$cap" 0
[ "$sample" -le "$shards" ] || { echo "--sample $sample is more than the $shards shards" >&2; exit 2; }
IFS=, read -r -a kinds <<<"$faults"
[ "${#kinds[@]}" -gt 0 ] || { echo "--faults names none" >&2; exit 2; }
for kind in "${kinds[@]}"; do
  case "$kind" in kill | term | freeze | kill2 | coord | corrupt | rebalance) ;; *) echo "--faults: $kind is not one of kill, term, freeze, kill2, coord, corrupt, rebalance" >&2; exit 2 ;; esac
done
# shellcheck source=ops/bench/dev-lib.sh
. ops/bench/dev-lib.sh
pick_walship
need_history

if [ -n "$keep" ]; then
  mkdir -p "$keep"
  dir="$keep"
else
  dir=$(mktemp -d)
fi
log="$dir/dev.log"
"$walship" dev --shards "$shards" --max-disk-mib "$cap" --data-dir "$dir/data" --base-port 0 >"$log" 2>&1 &
dev=$!
history_pid=""
stopped=""
cleanup() {
  # A frozen node is woken first, so that it can stop.
  [ -n "$stopped" ] && kill -CONT "$stopped" 2>/dev/null
  [ -n "$history_pid" ] && kill "$history_pid" 2>/dev/null
  kill "$dev" 2>/dev/null
  wait 2>/dev/null
  [ -n "$keep" ] || rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "{\"error\": \"$1\"}"; exit 1; }

admin=$(dev_dashboard "$log" "$dev")
[ -n "$admin" ] || fail "dev did not come up: $(tail -1 "$log" | tr -d '"')"
servers=$(curl -sf "${admin}v1/cluster" | python3 -c 'import json,sys; print(",".join(n["grpc_addr"] for n in json.load(sys.stdin)["nodes"]))')
# The sample: shards spread evenly over 1..N.
picked=$(python3 -c "import sys; n, k = $shards, $sample; print(','.join(str(1 + i * n // k) for i in range(k)))")
"$history_bin" --servers "$servers" --shards "$picked" --stop-file "$dir/history.stop" \
  >"$dir/history.json" 2>"$dir/history.err" &
history_pid=$!

# The process under `walship dev` whose command line has PATTERN, if it runs.
child_pid() {
  local p
  for p in $(pgrep -P "$dev"); do
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "$1" && echo "$p" && return
  done
  return 0
}
node_pid() { child_pid "--node-id $1 "; }
RANDOM=$seed
declare -A made=([kill]=0 [term]=0 [freeze]=0 [kill2]=0 [coord]=0 [corrupt]=0 [rebalance]=0 [missed]=0)
# Flips one byte of NODE's WAL: a random `*.raftlog` file, a random offset,
# moved on to the next byte that is not zero (what lies past a file's
# written end is zeros); prints the file, the offset and the bytes.
flip_byte() {
  python3 - "$dir/data/node-$1/wal" "$2" <<'PY'
import os, random, sys
wal, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
files = sorted(f for f in os.listdir(wal) if f.endswith(".raftlog"))
if not files:
    print("no WAL file")
    sys.exit(0)
path = os.path.join(wal, rng.choice(files))
with open(path, "r+b") as f:
    size = os.fstat(f.fileno()).st_size
    for _ in range(64):
        at = rng.randrange(size) if size else 0
        f.seek(at)
        window = f.read(1 << 16)
        nonzero = next((i for i, b in enumerate(window) if b), None)
        if nonzero is not None:
            at += nonzero
            old = window[nonzero]
            new = old ^ (1 << rng.randrange(8))
            f.seek(at)
            f.write(bytes([new]))
            f.flush()
            os.fsync(f.fileno())
            print(f"{os.path.basename(path)} at {at}: {old:#04x} -> {new:#04x}")
            break
    else:
        print(f"{os.path.basename(path)}: no written byte found")
PY
}
: >"$dir/faults.txt"
end=$(($(date +%s) + seconds))
while [ "$(date +%s)" -lt "$end" ]; do
  sleep $((3 + RANDOM % 5))
  node=$((1 + RANDOM % 3))
  kind=${kinds[$((RANDOM % ${#kinds[@]}))]}
  hold=$((1 + RANDOM % 4))
  if [ "$kind" = coord ] || [ "$kind" = rebalance ]; then
    pid=$(child_pid " coord ")
  else
    pid=$(node_pid "$node")
  fi
  # A node `walship dev` has not restarted yet: nothing to hit this time.
  if [ -z "$pid" ]; then
    made[missed]=$((made[missed] + 1))
    continue
  fi
  what="node $node"
  [ "$kind" = coord ] && what="the coordinator"
  [ "$kind" = rebalance ] && what="a rebalance"
  line="$(date +%T.%N | cut -c1-12) $kind $what"
  case "$kind" in
    kill) kill -KILL "$pid" 2>/dev/null || true ;;
    term) kill -TERM "$pid" 2>/dev/null || true ;;
    coord) kill -KILL "$pid" 2>/dev/null || true ;;
    freeze)
      stopped=$pid
      kill -STOP "$pid" 2>/dev/null || true
      sleep "$hold"
      kill -CONT "$pid" 2>/dev/null || true
      stopped=""
      ;;
    kill2)
      other=$(node_pid $((node % 3 + 1)))
      kill -KILL "$pid" $other 2>/dev/null || true
      ;;
    rebalance)
      # The answer's counts, or why there is none (another rebalance
      # running, the coordinator restarting): either way the cluster
      # goes on, and the check at the end is the same.
      answer=$(curl -s -m 30 -X POST -H "Authorization: Bearer $(cat "$dir/data/admin-token")" \
        -H 'Content-Type: application/json' -d '{}' "${admin}v1/rebalance" || true)
      line="$line: $(printf '%s' "$answer" | python3 -c '
import json, sys
try:
    o = json.load(sys.stdin)
except ValueError:
    print("no answer"); sys.exit(0)
if "moves" not in o:
    print(o.get("error", o)); sys.exit(0)
moves = o["moves"]
passed = sum(1 for m in moves if m.get("leader") is not None and m["leader"] != m["to"])
failed = sum(1 for m in moves if m.get("error"))
before, after, moved = o["leads_before"], o["leads_after"], o["moved"]
print(f"leads {before} -> {after}, {len(moves)} planned, {moved} moved, {passed} passed over, {failed} not made")
')"
      ;;
    corrupt)
      if [ $((RANDOM % 2)) -eq 0 ]; then
        line="$line (killed first)"
        kill -KILL "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
      fi
      line="$line: $(flip_byte "$node" "$RANDOM")"
      ;;
  esac
  echo "$line" >>"$dir/faults.txt"
  made[$kind]=$((made[$kind] + 1))
done
# Every node back before the load stops, then the check.
sleep 3
touch "$dir/history.stop"
status=0
wait "$history_pid" || status=$?
history_pid=""
verdict=$(cat "$dir/history.json")
[ -n "$verdict" ] || fail "walship-history printed no verdict: $(tail -1 "$dir/history.err" | tr -d '"')"
# Nodes whose last start failed to open their WAL (damage recovery cannot
# cut away, such as a flipped byte in the item metadata of an older log
# file: the node stops at start every time, ops/runbooks/corruption.md).
unopenable=$({ grep -o "opening the WAL under [^:]*" "$log" || true; } | sed -E 's|.*/node-([0-9]+)/wal|\1|' | sort -un | paste -sd, -)
echo "{\"shards\": $shards, \"sample\": $sample, \"seconds\": $seconds, \"seed\": $seed, \"max_disk_mib\": $cap, \"faults\": {\"kill\": ${made[kill]}, \"term\": ${made[term]}, \"freeze\": ${made[freeze]}, \"kill2\": ${made[kill2]}, \"coord\": ${made[coord]}, \"corrupt\": ${made[corrupt]}, \"rebalance\": ${made[rebalance]}, \"missed\": ${made[missed]}}, \"wal_unopenable\": [$unopenable], \"history\": $verdict}"
exit "$status"
