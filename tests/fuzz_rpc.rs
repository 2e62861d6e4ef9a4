//! Hostile and careless callers, at random: every gRPC method of a live
//! cluster (three nodes and a coordinator, real processes) gets valid
//! requests mutated at random, seeded so a failure replays: half of them
//! field by field, so that they still decode with values no client would
//! send (numbers set to 0, 2^32, 2^64 - 1..., nested messages changed the
//! same way, bytes emptied or replaced, fields repeated): that is what
//! reaches the services; the other half byte by byte (bits flipped, bytes
//! set, cut short, padded, parts repeated, varints made huge), which mostly
//! exercises the decoders. No process may die or panic, no answer may be
//! `INTERNAL` or `UNKNOWN` (what a handler's panic looks like on the wire),
//! and every process must still answer afterwards. The counts of answers
//! per method and code are printed.
//!
//! The drills' destructive methods (`Crash`, `Pause`, `DamageRecord`,
//! `Partition`, `Wipe`) are left out: test nodes run with
//! `--allow-crash-drills`, so a valid request makes them do just that.
//!
//! `WALSHIP_FUZZ_SEED` and `WALSHIP_FUZZ_CALLS` replay a seed or run longer.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::Code;
use tonic::transport::{Channel, Endpoint};
use walship_proto::dataplane::{FetchShuffleRequest, Hello, WorkerEnvelope, worker_envelope};
use walship_proto::log::{
    AppendRecord, AppendRequest, AppendStreamRequest, AssignManyRequest, AssignRequest, Durability, EpochEndRequest,
    FenceManyRequest, FenceRequest, PositionRequest, Producer, ReadRequest, TailRequest,
};
use walship_proto::replication::{
    HeartbeatBatchRequest, HeartbeatRequest, NodeKeepaliveRequest, QuietShard, ShipBatch, ShipSegmentRequest,
    StreamRequest, WalSegmentId,
};
use walship_wal::{Frame, RecordFields, Segment};

use common::{Cluster, ClusterSpec, http_get};

const SEED: u64 = 0x5eed_f022;
const CALLS: usize = 1_200;
/// Calls in flight at once.
const WIDTH: usize = 16;
/// A stream that waits for more (a tail, a catch-up, a task stream) is
/// given up after this: its first answer is all the test reads.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Where a method is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    Node,
    Coordinator,
}

/// A method, whether it streams, where it is served, and a valid request.
struct Seed {
    path: &'static str,
    streaming: bool,
    at: At,
    body: Vec<u8>,
}

fn seed(path: &'static str, streaming: bool, at: At, message: impl Message) -> Seed {
    Seed { path, streaming, at, body: message.encode_to_vec() }
}

fn frames(first: u64, count: u64, epoch: u64) -> Vec<Frame> {
    (first..first + count)
        .map(|seqno| {
            Frame::encode(RecordFields {
                seqno,
                epoch,
                timestamp_us: 1_700_000_000_000_000 + seqno,
                key: b"fuzz",
                payload: format!("fuzz record {seqno}").as_bytes(),
            })
        })
        .collect()
}

fn ship(shard: u32, first: u64, epoch: u64) -> ShipSegmentRequest {
    let segment = Segment::encode(shard, frames(first, 3, epoch)).expect("a valid segment");
    ShipSegmentRequest {
        id: Some(WalSegmentId { region_id: 1, shard_id: shard, seqno: first }),
        payload: segment.encoded().clone(),
        event_count: 3,
        leader_last_seq: first + 2,
        stream_baseline: 0,
        epoch,
        leader_node_id: 1,
        commit_seqno: first,
        archived_seqno: 0,
        archiver_node_id: 0,
    }
}

fn heartbeat(shard: u32) -> HeartbeatRequest {
    HeartbeatRequest {
        shard_id: shard,
        node_id: 2,
        epoch: 1,
        last_seqno: 40,
        durable_seqno: 40,
        commit_seqno: 40,
        leader_node_id: 1,
        last_epoch: 1,
        replication_lag: [(3, 5)].into(),
        follower_silent_ms: [(3, 10)].into(),
        ..Default::default()
    }
}

