//! Black-box refusals: every malformed or out-of-bounds request to a real
//! `walship node` process comes back with the exact gRPC status its contract
//! names, with a message that says what was wrong, and changes nothing: the
//! shard positions in `/v1/status` and the records a full `Read` returns are
//! identical before and after the refusals. Refusals are counted in
//! `walship_requests_rejected_total`, unknown admin paths answer a JSON 404,
//! and a good append afterwards gets the next contiguous seqno.

mod common;

use common::assert_refused;

use std::collections::HashMap;

use bytes::Bytes;
use common::{NodeProcess, http_get};
use serde_json::Value;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest, Record, TailRequest};

const MIB: usize = 1 << 20;
/// Default limits of a node (see `LogLimits::default`).
const MAX_RECORD_BYTES: usize = MIB;
const MAX_BATCH_RECORDS: usize = 100_000;
const MAX_BATCH_BYTES: usize = 32 * MIB;
/// The case refused before decoding (`walship_proto::codec`).
const OVER_MAX_BATCH_RECORDS: &str = "batch over max_batch_records";

/// Sends `body` verbatim as the protobuf message of a `walship.v1.Log/Append`.
async fn raw_append(channel: Channel, body: &[u8]) -> Result<Bytes, tonic::Status> {
    common::raw_unary(channel, "/walship.v1.Log/Append", body).await
}

// ---------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------

/// One request of any Log RPC, for the case table.
#[derive(Debug, Clone)]
enum Call {
    Append(AppendRequest),
    Read(ReadRequest),
    Tail(TailRequest),
}

impl Call {
    fn rpc(&self) -> &'static str {
        match self {
            Call::Append(_) => "append",
            Call::Read(_) => "read",
            Call::Tail(_) => "tail",
        }
    }

    /// Runs the call; `Ok` means the server accepted it (a test failure for
    /// every case in the table).
    async fn run(self, client: &mut LogClient<Channel>) -> Result<String, tonic::Status> {
        match self {
            Call::Append(r) => client.append(r).await.map(|r| format!("{:?}", r.into_inner())),
            Call::Read(r) => client.read(r).await.map(|r| format!("{} records", r.into_inner().records.len())),
            // A refused tail fails the call itself, before any stream exists.
            Call::Tail(r) => client.tail(r).await.map(|_| "a tail stream".to_string()),
        }
    }
}

/// A refusal the server must give.
struct Case {
    name: &'static str,
    call: Call,
    code: Code,
    /// Words the message must contain (case-insensitive).
    words: Vec<&'static str>,
    /// Numbers the message must name (as whole numbers, not substrings).
    numbers: Vec<u64>,
}

fn record(key_len: usize, payload_len: usize) -> AppendRecord {
    AppendRecord { key: Bytes::from(vec![b'k'; key_len]), payload: Bytes::from(vec![b'p'; payload_len]) }
}

fn append(shard_id: u32, records: Vec<AppendRecord>) -> AppendRequest {
    AppendRequest { shard_id, records, durability: Durability::Local as i32, ..Default::default() }
}

/// `/v1/status` of the node, parsed.
async fn status(node: &NodeProcess) -> Value {
    let (code, body) = http_get(&format!("{}/v1/status", node.admin)).await;
    assert_eq!(code, 200, "/v1/status: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/v1/status is not JSON ({e}): {body}"))
}

/// The `shards` of `/v1/status`, sorted by shard id.
async fn shard_positions(node: &NodeProcess) -> Vec<Value> {
    let status = status(node).await;
    let mut shards = status["shards"].as_array().expect("shards array").clone();
    shards.sort_by_key(|s| s["shard_id"].as_u64().expect("shard_id"));
    shards
}

fn shard_field(shards: &[Value], shard: u32, field: &str) -> u64 {
    shards
        .iter()
        .find(|s| s["shard_id"].as_u64() == Some(shard as u64))
        .unwrap_or_else(|| panic!("shard {shard} missing from /v1/status: {shards:?}"))[field]
        .as_u64()
        .unwrap_or_else(|| panic!("shard {shard}: {field} is not a number"))
}

