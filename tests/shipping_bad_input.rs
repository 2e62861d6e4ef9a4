//! Black-box refusals on the node-to-node `tidal.replication.v1.WalShipping`
//! service of a real 3-node cluster: every bad `ShipSegment`,
//! `StreamSegments` and `Heartbeat` comes back with the exact gRPC status the
//! refusal table in `shipping/src/server.rs` names, with a message that says
//! what was wrong (and, where the contract says so, response metadata the
//! sender acts on), and changes nothing: the follower's positions in
//! `/v1/status` and the records it serves are identical before and after.
//! A byte-identical re-send of what the follower already holds is accepted
//! idempotently. Refusals are counted in `walship_ship_refused_total` on the
//! node that refused them, and replication still works afterwards.

mod common;

use common::{assert_refused, numbers_in};

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use common::{Cluster, http_get, wait_until};
use serde_json::Value;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest, Record};
use walship_proto::replication::wal_shipping_client::WalShippingClient;
use walship_proto::replication::{
    HeartbeatRequest, ShipSegmentRequest, ShipSegmentResponse, StreamRequest, WalSegmentId,
};
use walship_wal::segment::SEGMENT_HEADER_LEN;
use walship_wal::{Frame, RecordFields, Segment};

const MIB: usize = 1 << 20;
/// The shard under test: led by node 1, followed by nodes 2 and 3.
const SHARD: u32 = 1;
/// Shard 2 is led by node 2 (and followed by nodes 1 and 3).
const OTHER_SHARD: u32 = 2;
const LEADER: u32 = 1;
const FOLLOWER: u32 = 2;
/// Epoch of every shard in the cluster config (epochs start at 1).
const EPOCH: u64 = 1;
/// Records appended before the refusals.
const RECORDS: u64 = 20;
/// The peers' message limit (`MAX_PEER_MESSAGE_BYTES`, 64 MiB).
const MAX_PEER_MESSAGE_BYTES: usize = 64 * MIB;
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
const EPOCH_METADATA_KEY: &str = "walship-epoch";
const APPLIED_METADATA_KEY: &str = "walship-applied-seqno";

/// Sends `body` verbatim as the protobuf message of a unary WalShipping RPC.
async fn raw_unary(channel: Channel, path: &'static str, body: &[u8]) -> Result<Bytes, tonic::Status> {
    common::raw_unary(channel, path, body).await
}

// ---------------------------------------------------------------------------
// Segments and requests.
// ---------------------------------------------------------------------------

/// `count` valid frames from `first`, in the cluster's epoch: records that no
/// leader ever wrote, so applying any of them would show in the follower.
fn fake_frames(first: u64, count: u64) -> Vec<Frame> {
    (first..first + count)
        .map(|seqno| {
            let payload = format!("forged record {seqno}");
            Frame::encode(RecordFields {
                seqno,
                epoch: EPOCH,
                timestamp_us: 1_700_000_000_000_000 + seqno,
                key: b"forged",
                payload: payload.as_bytes(),
            })
        })
        .collect()
}

fn fake_segment(shard: u32, first: u64, count: u64) -> Segment {
    Segment::encode(shard, fake_frames(first, count)).expect("valid segment")
}

/// A `ShipSegmentRequest` for shard 1 carrying `segment`, with the envelope
/// exactly as the leader (node 1, region 1) fills it in.
fn ship_of(segment: &Segment, commit_seqno: u64) -> ShipSegmentRequest {
    ShipSegmentRequest {
        id: Some(WalSegmentId { region_id: LEADER, shard_id: SHARD, seqno: segment.first_seqno() }),
        payload: segment.encoded().clone(),
        event_count: segment.frames().len() as u64,
        leader_last_seq: segment.last_seqno(),
        stream_baseline: 0,
        epoch: EPOCH,
        leader_node_id: LEADER,
        commit_seqno,
        archived_seqno: 0,
        archiver_node_id: 0,
    }
}

fn with_id(mut request: ShipSegmentRequest, shard_id: u32, seqno: u64) -> ShipSegmentRequest {
    let id = request.id.get_or_insert_with(Default::default);
    id.shard_id = shard_id;
    id.seqno = seqno;
    request
}

