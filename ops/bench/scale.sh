#!/usr/bin/env bash
# Idle cost of many shards: starts `walship dev --shards N` (3 nodes, RF=3,
# nothing appended), times until every shard has a leader, then measures
# each process's CPU (share of one core) and resident memory over an idle
# window, and stops the cluster. One line of JSON per shard count.
#
#   ops/bench/scale.sh                                   # 10 and 1000 shards, 30 s idle each
#   ops/bench/scale.sh --shards "10 100" --idle-s 5      # quicker
#   ops/bench/scale.sh --walship /tmp/old/walship        # another build
#   ops/bench/scale.sh --shards 1000 --kill              # then kill -9 node 1
#   ops/bench/scale.sh --shards 1000 --kill --keep /tmp/s # and keep the logs
#   ops/bench/scale.sh --shards 1000 --kill --no-restart  # node 1 stays down
#   ops/bench/scale.sh --shards 1000 --kill --rebalance   # then move leaderships back
#   ops/bench/scale.sh --shards 1000 --kill --load 32     # under load, acknowledged records checked
#   ops/bench/scale.sh --shards "10 1000 10000" --kill --load 64 --throughput 1000  # every figure of issue 18
#
# With --kill, after the idle window node 1 (leading about a third of the
# shards) is killed with SIGKILL and the shards it led are timed until each
# has a working leader again (recorded, reporting it leads, in a newer
# epoch: another node, or node 1 itself once `walship dev` restarted it):
# p50, p99 and max over those shards, from the coordinator's count of
# shards without one (`shards_leading` in GET /v1/cluster: a recorded
# leader reporting it leads, not lost to the coordinator), each the time
# from which on the count stayed at or under the rest (a count that falls
# and rises again is timed to its last fall). Beside them: when the count
# rose (`rose_s`: the coordinator counts node 1's shards lost, about the
# replication timeout after the kill) and the first new leader reported
# (`first_led_s`), how often the surviving nodes' heartbeats came late
# (`survivors_late`), and the CPU seconds the coordinator used from the
# kill until the count had stayed at zero for 2 s (`coordinator_cpu_s`).
# With --no-restart, `walship dev` leaves node 1 down, and once the
# failover is over (5 s after it) the survivors and the coordinator are
# measured idle again over the same window: `down` holds each one's CPU
# (share of one core) with a node down for good.
#
# With --rebalance (after --kill, node 1 restarted), once node 1 follows
# again (a rebalance preview plans the same moves for 2 s) a rebalance
# (`POST /v1/rebalance`) moves leaderships back: `rebalance` holds the
# moves planned and made, the coordinator's own time for them (`took_ms`),
# the time until every shard had a working leader again for 2 s
# (`settled_s`), the shards each node leads before and after, and the
# failovers other than the rebalance's meanwhile (`other_failovers`: none
# expected).
#
# With --load N (implies --kill), N sampled shards (half of them led by
# node 1, the rest by the others) take QUORUM appends from
# `walship-history` (one client a shard, one record in flight, unique
# payloads) from 2 s before the kill until the failover is over; then
# every acknowledged record is read back from every node and must be
# there, at its seqno, with its payload (`history`: acknowledged, before
# the kill, unknown outcomes, refused, lost, the (shard, node) pairs
# checked and unchecked, and why each node that could not be read could
# not (`unreadable`); a restarted node 1 is read once it has caught up). `walship-history` is looked for beside the walship binary (`cargo
# build --release -p walship-compare --bin walship-history`). A loss, or a
# shard no node could be read for, makes the script exit 1 after printing.
#
# With --throughput M, one more JSON line follows the shard counts':
# `walship bench` QUORUM, 100 B records, 64 appenders (each one append in
# flight), on one shard and spread over M shards (`--throughput-s`
# measured seconds each, 10 by default, after 2 s of warm-up), and M
# shards' records/s ÷ one shard's (the bench's `vs_one_shard`), with the
# cluster's CPU µs a record for each.
#
# With --keep DIR, each count's cluster log is kept as DIR/dev-N.log and,
# with --kill, the polled count as DIR/curve-N.json (seconds from the kill,
# shards without a working leader; `kill_unix_s` is the kill's wall-clock
# time, to set beside the log's timestamps).
#
# Uses target/release/walship when built, else target/debug/walship.
set -euo pipefail
cd "$(dirname "$0")/../.."