/// A valid request of every method (but the drills').
fn seeds() -> Vec<Seed> {
    let records = vec![AppendRecord { key: Bytes::from_static(b"k"), payload: Bytes::from_static(b"fuzz payload") }];
    let append = AppendRequest {
        shard_id: 1,
        records,
        durability: Durability::Quorum as i32,
        producer: Some(Producer { id: 7, epoch: 1, sequence: 1 }),
        ..Default::default()
    };
    let assign = AssignRequest { shard_id: 2, epoch: 1, leader: 2, replicas: vec![1, 2, 3], ..Default::default() };
    vec![
        seed("/walship.v1.Log/Append", false, At::Node, append.clone()),
        seed(
            "/walship.v1.Log/AppendStream",
            true,
            At::Node,
            AppendStreamRequest { request_id: 1, append: Some(append) },
        ),
        seed(
            "/walship.v1.Log/Read",
            false,
            At::Node,
            ReadRequest { shard_id: 1, from_seqno: 1, to_seqno: 20, max_bytes: 4096, min_seqno: 1, last: 0 },
        ),
        seed("/walship.v1.Log/Tail", true, At::Node, TailRequest { shard_id: 1, from_seqno: 30 }),
        seed("/tidal.replication.v1.WalShipping/ShipSegment", false, At::Node, ship(1, 41, 1)),
        seed("/tidal.replication.v1.WalShipping/ShipSegments", true, At::Node, ship(2, 41, 1)),
        seed(
            "/tidal.replication.v1.WalShipping/ShipBatches",
            true,
            At::Node,
            ShipBatch { pushes: vec![ship(1, 41, 1), ship(3, 41, 1)] },
        ),
        seed(
            "/tidal.replication.v1.WalShipping/StreamSegments",
            true,
            At::Node,
            StreamRequest { shard_id: 1, from_seqno: 2, epoch: 1, follower_node_id: 2 },
        ),
        seed("/tidal.replication.v1.WalShipping/Heartbeat", false, At::Coordinator, heartbeat(1)),
        seed(
            "/tidal.replication.v1.WalShipping/HeartbeatBatch",
            true,
            At::Coordinator,
            HeartbeatBatchRequest { node_id: 2, shards: vec![heartbeat(1), heartbeat(2)], full: true },
        ),
        seed(
            "/tidal.replication.v1.WalShipping/NodeKeepalive",
            false,
            At::Node,
            NodeKeepaliveRequest {
                leader_node_id: 1,
                quiet: vec![QuietShard { shard_id: 1, epoch: 1, commit_seqno: 40 }],
                woke: vec![2],
                full: true,
            },
        ),
        seed("/walship.v1.Control/Fence", false, At::Node, FenceRequest { shard_id: 3, epoch: 1 }),
        seed("/walship.v1.Control/Assign", false, At::Node, assign.clone()),
        seed("/walship.v1.Control/Position", false, At::Node, PositionRequest { shard_id: 1 }),
        seed(
            "/walship.v1.Control/FenceMany",
            false,
            At::Node,
            FenceManyRequest {
                fences: vec![FenceRequest { shard_id: 3, epoch: 1 }, FenceRequest { shard_id: 4, epoch: 1 }],
            },
        ),
        seed("/walship.v1.Control/AssignMany", false, At::Node, AssignManyRequest { assigns: vec![assign] }),
        seed("/walship.v1.Control/EpochEnd", false, At::Node, EpochEndRequest { shard_id: 1, epoch: 1 }),
        seed(
            "/dataplane.v1.PeerExchange/FetchShuffle",
            true,
            At::Node,
            FetchShuffleRequest { query_id: "q".into(), key: "k".into(), token: "t".into(), offset: 0 },
        ),
        seed(
            "/dataplane.v1.DataPlane/Connect",
            true,
            At::Coordinator,
            WorkerEnvelope {
                msg: Some(worker_envelope::Msg::Hello(Hello {
                    worker_id: "node-9".into(),
                    build_sha: "fuzz".into(),
                    num_cpus: 2,
                    gomemlimit: 1 << 30,
                })),
            },
        ),
    ]
}

/// A varint of the largest u64.
const HUGE_VARINT: [u8; 10] = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];

/// A protobuf field as it lies in an encoded message: its key's bytes, its
/// wire type, and where its value lies.
struct Field {
    key: std::ops::Range<usize>,
    wire: u8,
    value: std::ops::Range<usize>,
}

fn varint(bytes: &[u8], at: usize) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, b) in bytes.get(at..)?.iter().take(10).enumerate() {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, at + i + 1));
        }
    }
    None
}

fn encode_varint(mut value: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return out;
        }
        out.push(byte | 0x80);
    }
}

/// The top-level fields of `bytes`, if it parses as a message.
fn fields(bytes: &[u8]) -> Option<Vec<Field>> {
    let mut fields = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let (key, value_at) = varint(bytes, at)?;
        let wire = (key & 7) as u8;
        let end = match wire {
            0 => varint(bytes, value_at)?.1,
            1 => value_at + 8,
            2 => {
                let (len, from) = varint(bytes, value_at)?;
                from.checked_add(usize::try_from(len).ok()?)?
            }
            5 => value_at + 4,
            _ => return None,
        };
        if end > bytes.len() || key >> 3 == 0 {
            return None;
        }
        fields.push(Field { key: at..value_at, wire, value: value_at..end });
        at = end;
    }
    Some(fields)
}