/// One WalShipping request of any kind, for the case table.
#[derive(Debug, Clone)]
enum Call {
    Ship(ShipSegmentRequest),
    /// The same request as the only message of a `ShipSegments` stream.
    ShipStream(ShipSegmentRequest),
    Stream(StreamRequest),
    Heartbeat(Box<HeartbeatRequest>),
    /// Raw bytes to a unary RPC path.
    Raw(&'static str, Vec<u8>),
    /// Raw bytes as the one message of a streaming RPC path.
    RawStream(&'static str, Vec<u8>),
}

impl Call {
    /// Runs the call; `Ok` means the server accepted it (a test failure for
    /// every case in the table).
    async fn run(self, channel: Channel) -> Result<String, tonic::Status> {
        let mut client = shipping_client(channel.clone());
        let call = async move {
            match self {
                Call::Ship(r) => client.ship_segment(r).await.map(|r| format!("{:?}", r.into_inner())),
                Call::ShipStream(r) => {
                    let mut answers = client.ship_segments(tokio_stream::iter(vec![r])).await?.into_inner();
                    match answers.message().await? {
                        Some(answer) => Ok(format!("{answer:?}")),
                        None => Ok("a stream that ended without an answer".to_string()),
                    }
                }
                // A refused stream fails the call itself, before any stream exists.
                Call::Stream(r) => client.stream_segments(r).await.map(|_| "a segment stream".to_string()),
                Call::Heartbeat(r) => client.heartbeat(*r).await.map(|r| format!("{:?}", r.into_inner())),
                Call::Raw(path, body) => raw_unary(channel, path, &body).await.map(|b| format!("{b:?}")),
                Call::RawStream(path, body) => {
                    common::raw_stream_first(channel, path, &body).await.map(|b| format!("{b:?}"))
                }
            }
        };
        tokio::time::timeout(CALL_TIMEOUT, call).await.expect("WalShipping call timed out")
    }
}

/// A refusal the server must give.
struct Case {
    name: &'static str,
    /// The node the request is sent to.
    node: u32,
    call: Call,
    code: Code,
    /// Words the message must contain (case-insensitive).
    words: Vec<String>,
    /// Numbers the message must name (as whole numbers, not substrings).
    numbers: Vec<u64>,
    /// Response metadata the refusal must carry.
    metadata: Vec<(&'static str, String)>,
    /// The `walship_ship_refused_total` reason it is counted under, on `node`.
    reason: Option<&'static str>,
}

fn words(list: &[&str]) -> Vec<String> {
    list.iter().map(|w| w.to_string()).collect()
}

// ---------------------------------------------------------------------------
// Observing a node.
// ---------------------------------------------------------------------------

async fn connect(grpc: &str) -> Channel {
    Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap()
}

fn shipping_client(channel: Channel) -> WalShippingClient<common::Member> {
    WalShippingClient::new(common::as_member(channel))
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(64 * MIB)
}

/// What must not change of a replica: (shard_id, role, leader, epoch,
/// first_seqno, last_seqno, durable_seqno), sorted by shard.
type Positions = Vec<(u64, String, u64, u64, u64, u64, u64)>;

async fn positions(cluster: &mut Cluster, node: u32) -> Positions {
    let status = cluster.status(node).await.unwrap_or_else(|| panic!("node {node}: /v1/status unavailable"));
    let shards = status["shards"].as_array().unwrap_or_else(|| panic!("node {node}: no shards array: {status}"));
    let number = |s: &Value, field: &str| s[field].as_u64().unwrap_or_else(|| panic!("{field} is not a number: {s}"));
    let mut out: Positions = shards
        .iter()
        .map(|s| {
            (
                number(s, "shard_id"),
                s["role"].as_str().unwrap_or_default().to_string(),
                number(s, "leader"),
                number(s, "epoch"),
                number(s, "first_seqno"),
                number(s, "last_seqno"),
                number(s, "durable_seqno"),
            )
        })
        .collect();
    out.sort();
    out
}

/// A field of one shard's `/v1/status` entry on the node at `admin`, if it answers.
async fn shard_field(admin: String, shard: u32, field: &'static str) -> Option<u64> {
    let (code, body) =
        tokio::time::timeout(Duration::from_secs(2), http_get(&format!("{admin}/v1/status"))).await.ok()?;
    if code != 200 {
        return None;
    }
    let status: Value = serde_json::from_str(&body).ok()?;
    status["shards"].as_array()?.iter().find(|s| s["shard_id"].as_u64() == Some(shard as u64))?[field].as_u64()
}

/// Every record of `shard` in `[from, to]`, read through `client`.
async fn read_range(
    client: &mut LogClient<Channel>,
    shard: u32,
    from: u64,
    to: u64,
) -> Result<Vec<Record>, tonic::Status> {
    let mut records = Vec::new();
    let mut next = from;
    while next <= to {
        let response = client
            .read(ReadRequest { shard_id: shard, from_seqno: next, to_seqno: to, max_bytes: 0, ..Default::default() })
            .await?
            .into_inner();
        assert!(!response.records.is_empty(), "shard {shard}: empty read at {next} (to {to})");
        next = response.next_seqno;
        records.extend(response.records);
    }
    Ok(records)
}

/// `walship_ship_refused_total` by reason.
async fn refused_counts(admin: &str) -> HashMap<String, f64> {
    let (code, body) = http_get(&format!("{admin}/metrics")).await;
    assert_eq!(code, 200, "/metrics");
    let mut counts = HashMap::new();
    for line in body.lines().filter(|l| l.starts_with("walship_ship_refused_total{")) {
        let (labels, value) = line.rsplit_once(' ').expect("sample value");
        let reason = labels
            .split(['{', ',', '}'])
            .find_map(|kv| kv.strip_prefix("reason=\""))
            .map(|v| v.trim_end_matches('"').to_string())
            .unwrap_or_else(|| panic!("no reason label in {line:?}"));
        counts.insert(reason, value.parse::<f64>().expect("sample value"));
    }
    counts
}

// ---------------------------------------------------------------------------
// The test.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_shipping_requests_are_refused_precisely_and_change_nothing() {
    let mut cluster = Cluster::start(3, 2, "");
    let leader_grpc = cluster.node(LEADER).grpc.clone();
    let follower_grpc = cluster.node(FOLLOWER).grpc.clone();
    let leader_admin = cluster.node(LEADER).admin.clone();
    let follower_admin = cluster.node(FOLLOWER).admin.clone();
    let mut leader_log = cluster.node(LEADER).client().await;
    let mut follower_log = cluster.node(FOLLOWER).client().await;

    // Seed shard 1 through its leader, at QUORUM.
    let records: Vec<AppendRecord> = (1..=RECORDS)
        .map(|i| AppendRecord { key: Bytes::from(format!("key-{i}")), payload: Bytes::from(format!("payload-{i}")) })
        .collect();
    let r = leader_log
        .append(AppendRequest { shard_id: SHARD, records, durability: Durability::Quorum as i32, ..Default::default() })
        .await
        .expect("seed append")
        .into_inner();
    assert_eq!((r.first_seqno, r.last_seqno, r.epoch), (1, RECORDS, EPOCH), "seed append");
    let d = r.last_seqno;

    wait_until(&format!("node {FOLLOWER} has shard {SHARD} durable at {d}"), Duration::from_secs(20), || {
        let admin = follower_admin.clone();
        async move { shard_field(admin, SHARD, "durable_seqno").await == Some(d) }
    })
    .await;
    // The follower serves reads up to the commit position its leader told it.
    wait_until(&format!("node {FOLLOWER} serves shard {SHARD} reads through {d}"), Duration::from_secs(20), || {
        let mut client = follower_log.clone();
        async move { read_range(&mut client, SHARD, 1, d).await.is_ok() }
    })
    .await;

    let positions_before = positions(&mut cluster, FOLLOWER).await;
    let shard1_before =
        positions_before.iter().find(|p| p.0 == SHARD as u64).expect("shard 1 in the follower's status").clone();
    assert_eq!(
        shard1_before,
        (SHARD as u64, "follower".to_string(), LEADER as u64, EPOCH, 1, d, d),
        "follower's shard 1 before the refusals: {positions_before:?}"
    );
    assert!(
        positions_before.iter().any(|p| p.0 == OTHER_SHARD as u64 && p.1 == "leader"),
        "node {FOLLOWER} leads shard {OTHER_SHARD}: {positions_before:?}"
    );
    let records_before = read_range(&mut follower_log, SHARD, 1, d).await.expect("follower read");
    assert_eq!(records_before.len() as u64, d);
    for (i, record) in records_before.iter().enumerate() {
        assert_eq!(record.seqno, i as u64 + 1, "contiguous seqnos");
        assert_eq!(record.payload, Bytes::from(format!("payload-{}", i + 1)), "record {}", record.seqno);
    }
    let leader_counts_before = refused_counts(&leader_admin).await;
    let follower_counts_before = refused_counts(&follower_admin).await;

    // Segments that no leader wrote: the next three seqnos, and one past a gap.
    let next = fake_segment(SHARD, d + 1, 3);
    let good = ship_of(&next, d);
    let gapped = fake_segment(SHARD, d + 2, 1);
    let other_shard = fake_segment(OTHER_SHARD, d + 1, 3);
    let flip = |at: usize| {
        let mut bytes = next.encoded().to_vec();
        bytes[at] ^= 0x40;
        Bytes::from(bytes)
    };
    let first_frame = next.frames()[0].len();
    let len = next.encoded().len();

    let mut cases = vec![
        // 1. Fencing: an epoch older than the one already seen.
        Case {
            name: "valid segment at D+1 with epoch 0 (older than epoch 1)",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { epoch: 0, ..good.clone() }),
            code: Code::FailedPrecondition,
            words: words(&["epoch", "older"]),
            numbers: vec![0, EPOCH],
            metadata: vec![(EPOCH_METADATA_KEY, EPOCH.to_string())],
            reason: Some("stale_epoch"),
        },
        // 2. A gap: the follower holds D, the segment starts at D+2.
        Case {
            name: "valid segment starting at D+2 (gap)",
            node: FOLLOWER,
            call: Call::Ship(ship_of(&gapped, d)),
            code: Code::OutOfRange,
            words: words(&["expects"]),
            numbers: vec![d + 2, d + 1],
            metadata: vec![(APPLIED_METADATA_KEY, d.to_string())],
            reason: Some("gap"),
        },
        // 3. Unknown shard.
        Case {
            name: "id.shard_id 99 (not hosted)",
            node: FOLLOWER,
            call: Call::Ship(with_id(good.clone(), 99, d + 1)),
            code: Code::NotFound,
            words: words(&["shard 99", "not hosted"]),
            numbers: vec![99, FOLLOWER as u64],
            metadata: vec![],
            reason: Some("unknown_shard"),
        },
        // 4. The envelope does not match the segment it carries.
        Case {
            name: "id.shard_id 1 but the segment encodes shard 2",
            node: FOLLOWER,
            call: Call::Ship(ship_of(&other_shard, d)),
            code: Code::InvalidArgument,
            words: words(&["shard_id", "shard 2"]),
            numbers: vec![1, 2],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "id.seqno D, the segment starts at D+1",
            node: FOLLOWER,
            call: Call::Ship(with_id(good.clone(), SHARD, d)),
            code: Code::InvalidArgument,
            words: words(&["id.seqno", "starts at"]),
            numbers: vec![d, d + 1],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "id.seqno 0, the segment starts at D+1",
            node: FOLLOWER,
            call: Call::Ship(with_id(good.clone(), SHARD, 0)),
            code: Code::InvalidArgument,
            words: words(&["id.seqno", "starts at"]),
            numbers: vec![0, d + 1],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "event_count 2 for a 3-record segment",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { event_count: 2, ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["event_count"]),
            numbers: vec![2, 3],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "event_count 4 for a 3-record segment",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { event_count: 4, ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["event_count"]),
            numbers: vec![4, 3],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "event_count 3 with an empty payload",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { payload: Bytes::new(), ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["event_count", "empty"]),
            numbers: vec![3],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "leader_last_seq D+2, before the segment's last seqno D+3",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { leader_last_seq: d + 2, ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["leader_last_seq"]),
            numbers: vec![d + 2, d + 3],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        // 5. Corrupt payloads.
        Case {
            name: "one byte flipped in the last record's payload",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { payload: flip(len - 1), ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["corrupt", "checksum"]),
            numbers: vec![SHARD as u64],
            metadata: vec![],
            reason: Some("corrupt"),
        },
        Case {
            name: "one byte flipped in the first record's seqno",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { payload: flip(SEGMENT_HEADER_LEN + 8), ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["corrupt", "checksum"]),
            numbers: vec![],
            metadata: vec![],
            reason: Some("corrupt"),
        },
        Case {
            name: "one byte flipped in the segment header's first_seqno",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { payload: flip(12), ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["corrupt"]),
            numbers: vec![],
            metadata: vec![],
            reason: Some("corrupt"),
        },
        Case {
            name: "payload truncated inside the last record",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { payload: next.encoded().slice(..len - 5), ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["corrupt", "truncated"]),
            numbers: vec![],
            metadata: vec![],
            reason: Some("corrupt"),
        },
        Case {
            name: "payload truncated after the first record",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest {
                payload: next.encoded().slice(..SEGMENT_HEADER_LEN + first_frame),
                ..good.clone()
            }),
            code: Code::InvalidArgument,
            words: words(&["corrupt", "truncated"]),
            numbers: vec![],
            metadata: vec![],
            reason: Some("corrupt"),
        },
        Case {
            name: "payload truncated inside the segment header",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { payload: next.encoded().slice(..16), ..good.clone() }),
            code: Code::InvalidArgument,
            words: words(&["corrupt", "truncated"]),
            numbers: vec![],
            metadata: vec![],
            reason: Some("corrupt"),
        },
        Case {
            name: "payload with trailing garbage",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest {
                payload: Bytes::from([next.encoded().as_ref(), b"junk"].concat()),
                ..good.clone()
            }),
            code: Code::InvalidArgument,
            words: words(&["corrupt", "trailing"]),
            numbers: vec![],
            metadata: vec![],
            reason: Some("corrupt"),
        },
        // 6. Not from the shard's leader.
        Case {
            name: "leader_node_id 3 (a follower of shard 1)",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { leader_node_id: 3, ..good.clone() }),
            code: Code::FailedPrecondition,
            words: words(&["leader is node 1"]),
            numbers: vec![3, LEADER as u64],
            metadata: vec![],
            reason: Some("wrong_leader"),
        },
        Case {
            name: "leader_node_id 0 (unset)",
            node: FOLLOWER,
            call: Call::Ship(ShipSegmentRequest { leader_node_id: 0, ..good.clone() }),
            code: Code::FailedPrecondition,
            words: words(&["leader is node 1"]),
            numbers: vec![0, LEADER as u64],
            metadata: vec![],
            reason: Some("wrong_leader"),
        },
        // 7. Sent to the leader itself.
        Case {
            name: "valid segment sent to the leader of shard 1",
            node: LEADER,
            call: Call::Ship(good.clone()),
            code: Code::FailedPrecondition,
            words: words(&["leader of shard 1", "not a follower"]),
            numbers: vec![LEADER as u64, SHARD as u64],
            metadata: vec![],
            reason: Some("not_follower"),
        },
        // 10. StreamSegments.
        Case {
            name: "StreamSegments to a follower of shard 1",
            node: FOLLOWER,
            call: Call::Stream(StreamRequest { shard_id: SHARD, from_seqno: 1, epoch: EPOCH, follower_node_id: 3 }),
            code: Code::FailedPrecondition,
            words: vec!["not the leader".into(), format!("the leader is {LEADER}@{leader_grpc}")],
            numbers: vec![FOLLOWER as u64, SHARD as u64],
            metadata: vec![],
            reason: Some("not_leader"),
        },
        Case {
            name: "StreamSegments to node 1 for shard 2 (led by node 2)",
            node: LEADER,
            call: Call::Stream(StreamRequest {
                shard_id: OTHER_SHARD,
                from_seqno: 1,
                epoch: EPOCH,
                follower_node_id: 3,
            }),
            code: Code::FailedPrecondition,
            words: vec!["not the leader".into(), format!("the leader is {FOLLOWER}@{follower_grpc}")],
            numbers: vec![LEADER as u64, OTHER_SHARD as u64],
            metadata: vec![],
            reason: Some("not_leader"),
        },
        Case {
            name: "StreamSegments from_seqno 0",
            node: LEADER,
            call: Call::Stream(StreamRequest { shard_id: SHARD, from_seqno: 0, epoch: EPOCH, follower_node_id: 2 }),
            code: Code::InvalidArgument,
            words: words(&["from_seqno"]),
            numbers: vec![1],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "StreamSegments from_seqno D+5 (past the leader's durable seqno)",
            node: LEADER,
            call: Call::Stream(StreamRequest { shard_id: SHARD, from_seqno: d + 5, epoch: EPOCH, follower_node_id: 2 }),
            code: Code::OutOfRange,
            words: words(&["from_seqno", "durable"]),
            numbers: vec![d + 5, d],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "StreamSegments of unknown shard 99",
            node: LEADER,
            call: Call::Stream(StreamRequest { shard_id: 99, from_seqno: 1, epoch: EPOCH, follower_node_id: 2 }),
            code: Code::NotFound,
            words: words(&["shard 99", "not hosted"]),
            numbers: vec![99, LEADER as u64],
            metadata: vec![],
            reason: Some("unknown_shard"),
        },
        Case {
            name: "StreamSegments from a requester that has seen epoch 5",
            node: LEADER,
            call: Call::Stream(StreamRequest { shard_id: SHARD, from_seqno: 1, epoch: 5, follower_node_id: 2 }),
            code: Code::FailedPrecondition,
            words: words(&["epoch"]),
            numbers: vec![5, EPOCH],
            metadata: vec![(EPOCH_METADATA_KEY, "5".into())],
            reason: Some("stale_epoch"),
        },
        // 11. Heartbeats from unknown nodes.
        Case {
            name: "Heartbeat with node_id 0 (only the seed's fields)",
            node: FOLLOWER,
            call: Call::Heartbeat(Box::new(HeartbeatRequest {
                shard_id: SHARD,
                region_id: 1,
                entity_count: 10,
                signal_throughput_eps: 2.5,
                disk_bytes: 4096,
                last_heartbeat_ns: 1,
                ..Default::default()
            })),
            code: Code::InvalidArgument,
            words: words(&["without node_id", "field 8", "reporting node"]),
            numbers: vec![8],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        Case {
            name: "Heartbeat with node_id 42",
            node: FOLLOWER,
            call: Call::Heartbeat(Box::new(HeartbeatRequest {
                shard_id: SHARD,
                node_id: 42,
                epoch: EPOCH,
                last_seqno: d,
                durable_seqno: d,
                commit_seqno: d,
                ..Default::default()
            })),
            code: Code::InvalidArgument,
            words: words(&["unknown node"]),
            numbers: vec![42],
            metadata: vec![],
            reason: Some("bad_request"),
        },
        // A known node's report of a shard neither it nor the receiver
        // holds: kept, every made-up shard id would grow the store.
        Case {
            name: "Heartbeat of shard 99 (not in the cluster)",
            node: FOLLOWER,
            call: Call::Heartbeat(Box::new(HeartbeatRequest {
                shard_id: 99,
                node_id: LEADER,
                epoch: EPOCH,
                ..Default::default()
            })),
            code: Code::NotFound,
            words: words(&["shard 99", "not hosted"]),
            numbers: vec![99, FOLLOWER as u64],
            metadata: vec![],
            reason: Some("unknown_shard"),
        },
    ];

    // 9. Malformed protobuf bodies, sent verbatim.
    let ship_path = "/tidal.replication.v1.WalShipping/ShipSegment";
    let garbage: Vec<(&'static str, &'static str, Vec<u8>)> = vec![
        ("ShipSegment: an unterminated varint tag", ship_path, vec![0xff, 0xff, 0xff]),
        // Field 2 (payload), length-delimited, claims 1000 bytes; 3 follow.
        ("ShipSegment: payload claiming 1000 bytes with 3 present", ship_path, vec![0x12, 0xe8, 0x07, 1, 2, 3]),
        ("ShipSegment: wire type 7, which does not exist", ship_path, vec![0x0f, 0x01]),
        ("ShipSegment: id (a message) sent as a varint", ship_path, vec![0x08, 0x01]),
        ("ShipSegment: event_count (a varint) sent length-delimited", ship_path, vec![0x1a, 0x01, 0x00]),
        ("ShipSegment: id whose bytes are an unterminated varint", ship_path, vec![0x0a, 0x02, 0xff, 0xff]),
        ("ShipSegment: field number 0", ship_path, vec![0x00, 0x01]),
        ("Heartbeat: an unterminated varint tag", "/tidal.replication.v1.WalShipping/Heartbeat", vec![0xff, 0xff]),
    ];
    // The ShipSegment garbage again, as a message of a ShipSegments stream.
    let streamed_garbage: Vec<_> =
        garbage.iter().filter(|(_, path, _)| *path == ship_path).map(|(name, _, body)| (*name, body.clone())).collect();
    assert!(streamed_garbage.len() >= 5);
    for (name, body) in streamed_garbage {
        cases.push(Case {
            name,
            node: FOLLOWER,
            call: Call::RawStream("/tidal.replication.v1.WalShipping/ShipSegments", body),
            code: Code::InvalidArgument,
            words: words(&["malformed"]),
            numbers: vec![],
            metadata: vec![],
            reason: None,
        });
    }
    for (name, path, body) in garbage {
        cases.push(Case {
            name,
            node: FOLLOWER,
            call: Call::Raw(path, body),
            code: Code::InvalidArgument,
            words: words(&["malformed"]),
            numbers: vec![],
            metadata: vec![],
            reason: None,
        });
    }
    // Control: the raw path reaches the service. An empty body decodes to the
    // default request (no id: shard 0), which is refused by shard.
    cases.push(Case {
        name: "ShipSegment: empty body (shard 0)",
        node: FOLLOWER,
        call: Call::Raw(ship_path, Vec::new()),
        code: Code::NotFound,
        words: words(&["shard 0"]),
        numbers: vec![0],
        metadata: vec![],
        reason: Some("unknown_shard"),
    });

    // Every ShipSegment refusal again over the streaming `ShipSegments`: the
    // same status, message, metadata and count, and nothing applied.
    let streamed: Vec<Case> = cases
        .iter()
        .filter_map(|case| match &case.call {
            Call::Ship(request) => Some(Case {
                name: case.name,
                node: case.node,
                call: Call::ShipStream(request.clone()),
                code: case.code,
                words: case.words.clone(),
                numbers: case.numbers.clone(),
                metadata: case.metadata.clone(),
                reason: case.reason,
            }),
            _ => None,
        })
        .collect();
    assert!(streamed.len() >= 10, "the stream gets the ShipSegment cases: {}", streamed.len());
    cases.extend(streamed);

    let leader_channel = connect(&leader_grpc).await;
    let follower_channel = connect(&follower_grpc).await;
    let mut expected: HashMap<(u32, &'static str), f64> = HashMap::new();
    for case in cases {
        let channel = if case.node == LEADER { leader_channel.clone() } else { follower_channel.clone() };
        let over =
            if matches!(case.call, Call::ShipStream(_) | Call::RawStream(..)) { ", over ShipSegments" } else { "" };
        let what = format!("{}{over} (node {})", case.name, case.node);
        let result = case.call.run(channel).await;
        let status = assert_refused(&what, result, case.code, &case.words, &case.numbers);
        for (key, value) in &case.metadata {
            let got = status.metadata().get(*key).and_then(|v| v.to_str().ok());
            assert_eq!(
                got,
                Some(value.as_str()),
                "{what}: response metadata {key} (metadata: {:?})",
                status.metadata()
            );
        }
        if let Some(reason) = case.reason {
            *expected.entry((case.node, reason)).or_default() += 1.0;
        }
    }

    // 8. Over the peers' 64 MiB message limit: refused by the gRPC layer.
    let oversize = ShipSegmentRequest { payload: Bytes::from(vec![0x5a; 65 * MIB]), ..good.clone() };
    let result = Call::Ship(oversize).run(follower_channel.clone()).await;
    let status = match result {
        Ok(ok) => panic!("65 MiB ShipSegment: accepted: {ok}"),
        Err(status) => status,
    };
    println!("65 MiB ShipSegment refused with {:?}: {}", status.code(), status.message());
    assert!(
        matches!(status.code(), Code::OutOfRange | Code::ResourceExhausted),
        "65 MiB ShipSegment: expected OUT_OF_RANGE or RESOURCE_EXHAUSTED, got {:?}: {:?}",
        status.code(),
        status.message()
    );
    assert!(
        numbers_in(status.message()).contains(&(MAX_PEER_MESSAGE_BYTES as u64)),
        "65 MiB ShipSegment: message {:?} does not name the {MAX_PEER_MESSAGE_BYTES}-byte limit",
        status.message()
    );

    // Idempotence: records 1..=D exactly as the leader shipped them.
    let frames: Vec<Frame> = records_before
        .iter()
        .map(|r| {
            let frame = Frame::encode(RecordFields {
                seqno: r.seqno,
                epoch: r.epoch,
                timestamp_us: r.timestamp_us,
                key: &r.key,
                payload: &r.payload,
            });
            assert_eq!(frame.crc32(), r.crc32, "record {}: re-encoded crc32 differs from the stored one", r.seqno);
            frame
        })
        .collect();
    let held = Segment::encode(SHARD, frames).expect("segment of records 1..=D");
    let resend = ShipSegmentRequest {
        id: Some(WalSegmentId { region_id: LEADER, shard_id: SHARD, seqno: 1 }),
        payload: held.encoded().clone(),
        event_count: d,
        leader_last_seq: d,
        stream_baseline: 0,
        epoch: EPOCH,
        leader_node_id: LEADER,
        commit_seqno: d,
        archived_seqno: 0,
        archiver_node_id: 0,
    };
    let response = tokio::time::timeout(CALL_TIMEOUT, shipping_client(follower_channel.clone()).ship_segment(resend))
        .await
        .expect("re-send timed out")
        .unwrap_or_else(|s| panic!("re-sent records 1..={d} refused: {s:?}"))
        .into_inner();
    assert!(response.accepted, "re-sent records 1..={d}: not accepted: {response:?}");
    assert_eq!(response.applied_seqno, d, "re-sent records 1..={d}: applied_seqno");
    assert_eq!(response.epoch, EPOCH, "re-sent records 1..={d}: epoch");

    // Nothing changed on the follower: positions and every record.
    let positions_after = positions(&mut cluster, FOLLOWER).await;
    assert_eq!(positions_after, positions_before, "node {FOLLOWER}'s /v1/status positions changed");
    let records_after = read_range(&mut follower_log, SHARD, 1, d).await.expect("follower read after");
    assert_eq!(records_after, records_before, "node {FOLLOWER}'s shard {SHARD} records changed");
    let status = follower_log
        .read(ReadRequest { shard_id: SHARD, from_seqno: d + 1, to_seqno: 0, max_bytes: 0, ..Default::default() })
        .await
        .expect_err("nothing past D on the follower");
    assert_eq!(status.code(), Code::OutOfRange, "read past D on the follower: {status:?}");

    // Refusals are counted by reason, on the node that refused them: every
    // reason the contract names has a non-zero series on the node that
    // refused it, and each counter grew by exactly the refusals sent there
    // (the oversize message is refused by the gRPC layer and not counted).
    let required: [(u32, &[&str]); 2] = [
        (FOLLOWER, &["stale_epoch", "gap", "unknown_shard", "corrupt", "bad_request", "wrong_leader", "not_leader"]),
        (LEADER, &["not_follower", "not_leader", "bad_request", "unknown_shard", "stale_epoch"]),
    ];
    for (node, admin, before) in
        [(LEADER, &leader_admin, &leader_counts_before), (FOLLOWER, &follower_admin, &follower_counts_before)]
    {
        let after = refused_counts(admin).await;
        println!("node {node}: walship_ship_refused_total {after:?} (before the refusals: {before:?})");
        let reasons_here = required.iter().find(|(n, _)| *n == node).expect("node listed").1;
        for reason in reasons_here {
            let n = after.get(*reason).copied().unwrap_or(0.0);
            assert!(n > 0.0, "node {node}: walship_ship_refused_total{{reason={reason:?}}} is {n}: {after:?}");
        }
        let mut reasons: Vec<&str> = after.keys().map(String::as_str).collect();
        reasons.extend(expected.keys().filter(|(n, _)| *n == node).map(|(_, r)| *r));
        reasons.sort_unstable();
        reasons.dedup();
        for reason in reasons {
            let delta = after.get(reason).copied().unwrap_or(0.0) - before.get(reason).copied().unwrap_or(0.0);
            let want = expected.get(&(node, reason)).copied().unwrap_or(0.0);
            assert_eq!(
                delta, want,
                "node {node}: walship_ship_refused_total{{reason={reason:?}}} grew by {delta}, expected {want}: {after:?}"
            );
        }
    }

    // Replication still works: the next append gets D+1.. and reaches the follower.
    let records: Vec<AppendRecord> = (1..=5)
        .map(|i| AppendRecord { key: Bytes::from(format!("after-{i}")), payload: Bytes::from(format!("after-{i}")) })
        .collect();
    let r = leader_log
        .append(AppendRequest { shard_id: SHARD, records, durability: Durability::Quorum as i32, ..Default::default() })
        .await
        .expect("append after the refusals")
        .into_inner();
    assert_eq!((r.first_seqno, r.last_seqno), (d + 1, d + 5), "next contiguous seqnos");
    wait_until(&format!("node {FOLLOWER} has shard {SHARD} durable at {}", d + 5), Duration::from_secs(20), || {
        let admin = follower_admin.clone();
        async move { shard_field(admin, SHARD, "durable_seqno").await == Some(d + 5) }
    })
    .await;
    wait_until(
        &format!("node {FOLLOWER} serves shard {SHARD} reads through {}", d + 5),
        Duration::from_secs(20),
        || {
            let mut client = follower_log.clone();
            async move { read_range(&mut client, SHARD, d + 1, d + 5).await.is_ok() }
        },
    )
    .await;
    let all = read_range(&mut follower_log, SHARD, 1, d + 5).await.expect("follower read of D+5");
    assert_eq!(all[..d as usize], records_before[..], "earlier records intact on the follower");
    for (i, record) in all[d as usize..].iter().enumerate() {
        assert_eq!(record.seqno, d + 1 + i as u64);
        assert_eq!(record.payload, Bytes::from(format!("after-{}", i + 1)), "the leader's record, not a forged one");
    }
}