/// Every durable record of `shard`, read from the first retained seqno.
async fn read_all(client: &mut LogClient<Channel>, shard: u32, first: u64, durable: u64) -> Vec<Record> {
    let mut records = Vec::new();
    let mut from = first;
    while from <= durable {
        let response = client
            .read(ReadRequest {
                shard_id: shard,
                from_seqno: from,
                to_seqno: durable,
                max_bytes: 0,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|s| panic!("reading shard {shard} from {from}: {s}"))
            .into_inner();
        assert!(!response.records.is_empty(), "shard {shard}: empty read at {from} (durable {durable})");
        from = response.next_seqno;
        records.extend(response.records);
    }
    records
}

/// Positions plus the full contents of every shard: what must not change.
async fn snapshot(node: &NodeProcess, client: &mut LogClient<Channel>) -> (Vec<Value>, Vec<Vec<Record>>) {
    let shards = shard_positions(node).await;
    let mut contents = Vec::new();
    for s in &shards {
        let id = s["shard_id"].as_u64().unwrap() as u32;
        let (first, durable) = (shard_field(&shards, id, "first_seqno"), shard_field(&shards, id, "durable_seqno"));
        contents.push(read_all(client, id, first, durable).await);
    }
    (shards, contents)
}

/// The value of an unlabelled metric on the node's /metrics.
async fn metric_value(node: &NodeProcess, name: &str) -> f64 {
    let (code, body) = http_get(&format!("{}/metrics", node.admin)).await;
    assert_eq!(code, 200);
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
        .trim()
        .parse()
        .unwrap()
}

/// `walship_requests_rejected_total` by (rpc, code).
async fn rejected_counts(node: &NodeProcess) -> HashMap<(String, String), f64> {
    let (code, body) = http_get(&format!("{}/metrics", node.admin)).await;
    assert_eq!(code, 200, "/metrics");
    let mut counts = HashMap::new();
    for line in body.lines().filter(|l| l.starts_with("walship_requests_rejected_total{")) {
        let (labels, value) = line.rsplit_once(' ').expect("sample value");
        let labels = labels.trim_start_matches("walship_requests_rejected_total{").trim_end_matches('}');
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_else(|| panic!("no {name} label in {line:?}"))
        };
        counts.insert((label("rpc"), label("code")), value.parse::<f64>().expect("sample value"));
    }
    counts
}

async fn connect(node: &NodeProcess) -> Channel {
    Endpoint::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap()
}