/// Values no client would send, and some it might.
fn interesting(rng: &mut StdRng) -> u64 {
    *[
        0,
        1,
        2,
        0x7f,
        0x80,
        u64::from(u32::MAX),
        u64::from(u32::MAX) + 1,
        i64::MAX as u64,
        u64::MAX - 1,
        u64::MAX,
        rng.r#gen(),
    ]
    .get(rng.gen_range(0..11))
    .unwrap()
}

/// `body` with one field changed so that it still decodes: a varint set to
/// an extreme value, a nested message changed the same way, a bytes or
/// string value emptied or replaced, or a field repeated (`depth` bounds
/// the nesting).
fn mutate_field(body: &[u8], rng: &mut StdRng, depth: u32) -> Vec<u8> {
    let Some(fields) = fields(body).filter(|f| !f.is_empty()) else { return body.to_vec() };
    let field = &fields[rng.gen_range(0..fields.len())];
    let mut out = body[..field.key.start].to_vec();
    let key = &body[field.key.clone()];
    match field.wire {
        0 => {
            out.extend(key);
            out.extend(encode_varint(interesting(rng)));
        }
        2 => {
            let (len, from) = varint(body, field.value.start).expect("parsed");
            let inner = &body[from..from + len as usize];
            let value = match rng.gen_range(0..4) {
                0 if depth > 0 && fields_of(inner) => mutate_field(inner, rng, depth - 1),
                1 => Vec::new(),
                2 => (0..rng.gen_range(1..64)).map(|_| rng.r#gen()).collect(),
                _ => [inner, inner].concat(),
            };
            out.extend(key);
            out.extend(encode_varint(value.len() as u64));
            out.extend(value);
        }
        _ => out.extend(&body[field.key.start..field.value.end]),
    }
    // Now and then the field once more (last one wins, or one more item).
    if rng.gen_bool(0.2) {
        out.extend(&body[field.key.start..field.value.end]);
    }
    out.extend(&body[field.value.end..]);
    out
}

fn fields_of(bytes: &[u8]) -> bool {
    fields(bytes).is_some_and(|f| !f.is_empty())
}

/// `body` mutated: half the time field by field, so that it still decodes
/// (one to three fields), else byte by byte (one to four mutations).
fn mutate(body: &[u8], rng: &mut StdRng) -> Vec<u8> {
    if rng.gen_bool(0.5) {
        let mut out = body.to_vec();
        for _ in 0..rng.gen_range(1..=3) {
            out = mutate_field(&out, rng, 3);
        }
        return out;
    }
    let mut out = body.to_vec();
    for _ in 0..rng.gen_range(1..=4) {
        let at = if out.is_empty() { 0 } else { rng.gen_range(0..out.len()) };
        match rng.gen_range(0..7) {
            0 if !out.is_empty() => out[at] ^= 1 << rng.gen_range(0..8),
            1 if !out.is_empty() => out[at] = rng.r#gen(),
            2 => out.truncate(at),
            3 => {
                let junk: Vec<u8> = (0..rng.gen_range(1..=8)).map(|_| rng.r#gen()).collect();
                out.splice(at..at, junk);
            }
            4 if !out.is_empty() => {
                let end = rng.gen_range(at..=out.len().min(at + 32));
                let part = out[at..end].to_vec();
                out.extend(part);
            }
            // A varint field's value replaced by the largest u64: find a
            // varint key (wire type 0) and overwrite what follows it.
            5 => {
                if let Some(key) = (at..out.len()).find(|&i| out[i] & 0x07 == 0 && out[i] < 0x80 && out[i] > 0x07) {
                    let end = (key + 1..out.len()).find(|&i| out[i] < 0x80).map_or(out.len(), |i| i + 1);
                    out.splice(key + 1..end, HUGE_VARINT);
                }
            }
            _ => {
                // A length-delimited field's length made huge.
                if let Some(key) = (at..out.len()).find(|&i| out[i] & 0x07 == 2 && out[i] < 0x80)
                    && key + 1 < out.len()
                {
                    out[key + 1] = 0xff;
                    out.insert(key + 2, 0x7f);
                }
            }
        }
    }
    out
}

async fn channel(addr: &str) -> Channel {
    Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.expect("connect")
}

/// The call's code: `Ok` as `Code::Ok` (a stream that ended well without
/// an answer too), a call given up as `None`.
async fn call(channel: Channel, seed: &Seed, body: Vec<u8>) -> Option<Code> {
    let answer = if seed.streaming {
        tokio::time::timeout(CALL_TIMEOUT, common::raw_stream_first(channel, seed.path, &body))
            .await
            .map(|r| r.map(drop))
    } else {
        tokio::time::timeout(CALL_TIMEOUT, common::raw_unary(channel, seed.path, &body)).await.map(|r| r.map(drop))
    };
    answer.ok().map(|r| r.map_or_else(|s| s.code(), |()| Code::Ok))
}

fn log_panics(path: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().filter(|l| l.contains("panicked at")).map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_requests_to_every_method_crash_and_panic_nothing() {
    let seed_value = std::env::var("WALSHIP_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(SEED);
    let calls = std::env::var("WALSHIP_FUZZ_CALLS").ok().and_then(|s| s.parse().ok()).unwrap_or(CALLS);
    eprintln!("fuzz seed {seed_value}, {calls} calls (WALSHIP_FUZZ_SEED, WALSHIP_FUZZ_CALLS)");
    let dir = tempfile::tempdir().unwrap();
    let logs: Vec<(u32, std::path::PathBuf)> = (1..=3).map(|n| (n, dir.path().join(format!("node-{n}.log")))).collect();
    let mut cluster = Cluster::launch(&ClusterSpec {
        coordinators: 1,
        shards: 4,
        stderr_logs: logs.clone(),
        ..ClusterSpec::default()
    });
    // Records to read, tail and catch up from.
    let mut log = cluster.node(1).client().await;
    for i in 0..40 {
        let request = AppendRequest {
            shard_id: 1,
            records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(format!("r{i}")) }],
            durability: Durability::Quorum as i32,
            ..Default::default()
        };
        let mut tries = 0;
        while let Err(status) = log.append(request.clone()).await {
            tries += 1;
            assert!(tries < 100, "append {i}: {status}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let seeds = seeds();
    let nodes: Vec<Channel> = futures::future::join_all(cluster.nodes.iter().map(|n| channel(&n.grpc))).await;
    let coordinator = channel(&cluster.coordinator(1).grpc).await;
    let mut rng = StdRng::seed_from_u64(seed_value);
    let mut answers: BTreeMap<(&'static str, String), usize> = BTreeMap::new();
    let mut bad = Vec::new();
    let mut made = 0;
    while made < calls {
        let mut batch = Vec::new();
        for _ in 0..WIDTH.min(calls - made) {
            let seed = &seeds[rng.gen_range(0..seeds.len())];
            let body = mutate(&seed.body, &mut rng);
            let target = match seed.at {
                At::Node => nodes[rng.gen_range(0..nodes.len())].clone(),
                At::Coordinator => coordinator.clone(),
            };
            batch.push(async move { (seed.path, body.clone(), call(target, seed, body).await) });
            made += 1;
        }
        for (path, body, code) in futures::future::join_all(batch).await {
            let name = code.map_or("no answer in time".to_owned(), |c| format!("{c:?}"));
            if matches!(code, Some(Code::Internal | Code::Unknown)) {
                bad.push(format!("{path} {name} for {body:02x?}"));
            }
            *answers.entry((path, name)).or_default() += 1;
        }
    }
    for ((path, code), n) in &answers {
        eprintln!("{n:5} {path} {code}");
    }
    assert!(bad.is_empty(), "answers a panic or a server fault gives (seed {seed_value}):\n{}", bad.join("\n"));
    for node in &mut cluster.nodes {
        assert!(node.child.try_wait().unwrap().is_none(), "node {} died (seed {seed_value})", node.node_id);
    }
    assert!(cluster.coordinators[0].child.try_wait().unwrap().is_none(), "the coordinator died (seed {seed_value})");
    for (node, path) in &logs {
        let panics = log_panics(path);
        assert!(panics.is_empty(), "node {node} panicked (seed {seed_value}):\n{}", panics.join("\n"));
    }
    // Every process still answers: a read on every node, the coordinator's
    // cluster view.
    for node in cluster.nodes.iter() {
        let mut client = walship_proto::log::log_client::LogClient::new(channel(&node.grpc).await);
        let read = client.read(ReadRequest { shard_id: 1, from_seqno: 1, to_seqno: 1, ..Default::default() }).await;
        assert!(
            read.as_ref()
                .map_or_else(|s| !matches!(s.code(), Code::Internal | Code::Unknown | Code::Unavailable), |_| true),
            "node {} after the fuzz: {read:?}",
            node.node_id
        );
    }
    let (status, _) = http_get(&format!("{}/v1/cluster", cluster.coordinator(1).admin)).await;
    assert_eq!(status, 200, "the coordinator after the fuzz");
}