/// Three pushes to the follower: one in an epoch older than it has seen,
/// one for a shard no node hosts, and a keepalive from the shard's leader
/// in its epoch (nothing to apply).
fn refused_twice_then_a_keepalive() -> [ShipSegmentRequest; 3] {
    let stale = ShipSegmentRequest { epoch: EPOCH - 1, ..ship_of(&fake_segment(SHARD, 1, 2), 0) };
    let unknown = with_id(ship_of(&fake_segment(999, 1, 1), 0), 999, 1);
    let keepalive = ShipSegmentRequest {
        id: Some(WalSegmentId { region_id: LEADER, shard_id: SHARD, seqno: 0 }),
        epoch: EPOCH,
        leader_node_id: LEADER,
        ..Default::default()
    };
    [stale, unknown, keepalive]
}

/// The answers to [`refused_twice_then_a_keepalive`] with refusals in
/// place: each refusal in its push's place with the status `ShipSegment`
/// would have returned, and the keepalive after them accepted.
fn assert_answered_in_place(answers: &[ShipSegmentResponse]) {
    let [first, second, third] = answers else { panic!("an answer per push, three: {answers:?}") };
    assert!(!first.accepted, "{first:?}");
    assert_eq!(first.refusal_code, Code::FailedPrecondition as u32, "{first:?}");
    assert!(first.refusal_message.contains("older than epoch"), "{first:?}");
    assert_eq!(first.refusal_metadata.get(EPOCH_METADATA_KEY).map(String::as_str), Some("1"), "{first:?}");
    assert_eq!(first.refusal_metadata.get("walship-refused").map(String::as_str), Some("1"), "{first:?}");
    assert_eq!(second.refusal_code, Code::NotFound as u32, "{second:?}");
    assert!(second.refusal_message.contains("999"), "{second:?}");
    assert!(third.accepted && third.refusal_code == 0, "went on after two refusals: {third:?}");
    assert_eq!(third.epoch, EPOCH, "{third:?}");
}