counts="10 1000"
idle_s=30
walship=""
kill_node=0
keep=""
restart=""
rebalance=0
load=0
throughput=0
throughput_s=10
while [ $# -gt 0 ]; do
  case "$1" in
    --shards) counts="$2"; shift 2 ;;
    --idle-s) idle_s="$2"; shift 2 ;;
    --walship) walship="$2"; shift 2 ;;
    --kill) kill_node=1; shift ;;
    --keep) keep="$2"; mkdir -p "$keep"; shift 2 ;;
    --no-restart) restart="--no-restart"; shift ;;
    --rebalance) rebalance=1; kill_node=1; shift ;;
    --load) load="$2"; kill_node=1; shift 2 ;;
    --throughput) throughput="$2"; shift 2 ;;
    --throughput-s) throughput_s="$2"; shift 2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
# shellcheck source=ops/bench/dev-lib.sh
. ops/bench/dev-lib.sh
pick_walship
if [ "$load" != 0 ]; then
  [[ "$load" =~ ^[1-9][0-9]*$ ]] || { echo "--load takes a number of shards (at least 1), not $load" >&2; exit 2; }
  need_history
fi
if [ "$throughput" != 0 ]; then
  [[ "$throughput" =~ ^[1-9][0-9]*$ ]] && [ "$throughput" -gt 1 ] ||
    { echo "--throughput takes a shard count above 1, not $throughput" >&2; exit 2; }
  [[ "$throughput_s" =~ ^[0-9]+(\.[0-9]+)?$ ]] && awk "BEGIN {exit !($throughput_s > 0)}" ||
    { echo "--throughput-s takes a positive number of seconds, not $throughput_s" >&2; exit 2; }
fi
failed=0