// ---------------------------------------------------------------------------
// Tests.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_precisely_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1-3", &[]);
    node.wait_healthy().await;
    let mut client = node.client().await;

    // Seed: shard 1 holds 5 records, shard 2 holds 3, shard 3 is empty.
    for (shard, count) in [(1u32, 5usize), (2, 3)] {
        let records = (0..count)
            .map(|i| AppendRecord {
                key: Bytes::from(format!("key-{shard}-{i}")),
                payload: Bytes::from(format!("payload-{shard}-{i}")),
            })
            .collect();
        let r = client.append(append(shard, records)).await.expect("seed append").into_inner();
        assert_eq!((r.first_seqno, r.last_seqno), (1, count as u64), "seed of shard {shard}");
    }
    let (positions_before, contents_before) = snapshot(&node, &mut client).await;
    assert_eq!(positions_before.len(), 3, "three shards hosted: {positions_before:?}");
    let durable1 = shard_field(&positions_before, 1, "durable_seqno");
    let durable3 = shard_field(&positions_before, 3, "durable_seqno");
    assert_eq!(durable1, 5);
    assert_eq!(shard_field(&positions_before, 2, "durable_seqno"), 3);
    assert_eq!(durable3, 0);
    assert_eq!(contents_before.iter().map(Vec::len).collect::<Vec<_>>(), vec![5, 3, 0]);

    let one = || vec![record(0, 8)];
    let cases = vec![
        // 1. Unknown shards.
        Case {
            name: "append to unknown shard 99",
            call: Call::Append(append(99, one())),
            code: Code::NotFound,
            words: vec!["shard"],
            numbers: vec![99],
        },
        Case {
            name: "append to shard 0 (never hosted)",
            call: Call::Append(append(0, one())),
            code: Code::NotFound,
            words: vec!["shard"],
            numbers: vec![0],
        },
        Case {
            name: "read from unknown shard 99",
            call: Call::Read(ReadRequest {
                shard_id: 99,
                from_seqno: 1,
                to_seqno: 0,
                max_bytes: 0,
                ..Default::default()
            }),
            code: Code::NotFound,
            words: vec!["shard"],
            numbers: vec![99],
        },
        Case {
            name: "tail of unknown shard 99",
            call: Call::Tail(TailRequest { shard_id: 99, from_seqno: 1 }),
            code: Code::NotFound,
            words: vec!["shard"],
            numbers: vec![99],
        },
        // 2. Empty batch.
        Case {
            name: "append with no records",
            call: Call::Append(append(1, vec![])),
            code: Code::InvalidArgument,
            words: vec!["record"],
            numbers: vec![],
        },
        // 3. One record over the limit.
        Case {
            name: "one record of 1 MiB + 1 byte payload",
            call: Call::Append(append(1, vec![record(0, MAX_RECORD_BYTES + 1)])),
            code: Code::InvalidArgument,
            words: vec!["max_record_bytes"],
            numbers: vec![MAX_RECORD_BYTES as u64, MAX_RECORD_BYTES as u64 + 1],
        },
        Case {
            name: "one record whose key + payload is 1 MiB + 1 byte",
            call: Call::Append(append(1, vec![record(MAX_RECORD_BYTES / 2, MAX_RECORD_BYTES / 2 + 1)])),
            code: Code::InvalidArgument,
            words: vec!["max_record_bytes"],
            numbers: vec![MAX_RECORD_BYTES as u64],
        },
        // 4. Only the last record of a batch is over the limit.
        Case {
            name: "batch whose last record is oversize",
            call: Call::Append(append(
                1,
                vec![record(3, 10), record(0, 100), record(5, 0), record(0, MAX_RECORD_BYTES + 1)],
            )),
            code: Code::InvalidArgument,
            words: vec!["record 3", "max_record_bytes"],
            numbers: vec![MAX_RECORD_BYTES as u64],
        },
        Case {
            name: OVER_MAX_BATCH_RECORDS,
            call: Call::Append(append(1, vec![record(0, 0); MAX_BATCH_RECORDS + 1])),
            code: Code::InvalidArgument,
            words: vec!["max_batch_records"],
            numbers: vec![MAX_BATCH_RECORDS as u64],
        },
        Case {
            name: "batch over max_batch_bytes (every record within max_record_bytes)",
            call: Call::Append(append(1, vec![record(0, MAX_RECORD_BYTES); MAX_BATCH_BYTES / MAX_RECORD_BYTES + 1])),
            code: Code::InvalidArgument,
            words: vec!["max_batch_bytes"],
            numbers: vec![MAX_BATCH_BYTES as u64],
        },
        // 5. Unknown durability.
        Case {
            name: "append with durability 99",
            call: Call::Append(AppendRequest { shard_id: 1, records: one(), durability: 99, ..Default::default() }),
            code: Code::InvalidArgument,
            words: vec!["durability"],
            numbers: vec![99],
        },
        Case {
            name: "append with durability -1",
            call: Call::Append(AppendRequest { shard_id: 1, records: one(), durability: -1, ..Default::default() }),
            code: Code::InvalidArgument,
            words: vec!["durability"],
            numbers: vec![],
        },
        // 6. Seqno ranges.
        Case {
            name: "read from seqno 0",
            call: Call::Read(ReadRequest {
                shard_id: 1,
                from_seqno: 0,
                to_seqno: 0,
                max_bytes: 0,
                ..Default::default()
            }),
            code: Code::InvalidArgument,
            words: vec!["from_seqno"],
            numbers: vec![],
        },
        Case {
            name: "read from past the newest durable (open end)",
            call: Call::Read(ReadRequest {
                shard_id: 1,
                from_seqno: durable1 + 1,
                to_seqno: 0,
                max_bytes: 0,
                ..Default::default()
            }),
            code: Code::OutOfRange,
            words: vec!["committed"],
            numbers: vec![durable1 + 1, durable1],
        },
        Case {
            name: "read from far past the newest durable (open end)",
            call: Call::Read(ReadRequest {
                shard_id: 1,
                from_seqno: durable1 + 100,
                to_seqno: 0,
                max_bytes: 0,
                ..Default::default()
            }),
            code: Code::OutOfRange,
            words: vec!["committed"],
            numbers: vec![durable1],
        },
        Case {
            name: "read from past the newest durable (closed range)",
            call: Call::Read(ReadRequest {
                shard_id: 1,
                from_seqno: durable1 + 1,
                to_seqno: durable1 + 3,
                max_bytes: 0,
                ..Default::default()
            }),
            code: Code::OutOfRange,
            words: vec!["committed"],
            numbers: vec![durable1],
        },
        Case {
            name: "read with to_seqno past the newest durable",
            call: Call::Read(ReadRequest {
                shard_id: 1,
                from_seqno: 1,
                to_seqno: durable1 + 1,
                max_bytes: 0,
                ..Default::default()
            }),
            code: Code::OutOfRange,
            words: vec!["committed"],
            numbers: vec![durable1 + 1, durable1],
        },
        Case {
            name: "read with to_seqno before from_seqno",
            call: Call::Read(ReadRequest {
                shard_id: 1,
                from_seqno: 3,
                to_seqno: 2,
                max_bytes: 0,
                ..Default::default()
            }),
            code: Code::InvalidArgument,
            words: vec!["to_seqno", "from_seqno"],
            numbers: vec![2, 3],
        },
        Case {
            name: "read of an empty shard",
            call: Call::Read(ReadRequest {
                shard_id: 3,
                from_seqno: 1,
                to_seqno: 0,
                max_bytes: 0,
                ..Default::default()
            }),
            code: Code::OutOfRange,
            words: vec!["shard 3"],
            numbers: vec![durable3],
        },
        Case {
            name: "tail from seqno 0",
            call: Call::Tail(TailRequest { shard_id: 1, from_seqno: 0 }),
            code: Code::InvalidArgument,
            words: vec!["from_seqno"],
            numbers: vec![],
        },
        Case {
            name: "tail from durable + 2",
            call: Call::Tail(TailRequest { shard_id: 1, from_seqno: durable1 + 2 }),
            code: Code::OutOfRange,
            words: vec!["committed"],
            numbers: vec![durable1 + 2, durable1],
        },
        Case {
            name: "tail of an empty shard from 2",
            call: Call::Tail(TailRequest { shard_id: 3, from_seqno: 2 }),
            code: Code::OutOfRange,
            words: vec!["shard 3"],
            numbers: vec![2, durable3],
        },
    ];

    let mut expected_rejections: HashMap<(String, String), f64> = HashMap::new();
    for case in cases {
        let rpc = case.call.rpc();
        let result = case.call.run(&mut client).await;
        assert_refused(case.name, result, case.code, &case.words, &case.numbers);
        if case.name == OVER_MAX_BATCH_RECORDS {
            // Refused by the codec before the service: counted as an
            // undecodable message instead (see the test of 15M records).
            continue;
        }
        *expected_rejections.entry((rpc.to_string(), format!("{:?}", case.code))).or_default() += 1.0;
    }

    // 7. Malformed protobuf bodies, sent verbatim: refused by the codec
    // before the service, and counted on their own.
    let undecodable_before = metric_value(&node, "walship_grpc_undecodable_messages_total").await;
    let channel = connect(&node).await;
    let garbage: Vec<(&str, Vec<u8>)> = vec![
        ("an unterminated varint tag", vec![0xff, 0xff, 0xff]),
        // Field 2 (records), length-delimited, claims 1000 bytes; 3 follow.
        ("a records field claiming 1000 bytes with 3 present", vec![0x12, 0xe8, 0x07, b'a', b'b', b'c']),
        ("wire type 7, which does not exist", vec![0x0f, 0x01]),
        ("shard_id (a varint) sent length-delimited", vec![0x0a, 0x01, 0x00]),
        ("a record whose bytes are an unterminated varint", vec![0x12, 0x02, 0xff, 0xff]),
        ("field number 0", vec![0x00, 0x01]),
    ];
    for (what, body) in &garbage {
        let result = raw_append(channel.clone(), body).await;
        assert_refused(&format!("malformed Append: {what}"), result, Code::InvalidArgument, &["malformed"], &[]);
    }
    let undecodable_after = metric_value(&node, "walship_grpc_undecodable_messages_total").await;
    assert_eq!(
        undecodable_after - undecodable_before,
        garbage.len() as f64,
        "walship_grpc_undecodable_messages_total counts each malformed body once"
    );
    // Control: the raw path reaches the service. An empty body decodes to the
    // default AppendRequest (shard 0), which the service refuses by shard.
    let result = raw_append(channel.clone(), &[]).await;
    assert_refused("empty Append body (shard 0)", result, Code::NotFound, &["shard"], &[0]);
    *expected_rejections.entry(("append".into(), "NotFound".into())).or_default() += 1.0;

    // Nothing changed: positions and every record are exactly as before.
    let (positions_after, contents_after) = snapshot(&node, &mut client).await;
    assert_eq!(positions_after, positions_before, "/v1/status shard positions changed after refused requests");
    assert_eq!(contents_after, contents_before, "shard contents changed after refused requests");

    // 8. Refusals are counted, by RPC and code.
    let counts = rejected_counts(&node).await;
    for key in [("append", "InvalidArgument"), ("append", "NotFound")] {
        let n = counts.get(&(key.0.to_string(), key.1.to_string())).copied().unwrap_or(0.0);
        assert!(n > 0.0, "walship_requests_rejected_total{{rpc={:?},code={:?}}} is {n}: {counts:?}", key.0, key.1);
    }
    for ((rpc, code), expected) in &expected_rejections {
        let n = counts.get(&(rpc.clone(), code.clone())).copied().unwrap_or(0.0);
        assert!(
            n >= *expected,
            "walship_requests_rejected_total{{rpc={rpc:?},code={code:?}}} is {n}, expected at least {expected}: {counts:?}"
        );
    }

    // 9. Admin: unknown path -> 404 with a JSON error body.
    for path in ["/nope", "/v1/nope", "/v1/status/extra"] {
        let (code, body) = http_get(&format!("{}{path}", node.admin)).await;
        assert_eq!(code, 404, "GET {path}: {body}");
        let json: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}"));
        let code_field = json["error"]["code"].as_str().unwrap_or_else(|| panic!("GET {path}: no error.code: {body}"));
        let message =
            json["error"]["message"].as_str().unwrap_or_else(|| panic!("GET {path}: no error.message: {body}"));
        assert!(!code_field.is_empty() && !message.is_empty(), "GET {path}: empty error fields: {body}");
    }

    // A good append still succeeds, at the next contiguous seqno.
    let r = client.append(append(1, vec![record(2, 20)])).await.expect("good append after refusals").into_inner();
    assert_eq!((r.first_seqno, r.last_seqno), (durable1 + 1, durable1 + 1), "next contiguous seqno");
    let positions = shard_positions(&node).await;
    assert_eq!(shard_field(&positions, 1, "last_seqno"), durable1 + 1);
    assert_eq!(shard_field(&positions, 1, "durable_seqno"), durable1 + 1);
    assert_eq!(positions[1..], positions_before[1..], "other shards untouched by the good append");
    let all = read_all(&mut client, 1, 1, durable1 + 1).await;
    assert_eq!(all[..durable1 as usize], contents_before[0][..], "earlier records intact");
    assert_eq!(all.last().unwrap().payload, Bytes::from(vec![b'p'; 20]));
}