/// A `ShipSegments` stream opened with `walship-inline-refusals: 1` (what
/// leaders open) answers a refused push in its place, with the status
/// `ShipSegment` would have returned in `refusal_code`, `refusal_message`
/// and `refusal_metadata`, and goes on with the next push: one shard's
/// refusal fails no other push on the stream. Without the metadata the
/// first refusal ends the stream, as the contract says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_refusals_in_place_answers_each_refusal_and_goes_on() {
    let mut cluster = Cluster::start(3, 2, "");
    let follower_grpc = cluster.node(FOLLOWER).grpc.clone();
    let before = positions(&mut cluster, FOLLOWER).await;
    let [stale, unknown, keepalive] = refused_twice_then_a_keepalive();

    let mut client = shipping_client(connect(&follower_grpc).await);
    let mut call = tonic::Request::new(tokio_stream::iter(vec![stale.clone(), unknown, keepalive]));
    call.metadata_mut().insert("walship-inline-refusals", tonic::metadata::MetadataValue::from_static("1"));
    let mut answers = tokio::time::timeout(CALL_TIMEOUT, client.ship_segments(call))
        .await
        .expect("ShipSegments opened in time")
        .expect("ShipSegments opened")
        .into_inner();
    let mut next = async || {
        tokio::time::timeout(CALL_TIMEOUT, answers.message()).await.expect("answer in time").expect("no stream error")
    };
    let mut three = Vec::new();
    for push in ["the stale push", "the unknown shard", "the keepalive after two refusals"] {
        three.push(next().await.unwrap_or_else(|| panic!("no answer for {push}")));
    }
    assert_answered_in_place(&three);
    assert!(next().await.is_none(), "the stream ends cleanly once the pushes end");

    // Without the metadata: the first refusal ends the stream with its status.
    let mut plain = client.ship_segments(tokio_stream::iter(vec![stale])).await.expect("opened").into_inner();
    let ended = tokio::time::timeout(CALL_TIMEOUT, plain.message()).await.expect("in time");
    let status = ended.expect_err("the refusal ends a stream opened without the metadata");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");

    assert_eq!(positions(&mut cluster, FOLLOWER).await, before, "the refusals changed nothing on the follower");
}