ticks=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
# node-N, coord or dev, from a process's command line.
process_name() {
  local what id
  what=$(tr '\0' ' ' <"/proc/$1/cmdline" | awk '{for (i = 2; i <= NF; i++) if ($i == "node" || $i == "coord" || $i == "dev") {print $i; exit}}')
  id=$(tr '\0' ' ' <"/proc/$1/cmdline" | grep -o -- '--node-id [0-9]*' | awk '{print $2}' || true)
  echo "$what${id:+-$id}"
}
# Each of the processes PIDS... over an idle window of $idle_s: one JSON
# object apiece, comma-separated, with its name and CPU (share of one
# core), and its resident size too when WITH_RSS is 1.
idle_window() {
  local with_rss=$1 p cpu rss out=""
  shift
  local -A start=()
  for p in "$@"; do start[$p]=$(cpu_ticks "$p"); done
  sleep "$idle_s"
  for p in "$@"; do
    cpu=$(awk "BEGIN {printf \"%.3f\", ($(cpu_ticks "$p") - ${start[$p]}) / $ticks / $idle_s}")
    rss=""
    [ "$with_rss" = 1 ] && rss=", \"rss_mib\": $(( $(rss_kib "$p") / 1024 ))"
    out="$out{\"process\": \"$(process_name "$p")\", \"cpu_cores\": $cpu$rss},"
  done
  echo "${out%,}"
}
# A JSON object whose `error` is the last line of FILE.
error_json() { echo "{\"error\": \"$(tail -1 "$1" | tr -d '"\\')\"}"; }

for n in $counts; do
  dir=$(mktemp -d)
  log="$dir/dev.log"
  start=$(date +%s.%N)
  "$walship" dev --shards "$n" --data-dir "$dir/data" --base-port 0 $restart >"$log" 2>&1 &
  dev=$!
  trap 'kill $dev 2>/dev/null; wait $dev 2>/dev/null; rm -rf "$dir"' EXIT
  admin=$(dev_dashboard "$log" "$dev")
  if [ -z "$admin" ] || ! kill -0 "$dev" 2>/dev/null; then
    echo "{\"shards\": $n, \"error\": \"dev did not come up: $(tail -1 "$log" | tr -d '"')\"}"
    kill "$dev" 2>/dev/null || true; wait "$dev" 2>/dev/null || true; rm -rf "$dir"; trap - EXIT
    continue
  fi
  leaders_s=""
  for _ in $(seq 1 3000); do
    left=$(curl -sf "${admin}v1/cluster" | python3 -c 'import json,sys; print(json.load(sys.stdin)["shards_without_leader"])' 2>/dev/null || echo x)
    if [ "$left" = "0" ]; then
      leaders_s=$(awk "BEGIN {printf \"%.2f\", $(date +%s.%N) - $start}")
      break
    fi
    sleep 0.1
  done
  [ -n "$leaders_s" ] || leaders_s=null
  sleep 5 # let start-up work (assignments, first catch-ups) settle
  pids="$dev $(pgrep -P "$dev" | tr '\n' ' ')"
  # shellcheck disable=SC2086 # one argument per PID
  procs=$(idle_window 1 $pids)
  failover=null
  if [ "$kill_node" = 1 ]; then
    node1=""
    for p in $pids; do
      tr '\0' ' ' <"/proc/$p/cmdline" | grep -q -- '--node-id 1 ' && node1=$p
    done
    coord=""
    for p in $pids; do
      tr '\0' ' ' <"/proc/$p/cmdline" | grep -q ' coord ' && coord=$p
    done
    history_pid=""
    mark="$dir/history.mark"
    if [ "$load" != 0 ]; then
      # The sample: half led by node 1, the rest by the other nodes; and
      # every node's gRPC address.
      read -r sample servers < <(python3 - "$admin" "$n" "$load" <<'PY'
import json, sys, urllib.request
admin, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with urllib.request.urlopen(f"{admin}v1/shards?limit={n}", timeout=30) as r:
    shards = json.load(r)
with urllib.request.urlopen(f"{admin}v1/cluster", timeout=5) as r:
    nodes = json.load(r)["nodes"]
by_node1 = [s["shard_id"] for s in shards if s.get("leader") == 1]
others = [s["shard_id"] for s in shards if s.get("leader") not in (None, 1)]
take1 = min(len(by_node1), (k + 1) // 2)
sample = by_node1[:take1] + others[:k - take1]
print(",".join(map(str, sample)), ",".join(v["grpc_addr"] for v in nodes))
PY
)
      "$history_bin" --servers "$servers" --shards "$sample" --stop-file "$dir/history.stop" --mark-file "$mark" \
        >"$dir/history.json" 2>"$dir/history.err" &
      history_pid=$!
      sleep 2
    fi
    failover=$(python3 - "$admin" "$n" "$node1" "$coord" "$ticks" "$keep" "$mark" <<'PY'
import json, os, signal, sys, time, urllib.request
admin, n, pid, coord, ticks, keep, mark = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
def cpu_s(p):
    # CPU seconds the process has used (user + system).
    with open(f"/proc/{p}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks
def leaders():
    with urllib.request.urlopen(f"{admin}v1/shards?limit={n}", timeout=5) as r:
        return {s["shard_id"]: (s.get("leader"), s.get("epoch")) for s in json.load(r)}
before = leaders()
led = [s for s, (l, _) in before.items() if l == 1]
def scrape(url):
    try:
        with urllib.request.urlopen(f"{url}metrics", timeout=5) as r:
            return r.read().decode().splitlines()
    except Exception:
        return []
def over(lines, name, labels, le):
    # Observations of a histogram series above `le` (count minus that bucket).
    count = bucket = 0.0
    for l in lines:
        if l.startswith(f"{name}_count{{") and labels in l:
            count = float(l.split()[-1])
        elif l.startswith(f"{name}_bucket{{") and labels in l and f'le="{le}"' in l:
            bucket = float(l.split()[-1])
    return count - bucket
with urllib.request.urlopen(f"{admin}v1/cluster", timeout=5) as r:
    survivors = {v["node_id"]: f"http://{v['admin_addr']}/" for v in json.load(r)["nodes"] if v["node_id"] != 1}
def lateness():
    # Heartbeats of each surviving node that came more than 100 or 200 ms
    # after the one before (the coordinator's view), and its heartbeat
    # rounds whose building or sending took more than 64 or 256 ms, or that
    # started more than 64 ms after their tick was due (the node's view).
    coord = scrape(admin)
    late = {}
    for node, url in survivors.items():
        mine = scrape(url)
        late[node] = (over(coord, "walship_coordinator_heartbeat_gap_seconds", f'node="{node}"', "0.1"),
                      over(coord, "walship_coordinator_heartbeat_gap_seconds", f'node="{node}"', "0.2"),
                      over(mine, "walship_heartbeat_round_seconds", 'phase="build"', "0.064"),
                      over(mine, "walship_heartbeat_round_seconds", 'phase="build"', "0.256"),
                      over(mine, "walship_heartbeat_round_seconds", 'phase="send"', "0.064"),
                      over(mine, "walship_heartbeat_round_seconds", 'phase="send"', "0.256"),
                      over(mine, "walship_heartbeat_round_seconds", 'phase="late"', "0.064"))
    return late
late_before = lateness()
coord_cpu_before = cpu_s(coord)
def leading():
    with urllib.request.urlopen(f"{admin}v1/cluster", timeout=5) as r:
        return json.load(r)["shards_leading"]
killed_at = time.time()
open(mark, "w").close()
os.kill(pid, signal.SIGKILL)
# Polled: how many shards lack a working leader (the coordinator's
# `shards_leading`: the recorded leader reports leading in the recorded
# epoch and the coordinator does not count it lost). Node 1's shards count
# as lost once its followers stop hearing it (the replication timeout), so
# the count rises to the shards it led, then falls as their new leaders
# (another node, or node 1 itself once `walship dev` restarted it after 1 s)
# report leading. Shards in that count over time are the led shards without
# a leader again yet (and any other shard whose leader stepped down
# meanwhile: it counts against walship). A light poll: listing every
# shard every 50 ms (14 MB of JSON at 10,000 shards) took a core of the
# two the cluster fails over on.
# The poll goes on until the count has stayed at zero for 2 s: a count
# that falls to zero and rises again (shards losing the leaders they had
# just got, or looking led when they were not) is not over.
start, curve, rose, zero_since = time.monotonic(), [], False, None
while time.monotonic() - start < 120:
    try:
        missing = n - leading()
    except Exception:
        time.sleep(0.02)
        continue
    t = time.monotonic() - start
    curve.append((t, missing))
    rose = rose or missing > 0
    zero_since = (zero_since if zero_since is not None else t) if rose and missing == 0 else None
    if zero_since is not None and t - zero_since >= 2:
        break
    time.sleep(0.02)
peak = max((m for _, m in curve), default=0)
# The time the q-th of the led shards had a leader again for good: the
# first sample, once the count rose, after the last one holding more than
# the rest of them.
def at(q):
    rest = len(led) - int(q * len(led))
    first = next((i for i, (_, m) in enumerate(curve) if m > 0), None)
    if first is None:
        return None
    last_over = max((i for i, (_, m) in enumerate(curve) if i >= first and m > rest), default=first - 1)
    return round(curve[last_over + 1][0], 3) if last_over + 1 < len(curve) else None
# Each failover's own duration (start to the new leader assigned), from the
# coordinator's walship_failover_seconds histogram: the bucket holding the
# median and the 99th percentile. Beside the times above (from the kill),
# it tells detection and queueing from the failover's own work.
def own(f):
    with urllib.request.urlopen(f"{admin}metrics", timeout=5) as r:
        buckets = [(float(l.split('le="')[1].split('"')[0]), float(l.split()[-1]))
                   for l in r.read().decode().splitlines() if l.startswith("walship_failover_seconds_bucket")]
    total = buckets[-1][1] if buckets else 0
    return next((le for le, c in buckets if total and c >= f * total), None)
# The mean time of each step of a failover (walship_failover_step_seconds).
def steps():
    with urllib.request.urlopen(f"{admin}metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    def by_step(suffix):
        return {l.split('step="')[1].split('"')[0]: float(l.split()[-1])
                for l in lines if l.startswith(f"walship_failover_step_seconds_{suffix}{{")}
    sums, counts = by_step("sum"), by_step("count")
    return {step: round(sums[step] / counts[step], 4) for step in sums if counts.get(step)}
# When the count first rose (node 1 no longer alive to the coordinator)
# and first fell (the first new leader reporting): detection, then the
# first bulk's own work.
rose_s = next((round(t, 3) for t, m in curve if m > 0), None)
first_led_s = next((round(t, 3) for (t, m), (_, m0) in zip(curve[1:], curve) if rose_s is not None and t > rose_s and m < m0), None)
coord_cpu_s = round(cpu_s(coord) - coord_cpu_before, 2)
late_after = lateness()
if keep:
    with open(os.path.join(keep, f"curve-{n}.json"), "w") as f:
        json.dump({"kill_unix_s": killed_at, "curve": [(round(t, 3), m) for t, m in curve]}, f)
late = {str(node): dict(zip(("gaps_over_100ms", "gaps_over_200ms", "builds_over_64ms", "builds_over_256ms",
                             "sends_over_64ms", "sends_over_256ms", "starts_late_over_64ms"),
                            (int(a - b) for a, b in zip(late_after[node], late_before[node]))))
        for node in survivors}
print(json.dumps({"shards_led": len(led), "most_without_leader": peak, "survivors_late": late, "rose_s": rose_s, "first_led_s": first_led_s,
                  "coordinator_cpu_s": coord_cpu_s, "p50_s": at(0.5), "p99_s": at(0.99), "max_s": at(1.0),
                  "own_p50_s_at_most": own(0.5), "own_p99_s_at_most": own(0.99), "step_mean_s": steps()}))
PY
)
    history=null
    if [ -n "$history_pid" ]; then
      touch "$dir/history.stop"
      if wait "$history_pid"; then history=$(tail -1 "$dir/history.json"); else
        failed=1
        history=$(tail -1 "$dir/history.json" 2>/dev/null || true)
        [ -n "$history" ] || history=$(error_json "$dir/history.err")
      fi
    fi
  fi
  down=null
  if [ "$kill_node" = 1 ] && [ -n "$restart" ]; then
    sleep 5
    alive=""
    for p in $pids; do [ -e "/proc/$p" ] && [ "$p" != "$node1" ] && alive="$alive $p"; done
    # shellcheck disable=SC2086 # one argument per PID
    down="[$(idle_window 0 $alive)]"
  fi
  moved_back=null
  if [ "$rebalance" = 1 ] && [ -z "$restart" ]; then
    token=$(grep -o 'WALSHIP_TOKEN=[0-9a-f]*' "$log" | head -1 | cut -d= -f2)
    moved_back=$(python3 - "$admin" "$n" "$token" <<'PY'
import json, sys, time, urllib.request
admin, n, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def post(body):
    request = urllib.request.Request(f"{admin}v1/rebalance", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.load(r)
def leading():
    with urllib.request.urlopen(f"{admin}v1/cluster", timeout=5) as r:
        return json.load(r)["shards_leading"]
def failovers():
    with urllib.request.urlopen(f"{admin}metrics", timeout=5) as r:
        lines = [l for l in r.read().decode().splitlines() if l.startswith("walship_failovers_total{")]
    return sum(float(l.split()[-1]) for l in lines if 'reason="rebalance"' not in l)
# Node 1 follows every shard again, caught up, once the moves a preview
# plans stop growing (each follower counts once its report says so).
start, planned, same_since = time.monotonic(), -1, None
while time.monotonic() - start < 120:
    preview = post({"preview": True})
    now = len(preview["moves"])
    same_since = same_since if now == planned else time.monotonic()
    planned = now
    # (Or nothing to move: node 1 got its shards back as it restarted.)
    balanced = min(preview["leads_before"].values()) + 1 >= preview["fair_share"]
    if (planned > 0 or balanced) and time.monotonic() - same_since >= 2:
        break
    time.sleep(0.2)
other_before = failovers()
t0 = time.monotonic()
outcome = post({})
zero_since = None
while time.monotonic() - t0 < 120:
    missing = n - leading()
    t = time.monotonic() - t0
    zero_since = (zero_since if zero_since is not None else t) if missing == 0 else None
    if zero_since is not None and t - zero_since >= 2:
        break
    time.sleep(0.02)
print(json.dumps({"planned": len(outcome["moves"]), "moved": outcome["moved"], "took_ms": outcome["took_ms"],
                  "settled_s": round(zero_since, 3) if zero_since is not None else None,
                  "leads_before": outcome["leads_before"], "leads_after": outcome["leads_after"],
                  "other_failovers": int(failovers() - other_before)}))
PY
)
  fi
  echo "{\"shards\": $n, \"seconds_to_all_leaders\": $leaders_s, \"idle_s\": $idle_s, \"processes\": [$procs], \"failover\": $failover, \"history\": ${history:-null}, \"down\": $down, \"rebalance\": $moved_back}"
  kill "$dev" 2>/dev/null || true
  wait "$dev" 2>/dev/null || true
  [ -z "$keep" ] || cp "$log" "$keep/dev-$n.log"
  rm -rf "$dir"
  trap - EXIT
done
if [ "$throughput" != 0 ]; then
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  if "$walship" bench --paths quorum --sizes 100 --appenders 64 --shards "1,$throughput" \
      --duration "$throughput_s" --warmup 2 --wal-spare-bytes 0 --dir "$dir/bench" --json "$dir/bench.json" \
      >"$dir/bench.out" 2>&1; then
    python3 - "$dir/bench.json" "$throughput" <<'PY'
import json, sys
cells = {c["shards"]: c for c in json.load(open(sys.argv[1]))["cells"]}
one, many = cells[1], cells[int(sys.argv[2])]
print(json.dumps({"throughput": {
    "path": "rf3-quorum", "record_bytes": 100, "appenders": 64, "shards": many["shards"],
    "one_shard_records_per_s": round(one["records_per_s"]), "many_shards_records_per_s": round(many["records_per_s"]),
    "ratio": round(many["vs_one_shard"], 3),
    "server_cpu_us_per_record": {"one_shard": one.get("server_cpu_us_per_record"), "many_shards": many.get("server_cpu_us_per_record")},
    "p50_us": {"one_shard": round(one["p50_us"]), "many_shards": round(many["p50_us"])}}}))
PY
  else
    echo "{\"throughput\": $(error_json "$dir/bench.out")}"
    failed=1
  fi
  rm -rf "$dir"
  trap - EXIT
fi
exit "$failed"
