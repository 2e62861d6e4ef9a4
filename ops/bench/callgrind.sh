#!/usr/bin/env bash
# Instructions a single walship node executes per acknowledged append, by
# crate, counted by valgrind's callgrind (a CPU simulator: it needs no
# hardware counters, which this kind of virtual machine does not expose).
#
# One node (shard 1, LOCAL durability, no coordinator) runs under
# callgrind; a native `walship append` drives it. Three windows are
# counted, each from zeroed counters:
#   idle    nothing sent, for --idle-s seconds (the node's own timers)
#   unary   --count records, one unary Log.Append per record, one at a time
#   stream  --count records, one record per AppendStream message, one at a
#           time (the producer with --batch 1 --in-flight 1)
# The per-append figure takes the idle window's instructions per second
# off each append window, for its length.
#
#   ops/bench/callgrind.sh [--walship BIN] [--count N] [--size B] [--idle-s S] [--out DIR]
#
# Prints a table; DIR keeps the callgrind dumps for callgrind_annotate.
set -euo pipefail

walship=target/release/walship
count=2000
size=100
idle_s=5
out=
while [ $# -gt 0 ]; do
    case "$1" in
        --walship) walship=$2; shift 2 ;;
        --count) count=$2; shift 2 ;;
        --size) size=$2; shift 2 ;;
        --idle-s) idle_s=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
command -v callgrind_control >/dev/null || { echo "callgrind_control is not installed (comes with valgrind)" >&2; exit 1; }
[ -x "$walship" ] || { echo "no walship binary at $walship (cargo build --release -p walship, or --walship)" >&2; exit 1; }
work=$(mktemp -d)
out=${out:-$work/out}
mkdir -p "$out"
node_pid=
cleanup() {
    if [ -n "$node_pid" ]; then kill "$node_pid" 2>/dev/null || true; wait "$node_pid" 2>/dev/null || true; fi
    # The dumps stay (in --out, or in the work dir when none was given).
    case "$out" in
        "$work"/*) rm -rf "$work/data" ;;
        *) rm -rf "$work" ;;
    esac
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
grpc=127.0.0.1:$(free_port)
admin=127.0.0.1:$(free_port)
WALSHIP_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.%p" \
    "$walship" node --node-id 1 --grpc "$grpc" --admin "$admin" --shards 1-1 \
    --data-dir "$work/data" --wal-spare-bytes 0 >"$work/node.out" 2>"$work/node.err" &
node_pid=$!
for _ in $(seq 1 600); do
    grep -q listening "$work/node.out" 2>/dev/null && break
    kill -0 "$node_pid" 2>/dev/null || { cat "$work/node.err" >&2; echo "the node did not start" >&2; exit 1; }
    sleep 0.5
done
grep -q listening "$work/node.out" || { echo "the node did not start within 300 s" >&2; exit 1; }
# The first append pays for lazy set-up (the shard's first chunk, the
# connection's buffers): outside the counted windows.
"$walship" append --server "$grpc" --shard 1 --durability local --count 50 --size "$size" --batch 1 --no-producer >/dev/null

# Counts one window: zero, run, dump; prints "<instructions> <seconds>".
# callgrind_control talks to the node through vgdb, one command at a time.
dumps=0
window() {
    local name=$1; shift
    callgrind_control -z "$node_pid" >/dev/null 2>&1
    local t0 t1
    t0=$(date +%s.%N)
    "$@" >/dev/null
    t1=$(date +%s.%N)
    callgrind_control -d "$name" "$node_pid" >/dev/null 2>&1
    dumps=$((dumps + 1))
    local dump="$out/callgrind.$node_pid.$dumps"
    for _ in $(seq 1 600); do
        [ -s "$dump" ] && grep -q '^totals:' "$dump" && break
        sleep 0.1
    done
    mv "$dump" "$out/$name.callgrind"
    echo "$(awk '/^totals:/ {print $2}' "$out/$name.callgrind") $(awk -v a="$t1" -v b="$t0" 'BEGIN { print a - b }')"
}

window idle sleep "$idle_s" >"$work/idle"
window unary "$walship" append --server "$grpc" --shard 1 --durability local \
    --count "$count" --size "$size" --batch 1 --no-producer >"$work/unary"
window stream "$walship" append --server "$grpc" --shard 1 --durability local \
    --count "$count" --size "$size" --batch 1 --in-flight 1 >"$work/stream"
read -r idle_ir idle_t <"$work/idle"
read -r unary_ir unary_t <"$work/unary"
read -r stream_ir stream_t <"$work/stream"

python3 - "$out" "$count" "$idle_ir" "$idle_t" "$unary_ir" "$unary_t" "$stream_ir" "$stream_t" <<'EOF'
import re, subprocess, sys
out, count = sys.argv[1], int(sys.argv[2])
idle_ir, idle_t, unary_ir, unary_t, stream_ir, stream_t = map(float, sys.argv[3:])
idle_rate = idle_ir / idle_t

# Self cost by crate, read from the dump itself: the cost lines of each
# function, without the inclusive cost that follows each `calls=` line
# (callgrind_annotate adds those back for Rust's inlined frames). A
# function is named by its first path segment; libc's by its library.
def by_crate(name):
    names, crates = {}, {}
    fn, obj, skip = "", "", False
    objs = {}
    def named(table, rest):
        m = re.match(r"\((\d+)\)(?: (.*))?", rest)
        if not m:
            return rest
        if m.group(2) is not None:
            table[m.group(1)] = m.group(2)
        return table.get(m.group(1), "?")
    with open(f"{out}/{name}.callgrind") as f:
        for line in f:
            if line.startswith("ob="):
                obj = named(objs, line[3:].strip())
            elif line.startswith("fn="):
                fn = named(names, line[3:].strip())
            elif line.startswith(("cfn=", "cob=")):
                named(names if line[1] == "f" else objs, line[4:].strip())
            elif line.startswith("calls="):
                skip = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if skip:
                    skip = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    f_ = fn.lstrip("<&")
                    if "libc.so" in obj or "ld-linux" in obj:
                        crate = "libc (malloc, memcpy, syscalls)"
                    elif "::" in f_:
                        crate = f_.split("::")[0].split(" as ")[0].split("<")[0]
                    else:
                        crate = "other"
                    crates[crate] = crates.get(crate, 0) + int(parts[1])
    return crates

print(f"idle: {idle_rate:,.0f} instructions/s over {idle_t:.1f} s")
rows = {}
for name, ir, t in (("unary", unary_ir, unary_t), ("stream", stream_ir, stream_t)):
    net = ir - idle_rate * t
    rows[name] = (net / count, by_crate(name), ir)
    print(f"{name}: {count} appends in {t:.1f} s under callgrind: {ir:,.0f} instructions, "
          f"{net / count:,.0f} per append after the idle rate")
crates = sorted(set(rows["unary"][1]) | set(rows["stream"][1]),
                key=lambda c: -(rows["unary"][1].get(c, 0) + rows["stream"][1].get(c, 0)))
print()
print("| crate (self cost, idle included) | unary instr/append | stream instr/append |")
print("|---|---:|---:|")
for c in crates[:14]:
    print(f"| {c} | {rows['unary'][1].get(c, 0) / count:,.0f} | {rows['stream'][1].get(c, 0) / count:,.0f} |")
print(f"| **all (after idle)** | **{rows['unary'][0]:,.0f}** | **{rows['stream'][0]:,.0f}** |")
EOF
echo "callgrind dumps: $out (callgrind_annotate $out/unary.callgrind)"