#[test]
fn a_node_refuses_to_start_with_limits_no_record_could_travel_under() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, value, words) in [
        ("--max-record-bytes", "33554433", &["max_record_bytes", "33554432"][..]),
        ("--max-record-bytes", "0", &["positive"][..]),
        ("--max-record-bytes", "18446744073709551615", &["max_record_bytes"][..]),
    ] {
        let out = std::process::Command::new(common::walship_bin())
            .args(["node", "--node-id", "1", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--shards", "1"])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args([flag, value])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value}: the node started");
        for word in words {
            assert!(stderr.contains(word), "{flag} {value}: {stderr}");
        }
    }
}

/// The node's peak resident memory (`VmHWM`), in bytes.
fn peak_rss(node: &NodeProcess) -> u64 {
    common::proc_status_bytes(node.child.id(), "VmHWM")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_of_millions_of_empty_records_is_refused_before_they_are_decoded() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1", &[]);
    node.wait_healthy().await;
    let mut client = node.client().await;
    client.append(append(1, vec![record(1, 10)])).await.expect("seed append");
    let (positions_before, contents_before) = snapshot(&node, &mut client).await;
    // 15 million empty records: 30 MB on the wire, within the message cap
    // (max_batch_bytes plus 16 bytes a record), about 1 GB once decoded.
    let records = 15_000_000usize;
    let mut body = vec![0x08, 0x01]; // shard_id 1
    body.reserve(2 * records);
    for _ in 0..records {
        body.extend_from_slice(&[0x12, 0x00]);
    }
    let before = peak_rss(&node);
    let undecodable = metric_value(&node, "walship_grpc_undecodable_messages_total").await;
    let result = raw_append(connect(&node).await, &body).await;
    assert_refused(
        "15M empty records",
        result,
        Code::InvalidArgument,
        &["max_batch_records"],
        &[records as u64, MAX_BATCH_RECORDS as u64],
    );
    let grew = peak_rss(&node).saturating_sub(before);
    // The message itself is held once or twice (30-60 MB); decoding the
    // records would have taken about 1 GB.
    assert!(grew < 300 << 20, "peak RSS grew by {} MiB refusing the append", grew >> 20);
    let counted = metric_value(&node, "walship_grpc_undecodable_messages_total").await - undecodable;
    assert_eq!(counted, 1.0, "refused before decoding: counted with the undecodable messages");
    let (positions_after, contents_after) = snapshot(&node, &mut client).await;
    assert_eq!((positions_after, contents_after), (positions_before, contents_before), "the refusal changed nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_record_bytes_flag_sets_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(2, dir.path(), "1-3", &["--max-record-bytes", "100"]);
    node.wait_healthy().await;
    let mut client = node.client().await;

    // Exactly the limit is accepted, key empty.
    let r = client.append(append(1, vec![record(0, 100)])).await.expect("100-byte record").into_inner();
    assert_eq!((r.first_seqno, r.last_seqno), (1, 1));
    let (positions_before, contents_before) = snapshot(&node, &mut client).await;

    let refusals: Vec<(&str, Vec<AppendRecord>, u64)> = vec![
        ("a 101-byte payload", vec![record(0, 101)], 101),
        ("key 50 + payload 51", vec![record(50, 51)], 101),
        ("a 1 MiB payload", vec![record(0, MIB)], MIB as u64),
        ("a good record then a 101-byte one", vec![record(0, 10), record(0, 101)], 101),
    ];
    for (what, records, size) in refusals {
        let result = client.append(append(1, records)).await;
        assert_refused(what, result, Code::InvalidArgument, &["max_record_bytes"], &[100, size]);
    }
    let (positions_after, contents_after) = snapshot(&node, &mut client).await;
    assert_eq!(positions_after, positions_before, "refused appends moved the positions");
    assert_eq!(contents_after, contents_before, "refused appends changed the contents");

    // Key + payload of exactly 100 is accepted too, at the next seqno.
    let r = client.append(append(1, vec![record(40, 60)])).await.expect("40 + 60 bytes").into_inner();
    assert_eq!((r.first_seqno, r.last_seqno), (2, 2));
    let all = read_all(&mut client, 1, 1, 2).await;
    assert_eq!(all.len(), 2);
    assert_eq!((all[0].key.len(), all[0].payload.len()), (0, 100));
    assert_eq!((all[1].key.len(), all[1].payload.len()), (40, 60));
}