/// `ShipBatches` (many pushes to a message, what walship leaders send):
/// each batch is answered by one message with an answer per push, in
/// order, every refusal in its place with the status `ShipSegment` would
/// have returned, so one push's refusal costs the others nothing. A batch
/// of no push or more than 256 ends the stream with `INVALID_ARGUMENT`
/// naming the count (counted as `bad_request`), none of it applied, as does
/// a message that does not decode. The follower's positions are unchanged
/// throughout, and the leader's own shipping (over `ShipBatches`) still
/// replicates afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ship_batch_answers_each_push_in_place_and_bad_batches_change_nothing() {
    use walship_proto::replication::ShipBatch;
    let mut cluster = Cluster::start(3, 2, "");
    let follower_grpc = cluster.node(FOLLOWER).grpc.clone();
    let follower_admin = cluster.node(FOLLOWER).admin.clone();
    let before = positions(&mut cluster, FOLLOWER).await;
    let refused_before = refused_counts(&follower_admin).await;
    let [stale, unknown, keepalive] = refused_twice_then_a_keepalive();
    let mut client = shipping_client(connect(&follower_grpc).await);
    let open = async |client: &mut WalShippingClient<common::Member>, batches: Vec<ShipBatch>| {
        tokio::time::timeout(CALL_TIMEOUT, client.ship_batches(tokio_stream::iter(batches)))
            .await
            .expect("ShipBatches opened in time")
            .expect("ShipBatches opened")
            .into_inner()
    };

    // One batch: a stale push, a push for a shard not hosted, a keepalive.
    let mut answers =
        open(&mut client, vec![ShipBatch { pushes: vec![stale.clone(), unknown, keepalive.clone()] }]).await;
    let answer = tokio::time::timeout(CALL_TIMEOUT, answers.message())
        .await
        .expect("answered in time")
        .expect("no stream error")
        .expect("one answer for the batch");
    assert_answered_in_place(&answer.answers);
    assert!(answers.message().await.expect("no stream error").is_none(), "ends once the batches end");

    // Bad batches: refused whole, the stream ends with the status, after
    // the answers to the batches before them.
    let pushes = |n: u64| (1..=n).map(|s| ship_of(&fake_segment(SHARD, s, 1), 0)).collect::<Vec<_>>();
    for (name, batch, count) in
        [("an empty batch", ShipBatch { pushes: vec![] }, 0u64), ("257 pushes", ShipBatch { pushes: pushes(257) }, 257)]
    {
        let mut answers = open(&mut client, vec![ShipBatch { pushes: vec![keepalive.clone()] }, batch]).await;
        let ok = tokio::time::timeout(CALL_TIMEOUT, answers.message()).await.expect("in time");
        let ok = ok.expect("the good batch before it is answered").expect("an answer");
        assert!(ok.answers.len() == 1 && ok.answers[0].accepted, "{name}: the batch before: {ok:?}");
        let ended = tokio::time::timeout(CALL_TIMEOUT, answers.message()).await.expect("in time");
        let status = ended.expect_err(&format!("{name}: refused"));
        assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
        let numbers = numbers_in(status.message());
        assert!(numbers.contains(&count) && numbers.contains(&256), "{name}: names {count} and 256: {status:?}");
    }
    // A message that does not decode (field 1 says 100 bytes follow; 1 does).
    let path = "/tidal.replication.v1.WalShipping/ShipBatches";
    let garbage = common::raw_stream_first(connect(&follower_grpc).await, path, &[0x0a, 0x64, 0x01]).await;
    let status = garbage.expect_err("a message that does not decode is refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    assert_eq!(positions(&mut cluster, FOLLOWER).await, before, "the batches changed nothing on the follower");
    let refused_after = refused_counts(&follower_admin).await;
    let grew = |reason: &str| {
        refused_after.get(reason).copied().unwrap_or(0.0) - refused_before.get(reason).copied().unwrap_or(0.0)
    };
    assert_eq!(grew("bad_request"), 2.0, "the two bad batches counted: {refused_after:?}");
    assert_eq!(grew("unknown_shard"), 1.0, "{refused_after:?}");
    assert_eq!(grew("stale_epoch"), 1.0, "{refused_after:?}");

    // The leader's own pushes (ShipBatches) still reach the follower.
    let leader_grpc = cluster.node(LEADER).grpc.clone();
    let mut log = LogClient::new(connect(&leader_grpc).await);
    let request = AppendRequest {
        shard_id: SHARD,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from_static(b"after the batches") }],
        durability: Durability::All as i32,
        ..Default::default()
    };
    let appended = tokio::time::timeout(CALL_TIMEOUT, log.append(request)).await.expect("in time").expect("appended");
    let seqno = appended.into_inner().last_seqno;
    let admin = follower_admin.clone();
    wait_until("the follower holds the new record", Duration::from_secs(10), || {
        let admin = admin.clone();
        async move { shard_field(admin, SHARD, "durable_seqno").await.is_some_and(|d| d >= seqno) }
    })
    .await;
}
