//! Producer sessions and conditional appends against real `walship`
//! processes, as a hostile or careless caller meets them: every refusal of
//! the `AppendRequest.producer` / `expected_last_seqno` contract
//! (`proto/proto/walship/v1/log.proto`) comes back with its exact gRPC code,
//! its `walship-refusal` / `walship-last-seqno` metadata (or the
//! `AppendFailure` fields on `AppendStream`) and a message naming the facts,
//! and writes nothing; retries are answered with their original seqnos and
//! stored once; a new epoch fences the old one from its first write on;
//! racing conditional appends let exactly one through; and the CLI's
//! `--expect-last` / `--producer-*` flags behave as documented.

mod common;

use std::collections::BTreeMap;
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::cli::{describe, json_lines, run, walship};
use common::{Cluster, NodeProcess, assert_refused, http_get, numbers_in, read_all, wait_until};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use walship_proto::log::append_stream_response::Result as Answer;
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{
    AppendFailure, AppendRecord, AppendRequest, AppendResponse, AppendStreamRequest, Durability, Producer, Record,
    TailRequest,
};
use walship_proto::{
    LAST_SEQNO_METADATA_KEY, REFUSAL_EXPECTED_LAST, REFUSAL_METADATA_KEY, REFUSAL_PRODUCER_FENCED,
    REFUSAL_PRODUCER_SEQUENCE, REFUSAL_PRODUCER_UNKNOWN,
};

const WAIT: Duration = Duration::from_secs(30);
const SHARD: u32 = 1;

// ---------------------------------------------------------------------------
// Requests.
// ---------------------------------------------------------------------------

fn producer(id: u64, epoch: u64, sequence: u64) -> Producer {
    Producer { id, epoch, sequence }
}

/// An append of `payloads` to shard 1 at QUORUM, as `producer` (if any),
/// conditioned on `expected` (if any).
fn append<S: AsRef<str>>(payloads: &[S], producer: Option<Producer>, expected: Option<u64>) -> AppendRequest {
    AppendRequest {
        shard_id: SHARD,
        records: payloads
            .iter()
            .map(|p| AppendRecord { key: Bytes::new(), payload: Bytes::from(p.as_ref().to_string()) })
            .collect(),
        durability: Durability::Quorum as i32,
        producer,
        expected_last_seqno: expected,
    }
}

async fn connect(grpc: &str) -> LogClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
    LogClient::new(channel)
}

/// Appends and expects success; answers the response.
async fn ok(client: &mut LogClient<Channel>, what: &str, request: AppendRequest) -> AppendResponse {
    let mut call = tonic::Request::new(request);
    call.set_timeout(WAIT);
    client.append(call).await.unwrap_or_else(|s| panic!("{what}: refused: {s:?}")).into_inner()
}

/// Asserts an append was written fresh at `[first, last]`.
fn assert_written(what: &str, r: &AppendResponse, first: u64, last: u64) {
    assert_eq!((r.first_seqno, r.last_seqno, r.duplicate), (first, last, false), "{what}: {r:?}");
}

/// Asserts an append was answered as a duplicate of `[first, last]`.
fn assert_duplicate(what: &str, r: &AppendResponse, first: u64, last: u64) {
    assert_eq!((r.first_seqno, r.last_seqno, r.duplicate), (first, last, true), "{what}: {r:?}");
}

// ---------------------------------------------------------------------------
// What must not change.
// ---------------------------------------------------------------------------

/// The shard's `last_seqno` (everything its leader wrote, acknowledged or
/// not) from the node's own `/v1/status`.
async fn last_seqno(node: &NodeProcess) -> u64 {
    let (code, body) = http_get(&format!("{}/v1/status", node.admin)).await;
    assert_eq!(code, 200, "/v1/status: {body}");
    let status: Value = serde_json::from_str(&body).unwrap();
    status["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .find(|s| s["shard_id"] == SHARD)
        .unwrap_or_else(|| panic!("shard {SHARD} missing from /v1/status: {status}"))["last_seqno"]
        .as_u64()
        .expect("last_seqno")
}

/// The shard's written position and every record, read from `node`.
async fn shard_state(node: &NodeProcess) -> (u64, Vec<Record>) {
    let last = last_seqno(node).await;
    let records = read_all(&node.grpc, SHARD, last).await;
    assert_eq!(records.len() as u64, last, "every written record reads back (leader, all acknowledged)");
    (last, records)
}

/// A record as (seqno, payload, producer stamp as (id, epoch, sequence)).
type Stamped = (u64, String, Option<(u64, u64, u64)>);

/// Every record as [`Stamped`].
fn stamps(records: &[Record]) -> Vec<Stamped> {
    records
        .iter()
        .map(|r| {
            let payload = String::from_utf8(r.payload.to_vec()).unwrap();
            (r.seqno, payload, r.producer.as_ref().map(|p| (p.id, p.epoch, p.sequence)))
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Refusals, unary and streamed.
// ---------------------------------------------------------------------------

/// A refusal the contract names.
struct Refusal {
    name: &'static str,
    request: AppendRequest,
    code: Code,
    /// `walship-refusal` (`AppendFailure.refusal`), or none.
    refusal: Option<&'static str>,
    /// `walship-last-seqno` (`AppendFailure.last_seqno`), on expected-last.
    last_seqno: Option<u64>,
    words: Vec<&'static str>,
    numbers: Vec<u64>,
}

/// What [`seed`] wrote.
const SEEDED_LAST: u64 = 23;

/// Seeds shard 1 with a known producer history (23 records):
/// * seqno 1: a record without a producer;
/// * seqno 2: producer 7, epoch 1, sequence 1;
/// * seqnos 3..=5: producer 7, epoch 2, sequences 1..=3 (epoch 1 is fenced);
/// * six runs of producer 9 (epoch 1, two records each, sequences 1..=12),
///   each followed by a record without a producer, so they are six runs and
///   only the last five (sequences 3..=12) are remembered: run k at seqnos
///   6+3k, 7+3k.
async fn seed(client: &mut LogClient<Channel>) {
    assert_written("plain", &ok(client, "plain", append(&["plain-1"], None, None)).await, 1, 1);
    let r = ok(client, "7/1 seq 1", append(&["a1"], Some(producer(7, 1, 1)), None)).await;
    assert_written("7/1 seq 1", &r, 2, 2);
    let r = ok(client, "7/2 seq 1..=3", append(&["b1", "b2", "b3"], Some(producer(7, 2, 1)), None)).await;
    assert_written("7/2 seq 1..=3", &r, 3, 5);
    for k in 0..6u64 {
        let (x, y) = (format!("p9-{}", 2 * k + 1), format!("p9-{}", 2 * k + 2));
        let r = ok(client, "9 run", append(&[&x, &y], Some(producer(9, 1, 2 * k + 1)), None)).await;
        assert_written("producer 9 run", &r, 6 + 3 * k, 7 + 3 * k);
        let plain = format!("between-{k}");
        assert_written(
            "plain between runs",
            &ok(client, "plain", append(&[&plain], None, None)).await,
            8 + 3 * k,
            8 + 3 * k,
        );
    }
}

/// Every producer and conditional refusal, against the state [`seed`] left.
fn refusals() -> Vec<Refusal> {
    let fenced = Some(REFUSAL_PRODUCER_FENCED);
    let unknown = Some(REFUSAL_PRODUCER_UNKNOWN);
    let gap = Some(REFUSAL_PRODUCER_SEQUENCE);
    let expected = Some(REFUSAL_EXPECTED_LAST);
    let r = |name, request, code, refusal, words: &[&'static str], numbers: &[u64]| Refusal {
        name,
        request,
        code,
        refusal,
        last_seqno: None,
        words: words.to_vec(),
        numbers: numbers.to_vec(),
    };
    let last = |mut refusal: Refusal| {
        refusal.last_seqno = Some(SEEDED_LAST);
        refusal
    };
    vec![
        // Epoch 2 of producer 7 has written: epoch 1 is fenced, for a new
        // sequence and for a retry of what epoch 1 wrote alike.
        r(
            "fenced, next sequence",
            append(&["x"], Some(producer(7, 1, 2)), None),
            Code::FailedPrecondition,
            fenced,
            &["fenced"],
            &[7, 1, 2],
        ),
        r(
            "fenced, retry of a written record",
            append(&["a1"], Some(producer(7, 1, 1)), None),
            Code::FailedPrecondition,
            fenced,
            &["fenced"],
            &[7, 1, 2],
        ),
        // Never seen, not starting at 1.
        r(
            "unknown producer at sequence 2",
            append(&["x"], Some(producer(8, 1, 2)), None),
            Code::FailedPrecondition,
            unknown,
            &["not known"],
            &[8, 2],
        ),
        // A newer epoch starts at 1 as a new producer does.
        r(
            "newer epoch not at sequence 1",
            append(&["x"], Some(producer(7, 3, 4)), None),
            Code::FailedPrecondition,
            unknown,
            &["not known"],
            &[7, 3, 4],
        ),
        // Producer 7 epoch 2 is at sequence 3: 4 is next.
        r("gap of one", append(&["x"], Some(producer(7, 2, 5)), None), Code::OutOfRange, gap, &["gap"], &[5, 4]),
        r(
            "gap to the last sequence",
            append(&["x"], Some(producer(7, 2, u64::MAX)), None),
            Code::OutOfRange,
            gap,
            &["gap"],
            &[u64::MAX, 4],
        ),
        r(
            "gap in a batch",
            append(&["x", "y"], Some(producer(9, 1, 14)), None),
            Code::OutOfRange,
            gap,
            &["gap"],
            &[14, 13],
        ),
        // Malformed sessions.
        r("id 0", append(&["x"], Some(producer(0, 1, 1)), None), Code::InvalidArgument, None, &["producer id"], &[0]),
        r("epoch 0", append(&["x"], Some(producer(7, 0, 1)), None), Code::InvalidArgument, None, &["epoch"], &[0]),
        r(
            "sequence 0",
            append(&["x"], Some(producer(7, 2, 0)), None),
            Code::InvalidArgument,
            None,
            &["sequence"],
            &[0],
        ),
        r("all 0", append(&["x"], Some(producer(0, 0, 0)), None), Code::InvalidArgument, None, &["producer"], &[0]),
        // Sequences past 2^64-1: for a producer at 12 (would be a gap) and
        // for an unknown one (would be producer-unknown).
        r(
            "overflow, known producer",
            append(&["x", "y"], Some(producer(9, 1, u64::MAX)), None),
            Code::InvalidArgument,
            None,
            &["past"],
            &[u64::MAX, 2],
        ),
        r(
            "overflow, unknown producer",
            append(&["x", "y"], Some(producer(10, 1, u64::MAX)), None),
            Code::InvalidArgument,
            None,
            &["past"],
            &[u64::MAX, 2],
        ),
        r(
            "overflow, unknown producer at u64::MAX-1 with 3",
            append(&["x", "y", "z"], Some(producer(10, 1, u64::MAX - 1)), None),
            Code::InvalidArgument,
            None,
            &["past"],
            &[u64::MAX - 1, 3],
        ),
        // Producer 9's first run (sequences 1..=2) is older than its last
        // five: in the log, seqnos forgotten.
        r(
            "retry of a forgotten run",
            append(&["p9-1", "p9-2"], Some(producer(9, 1, 1)), None),
            Code::AlreadyExists,
            None,
            &["already written"],
            &[9, 1, 2, 12],
        ),
        r(
            "retry straddling a forgotten run",
            append(&["p9-2", "p9-3"], Some(producer(9, 1, 2)), None),
            Code::AlreadyExists,
            None,
            &["already written"],
            &[9, 2, 12],
        ),
        // Regrouped: 2..=13 runs past producer 9's newest (12) from a
        // forgotten sequence. ALREADY_EXISTS would say 13 is stored too.
        r(
            "retry straddling the next sequence from a forgotten run",
            append(&(2..=13).map(|i| format!("p9-{i}")).collect::<Vec<_>>(), Some(producer(9, 1, 2)), None),
            Code::OutOfRange,
            gap,
            &["send the records from sequence 13"],
            &[9, 2, 12, 13],
        ),
        // Conditional appends: the shard's newest is 23.
        last(r(
            "expected one behind",
            append(&["x"], None, Some(22)),
            Code::FailedPrecondition,
            expected,
            &["expected"],
            &[SEEDED_LAST, 22],
        )),
        last(r(
            "expected one ahead",
            append(&["x"], None, Some(24)),
            Code::FailedPrecondition,
            expected,
            &["expected"],
            &[SEEDED_LAST, 24],
        )),
        last(r(
            "expected an empty shard",
            append(&["x"], None, Some(0)),
            Code::FailedPrecondition,
            expected,
            &["expected"],
            &[SEEDED_LAST, 0],
        )),
        last(r(
            "expected u64::MAX",
            append(&["x"], None, Some(u64::MAX)),
            Code::FailedPrecondition,
            expected,
            &["expected"],
            &[SEEDED_LAST, u64::MAX],
        )),
        // A valid new producer whose condition fails: not registered either.
        last(r(
            "new producer, wrong expected",
            append(&["x"], Some(producer(10, 1, 1)), Some(5)),
            Code::FailedPrecondition,
            expected,
            &["expected"],
            &[SEEDED_LAST, 5],
        )),
        // The next sequence of a known producer, wrong condition.
        last(r(
            "next sequence, wrong expected",
            append(&["x"], Some(producer(7, 2, 4)), Some(3)),
            Code::FailedPrecondition,
            expected,
            &["expected"],
            &[SEEDED_LAST, 3],
        )),
    ]
}

/// Asserts the unary metadata of `status` is exactly what `case` names.
fn assert_metadata(case: &Refusal, status: &Status) {
    let refusal = status.metadata().get(REFUSAL_METADATA_KEY).map(|v| v.to_str().unwrap().to_string());
    assert_eq!(refusal.as_deref(), case.refusal, "{}: {REFUSAL_METADATA_KEY} of {status:?}", case.name);
    let last = status.metadata().get(LAST_SEQNO_METADATA_KEY).map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
    assert_eq!(last, case.last_seqno, "{}: {LAST_SEQNO_METADATA_KEY} of {status:?}", case.name);
}

/// Asserts the stream's `AppendFailure` is exactly what `case` names.
fn assert_failure(case: &Refusal, failure: AppendFailure) {
    assert_eq!(Code::from_i32(failure.code), case.code, "{}: code of {failure:?}", case.name);
    assert_eq!(failure.refusal, case.refusal.unwrap_or(""), "{}: refusal of {failure:?}", case.name);
    assert_eq!(failure.last_seqno, case.last_seqno.unwrap_or(0), "{}: last_seqno of {failure:?}", case.name);
    assert!(failure.leader.is_empty(), "{}: no leader named: {failure:?}", case.name);
    assert!(!failure.outcome_unknown, "{}: a refusal's outcome is known: {failure:?}", case.name);
    let message = failure.message.clone();
    assert_refused::<(), _>(case.name, Err(Status::new(case.code, message)), case.code, &case.words, &case.numbers);
}

/// After the refusals: the shard is exactly as [`seed`] left it, no
/// producer moved on, and nothing unacknowledged was written.
async fn assert_nothing_changed(node: &NodeProcess, before: &(u64, Vec<Record>)) {
    let after = shard_state(node).await;
    assert_eq!(after.0, SEEDED_LAST, "the refusals wrote nothing");
    assert_eq!(&after, before, "the shard's records are exactly as seeded");

    let mut client = connect(&node.grpc).await;
    // The newest is still 23 (the condition holds) and producer 7 epoch 2 is
    // still at sequence 3 (no gap refusal moved it, the epoch-3 refusal did
    // not fence it).
    let r = ok(&mut client, "7/2 seq 4 expecting 23", append(&["b4"], Some(producer(7, 2, 4)), Some(23))).await;
    assert_written("7/2 seq 4 expecting 23", &r, 24, 24);
    // Producers 8 and 10 are still unknown: their sequence 1 is new.
    let r = ok(&mut client, "10 seq 1", append(&["ten"], Some(producer(10, 1, 1)), None)).await;
    assert_written("producer 10 (refused conditionally before) starts at 1", &r, 25, 25);
    let r = ok(&mut client, "8 seq 1", append(&["eight"], Some(producer(8, 1, 1)), None)).await;
    assert_written("producer 8 (refused at 2 before) starts at 1", &r, 26, 26);
    // Producer 9's oldest remembered run answers as a duplicate; its next
    // is 13.
    let r = ok(&mut client, "9 retry of run 2", append(&["p9-3", "p9-4"], Some(producer(9, 1, 3)), None)).await;
    assert_duplicate("producer 9's second run, still remembered", &r, 9, 10);
    let r = ok(&mut client, "9 seq 13", append(&["p9-13"], Some(producer(9, 1, 13)), None)).await;
    assert_written("producer 9 next", &r, 27, 27);
    // And epoch 1 of producer 7 is still fenced.
    let fenced = client.append(append(&["x"], Some(producer(7, 1, 2)), None)).await;
    let status = assert_refused("still fenced", fenced, Code::FailedPrecondition, &["fenced"], &[7]);
    assert_eq!(walship_proto::refusal(&status), Some(REFUSAL_PRODUCER_FENCED));
    assert_eq!(last_seqno(node).await, 27);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_producer_and_conditional_refusals_are_exact_and_write_nothing() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut client = cluster.node(1).client().await;
    seed(&mut client).await;
    let node = cluster.node(1);
    let before = shard_state(node).await;
    assert_eq!(before.0, SEEDED_LAST);

    for case in refusals() {
        let result = client.append(case.request.clone()).await.map(|r| r.into_inner());
        let status = assert_refused(case.name, result, case.code, &case.words, &case.numbers);
        assert_metadata(&case, &status);
        assert_eq!(last_seqno(node).await, SEEDED_LAST, "{}: nothing written", case.name);
    }
    assert_nothing_changed(node, &before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_producer_and_conditional_refusals_are_exact_and_write_nothing() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut client = cluster.node(1).client().await;
    seed(&mut client).await;
    let node = cluster.node(1);
    let before = shard_state(node).await;

    // Every refusal in flight on one stream at once; each is answered on its
    // own id and the stream stays up.
    let cases = refusals();
    let (tx, rx) = mpsc::channel(cases.len() + 1);
    let mut answers = client.append_stream(ReceiverStream::new(rx)).await.unwrap().into_inner();
    for (id, case) in cases.iter().enumerate() {
        tx.send(AppendStreamRequest { request_id: 100 + id as u64, append: Some(case.request.clone()) }).await.unwrap();
    }
    let mut failures = BTreeMap::new();
    for _ in 0..cases.len() {
        let answer = tokio::time::timeout(WAIT, answers.message()).await.expect("answered in time");
        let answer = answer.expect("stream up").expect("an answer, not the end");
        match answer.result {
            Some(Answer::Failure(failure)) => {
                assert!(
                    failures.insert(answer.request_id, failure).is_none(),
                    "id {} answered twice",
                    answer.request_id
                )
            }
            other => panic!("request {} was not refused: {other:?}", answer.request_id),
        }
    }
    for (id, case) in cases.iter().enumerate() {
        let failure = failures.remove(&(100 + id as u64)).unwrap_or_else(|| panic!("{}: no answer", case.name));
        assert_failure(case, failure);
    }
    assert_eq!(last_seqno(node).await, SEEDED_LAST, "the streamed refusals wrote nothing");

    // The stream is still up: a valid conditional producer append goes
    // through on it.
    let next = append(&["on the stream"], Some(producer(9, 1, 13)), Some(SEEDED_LAST));
    tx.send(AppendStreamRequest { request_id: 1, append: Some(next) }).await.unwrap();
    let answer = tokio::time::timeout(WAIT, answers.message()).await.unwrap().unwrap().unwrap();
    assert_eq!(answer.request_id, 1);
    match answer.result {
        Some(Answer::Ok(r)) => assert_written("stream append after the refusals", &r, 24, 24),
        other => panic!("the valid append was not written: {other:?}"),
    }
    drop(tx);
    assert!(answers.message().await.unwrap().is_none(), "the stream ends cleanly");
    let after = shard_state(node).await;
    assert_eq!(after.1[..SEEDED_LAST as usize], before.1[..], "the seeded records are untouched");
    assert_eq!(stamps(&after.1[SEEDED_LAST as usize..]), vec![(24, "on the stream".into(), Some((9, 1, 13)))]);
}

// ---------------------------------------------------------------------------
// Duplicates.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_answer_their_original_seqnos_and_are_stored_once() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut client = cluster.node(1).client().await;
    let p = |sequence| Some(producer(11, 1, sequence));

    assert_written("no producer", &ok(&mut client, "plain", append(&["plain"], None, None)).await, 1, 1);
    let batch = append(&["a", "b", "c"], p(1), None);
    let first = ok(&mut client, "first attempt", batch.clone()).await;
    assert_written("first attempt", &first, 2, 4);
    assert_eq!(first.epoch, 1);

    // The same batch again, as a client retrying after a lost answer.
    let retry = ok(&mut client, "retry", batch.clone()).await;
    assert_duplicate("retry", &retry, 2, 4);
    assert_eq!(retry.epoch, 1, "the leader's epoch");
    // Identity is (id, epoch, sequences): other payloads under the same
    // sequences are the same records; the originals stay.
    let r = ok(&mut client, "retry with other payloads", append(&["A", "B", "C"], p(1), None)).await;
    assert_duplicate("retry with other payloads", &r, 2, 4);
    // A retry of part of the batch names that part's seqnos.
    let r = ok(&mut client, "retry of sequences 2..=3", append(&["b", "c"], p(2), None)).await;
    assert_duplicate("retry of sequences 2..=3", &r, 3, 4);
    // A retry with a condition that no longer holds: it was written when it
    // held, so it is a duplicate, not an expected-last refusal.
    let r = ok(&mut client, "retry with a stale condition", append(&["a", "b", "c"], p(1), Some(1))).await;
    assert_duplicate("retry with a stale condition", &r, 2, 4);
    // The same retry on AppendStream.
    let (tx, rx) = mpsc::channel(1);
    let mut answers = client.append_stream(ReceiverStream::new(rx)).await.unwrap().into_inner();
    tx.send(AppendStreamRequest { request_id: 9, append: Some(batch.clone()) }).await.unwrap();
    let answer = tokio::time::timeout(WAIT, answers.message()).await.unwrap().unwrap().unwrap();
    match answer.result {
        Some(Answer::Ok(r)) => assert_duplicate("retry on the stream", &r, 2, 4),
        other => panic!("a streamed retry should be a duplicate: {other:?}"),
    }
    drop(tx);
    assert_eq!(last_seqno(cluster.node(1)).await, 4, "no retry wrote anything");

    // A retry whose first record was written and the rest not (as after a
    // leader died mid-batch): the rest is written, the answer starts at the
    // prefix's seqno and is not a duplicate.
    let r = ok(&mut client, "overlapping retry", append(&["c", "d", "e"], p(3), None)).await;
    assert_written("overlapping retry: sequence 3 at seqno 4, 4..=5 new at 5..=6", &r, 4, 6);

    // Sixteen clients on their own connections send the same new batch at
    // once: one writes it, fifteen are told where it is.
    let grpc = cluster.node(1).grpc.clone();
    let mut clients = Vec::new();
    for _ in 0..16 {
        clients.push(connect(&grpc).await);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                ok(&mut c, "racing retry", append(&["f", "g"], Some(producer(12, 1, 1)), None)).await
            })
        })
        .collect();
    let mut fresh = 0;
    for task in tasks {
        let r = task.await.unwrap();
        assert_eq!((r.first_seqno, r.last_seqno), (7, 8), "every racer is told the same seqnos: {r:?}");
        fresh += usize::from(!r.duplicate);
    }
    assert_eq!(fresh, 1, "exactly one racer wrote the batch");

    // The log holds each record once, with its producer stamp; the record
    // written without a producer has none. Every replica agrees.
    let expected = vec![
        (1, "plain".to_string(), None),
        (2, "a".into(), Some((11, 1, 1))),
        (3, "b".into(), Some((11, 1, 2))),
        (4, "c".into(), Some((11, 1, 3))),
        (5, "d".into(), Some((11, 1, 4))),
        (6, "e".into(), Some((11, 1, 5))),
        (7, "f".into(), Some((12, 1, 1))),
        (8, "g".into(), Some((12, 1, 2))),
    ];
    assert_eq!(last_seqno(cluster.node(1)).await, 8);
    for id in 1..=3 {
        let node = cluster.node(id);
        let mut c = connect(&node.grpc).await;
        wait_until(&format!("node {id} to commit seqno 8"), WAIT, || {
            let mut c = c.clone();
            async move {
                let read = walship_proto::log::ReadRequest { shard_id: SHARD, from_seqno: 1, ..Default::default() };
                c.read(read).await.is_ok_and(|r| r.into_inner().durable_seqno >= 8)
            }
        })
        .await;
        assert_eq!(stamps(&read_all(&node.grpc, SHARD, 8).await), expected, "records on node {id}");
        // A tail carries the stamps too.
        let mut tail = c.tail(TailRequest { shard_id: SHARD, from_seqno: 1 }).await.unwrap().into_inner();
        let mut tailed = Vec::new();
        while tailed.len() < 8 {
            let batch = tokio::time::timeout(WAIT, tail.message()).await.unwrap().unwrap().expect("tail up");
            tailed.extend(batch.records);
        }
        assert_eq!(stamps(&tailed), expected, "tailed records on node {id}");
    }
}

// ---------------------------------------------------------------------------
// Epochs, across a restart.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_epoch_fences_the_old_one_from_its_first_write_and_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = NodeProcess::start(1, dir.path(), "1", &[]);
    node.wait_healthy().await;
    let mut client = node.client().await;
    let e1 = |sequence| Some(producer(21, 1, sequence));
    let e2 = |sequence| Some(producer(21, 2, sequence));

    let r = ok(&mut client, "epoch 1 seq 1..=2", append(&["e1-1", "e1-2"], e1(1), None)).await;
    assert_written("epoch 1 seq 1..=2", &r, 1, 2);
    let r = ok(&mut client, "epoch 1 seq 3", append(&["e1-3"], e1(3), None)).await;
    assert_written("epoch 1 seq 3", &r, 3, 3);

    // Epoch 2 refused before writing anything fences nothing: epoch 1 goes on.
    let refused = client.append(append(&["e2-3"], e2(3), None)).await;
    let status =
        assert_refused("epoch 2 at sequence 3", refused, Code::FailedPrecondition, &["not known"], &[21, 2, 3]);
    assert_eq!(walship_proto::refusal(&status), Some(REFUSAL_PRODUCER_UNKNOWN));
    let r = ok(&mut client, "epoch 1 seq 4 (not fenced yet)", append(&["e1-4"], e1(4), None)).await;
    assert_written("epoch 1 seq 4 (not fenced yet)", &r, 4, 4);

    // Epoch 2's first write fences epoch 1.
    let r = ok(&mut client, "epoch 2 seq 1", append(&["e2-1"], e2(1), None)).await;
    assert_written("epoch 2 seq 1", &r, 5, 5);

    let check_fenced = async |client: &mut LogClient<Channel>, node: &NodeProcess, when: &str| {
        // A late append of epoch 1 it never wrote.
        let late = client.append(append(&["e1-5"], e1(5), None)).await;
        let status =
            assert_refused(&format!("{when}: epoch 1 seq 5"), late, Code::FailedPrecondition, &["fenced"], &[21, 1, 2]);
        assert_eq!(walship_proto::refusal(&status), Some(REFUSAL_PRODUCER_FENCED), "{when}: {status:?}");
        assert!(status.metadata().get(LAST_SEQNO_METADATA_KEY).is_none(), "{when}: {status:?}");
        // A late retry of a batch epoch 1 did write: "an epoch older than one
        // the shard has seen for this id" is fenced, not a duplicate.
        let retry = client.append(append(&["e1-1", "e1-2"], e1(1), None)).await;
        let status = assert_refused(
            &format!("{when}: epoch 1 retry"),
            retry,
            Code::FailedPrecondition,
            &["fenced"],
            &[21, 1, 2],
        );
        assert_eq!(walship_proto::refusal(&status), Some(REFUSAL_PRODUCER_FENCED), "{when}: {status:?}");
        // Epoch 2 retrying its own batch is a duplicate.
        let r = ok(client, "epoch 2 retry", append(&["e2-1"], e2(1), None)).await;
        assert_duplicate(&format!("{when}: epoch 2 retry"), &r, 5, 5);
        assert_eq!(last_seqno(node).await, 5, "{when}: nothing written");
    };
    check_fenced(&mut client, &node, "before the restart").await;

    // The table is rebuilt from the log: the same answers after a crash.
    node.restart();
    node.wait_healthy().await;
    let mut client = node.client().await;
    wait_until("the restarted node to lead shard 1", WAIT, || async {
        let mut c = client.clone();
        c.append(append(&["probe"], None, Some(0))).await.is_err_and(|s| walship_proto::refusal(&s).is_some())
    })
    .await;
    check_fenced(&mut client, &node, "after the restart").await;
    let r = ok(&mut client, "epoch 2 seq 2", append(&["e2-2"], e2(2), None)).await;
    assert_written("epoch 2 seq 2 after the restart", &r, 6, 6);

    let (_, records) = shard_state(&node).await;
    let expected = vec![
        (1, "e1-1".to_string(), Some((21, 1, 1))),
        (2, "e1-2".into(), Some((21, 1, 2))),
        (3, "e1-3".into(), Some((21, 1, 3))),
        (4, "e1-4".into(), Some((21, 1, 4))),
        (5, "e2-1".into(), Some((21, 2, 1))),
        (6, "e2-2".into(), Some((21, 2, 2))),
    ];
    assert_eq!(stamps(&records), expected);
}

// ---------------------------------------------------------------------------
// Bounds and failovers.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_producer_is_unknown_and_its_retry_is_not_written_twice() {
    let mut cluster = Cluster::launch(&common::ClusterSpec {
        nodes: 3,
        shards: 1,
        replication: "keepalive_ms = 100",
        cluster_toml: "[producers]\nmax_per_shard = 2\n".into(),
        ..common::ClusterSpec::default()
    });
    let mut client = cluster.node(1).client().await;
    let r = ok(&mut client, "31 seq 1..=2", append(&["a1", "a2"], Some(producer(31, 1, 1)), None)).await;
    assert_written("31 seq 1..=2", &r, 1, 2);
    let r = ok(&mut client, "32 seq 1", append(&["b1"], Some(producer(32, 1, 1)), None)).await;
    assert_written("32 seq 1", &r, 3, 3);
    // A third producer past max_per_shard = 2 evicts the least recently
    // written, 31.
    let r = ok(&mut client, "33 seq 1", append(&["c1"], Some(producer(33, 1, 1)), None)).await;
    assert_written("33 seq 1", &r, 4, 4);

    // 31's late retry of its sequence 2 and its next sequence: unknown, not
    // written (again).
    for (what, request) in [
        ("a retry of an evicted producer's record", append(&["a2"], Some(producer(31, 1, 2)), None)),
        ("an evicted producer's next record", append(&["a3"], Some(producer(31, 1, 3)), None)),
    ] {
        let status =
            assert_refused(what, client.append(request).await, Code::FailedPrecondition, &["not known"], &[31]);
        assert_eq!(walship_proto::refusal(&status), Some(REFUSAL_PRODUCER_UNKNOWN), "{what}: {status:?}");
        assert_eq!(last_seqno(cluster.node(1)).await, 4, "{what}: nothing written");
    }
    // The producers still remembered deduplicate as before.
    let r = ok(&mut client, "32 retry", append(&["b1"], Some(producer(32, 1, 1)), None)).await;
    assert_duplicate("32 retry", &r, 3, 3);
    let r = ok(&mut client, "33 retry", append(&["c1"], Some(producer(33, 1, 1)), None)).await;
    assert_duplicate("33 retry", &r, 4, 4);
    let (last, records) = shard_state(cluster.node(1)).await;
    assert_eq!(last, 4);
    assert_eq!(
        stamps(&records),
        vec![
            (1, "a1".to_string(), Some((31, 1, 1))),
            (2, "a2".into(), Some((31, 1, 2))),
            (3, "b1".into(), Some((32, 1, 1))),
            (4, "c1".into(), Some((33, 1, 1))),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_deduplicates_and_fences_as_the_old_one_did() {
    let mut cluster = Cluster::start_with(3, 1, 1, common::history::FAST, None);
    common::history::wait_leading(&mut cluster, SHARD, 1).await;
    let mut old = cluster.node(1).client().await;
    let batch = append(&["x1", "x2", "x3"], Some(producer(41, 1, 1)), None);
    assert_written("41 seq 1..=3", &ok(&mut old, "41 seq 1..=3", batch.clone()).await, 1, 3);
    let r = ok(&mut old, "42/1 seq 1", append(&["y1"], Some(producer(42, 1, 1)), None)).await;
    assert_written("42/1 seq 1", &r, 4, 4);
    let r = ok(&mut old, "42/2 seq 1", append(&["z1"], Some(producer(42, 2, 1)), None)).await;
    assert_written("42/2 seq 1", &r, 5, 5);
    // Every replica has it all before the leader dies.
    for id in 2..=3 {
        let grpc = cluster.node(id).grpc.clone();
        wait_until(&format!("node {id} to commit seqno 5"), WAIT, || {
            let grpc = grpc.clone();
            async move {
                let mut c = connect(&grpc).await;
                let read = walship_proto::log::ReadRequest { shard_id: SHARD, from_seqno: 1, ..Default::default() };
                c.read(read).await.is_ok_and(|r| r.into_inner().durable_seqno >= 5)
            }
        })
        .await;
    }

    cluster.node(1).kill9();
    let leader = cluster.wait_leader(SHARD, Some(1), WAIT).await;
    let mut new = cluster.node(leader).client().await;
    // The client retries its batch on the new leader: the original seqnos.
    let r = ok(&mut new, "41 retry on the new leader", batch).await;
    assert_duplicate("41 retry on the new leader", &r, 1, 3);
    // Epoch 1 of 42 is still fenced; 41's next is still 4.
    let fenced = new.append(append(&["y2"], Some(producer(42, 1, 2)), None)).await;
    let status = assert_refused("42/1 on the new leader", fenced, Code::FailedPrecondition, &["fenced"], &[42, 2]);
    assert_eq!(walship_proto::refusal(&status), Some(REFUSAL_PRODUCER_FENCED));
    let gap = new.append(append(&["x5"], Some(producer(41, 1, 5)), None)).await;
    let status = assert_refused("41 gap on the new leader", gap, Code::OutOfRange, &["gap"], &[5, 4]);
    assert_eq!(walship_proto::refusal(&status), Some(REFUSAL_PRODUCER_SEQUENCE));
    assert_eq!(last_seqno(cluster.node(leader)).await, 5, "nothing written by the retries and refusals");
    let r = ok(&mut new, "41 seq 4", append(&["x4"], Some(producer(41, 1, 4)), Some(5))).await;
    assert_written("41 seq 4 on the new leader", &r, 6, 6);
    let (_, records) = shard_state(cluster.node(leader)).await;
    let payloads: Vec<String> = stamps(&records).into_iter().map(|(_, p, _)| p).collect();
    assert_eq!(payloads, ["x1", "x2", "x3", "y1", "z1", "x4"], "each record once");
}

/// A producer pipelining its batches on one `AppendStream`, in sequence
/// order, as the stream invites ("for clients with many appends in
/// flight"): every batch is written, in the order sent. The node's WAL
/// stages at most 64 KiB (`wal.max_batch_bytes`), so with 16 KB batches
/// pipelined appends are held back there all the time; before the WAL
/// waited for room under its (fair) sequencer lock, a batch finding room
/// overtook earlier ones still waiting and was refused as a gap. (Small:
/// the disk is shared with the failover tests running beside it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_pipelining_on_one_stream_is_written_in_the_order_sent() {
    const BATCHES: u64 = 500;
    const SIZE: usize = 16_000;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    let data = dir.path().join("data");
    std::fs::write(&config, format!("node_id = 1\ndata_dir = {data:?}\n[wal]\nmax_batch_bytes = 65536\n")).unwrap();
    let node = NodeProcess::start(1, &data, "1", &["--config", config.to_str().unwrap()]);
    node.wait_healthy().await;
    let mut client = node.client().await;
    for round in 0..2u64 {
        let id = 60 + round;
        let (tx, rx) = mpsc::channel(64);
        let mut answers = client.append_stream(ReceiverStream::new(rx)).await.unwrap().into_inner();
        let sender = tokio::spawn(async move {
            for sequence in 1..=BATCHES {
                let append = AppendRequest {
                    shard_id: SHARD,
                    records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(vec![b'p'; SIZE]) }],
                    durability: Durability::Local as i32,
                    producer: Some(producer(id, 1, sequence)),
                    expected_last_seqno: None,
                };
                tx.send(AppendStreamRequest { request_id: sequence, append: Some(append) }).await.unwrap();
            }
        });
        let mut written = BTreeMap::new();
        let mut refused = Vec::new();
        for _ in 0..BATCHES {
            let answer = tokio::time::timeout(WAIT, answers.message()).await.expect("answered in time");
            let answer = answer.expect("stream up").expect("an answer");
            match answer.result {
                Some(Answer::Ok(r)) => {
                    written.insert(answer.request_id, r.first_seqno);
                }
                Some(Answer::Failure(f)) => refused.push((answer.request_id, f.refusal, f.message)),
                None => panic!("an answer without a result"),
            }
        }
        sender.await.unwrap();
        assert!(
            refused.is_empty(),
            "round {round}: {} of {BATCHES} batches sent in sequence order were refused, e.g. {:?}",
            refused.len(),
            refused.iter().min_by_key(|(id, _, _)| *id)
        );
        let seqnos: Vec<u64> = written.values().copied().collect();
        let first = round * BATCHES + 1;
        assert_eq!(seqnos, (first..first + BATCHES).collect::<Vec<_>>(), "round {round}: written in the order sent");
    }
}

// ---------------------------------------------------------------------------
// Conditional appends.
// ---------------------------------------------------------------------------

/// Asserts an expected-last refusal naming `last` as the shard's newest.
fn assert_expected_last(what: &str, result: Result<AppendResponse, Status>, expected: u64, last: u64) {
    let status = assert_refused(what, result, Code::FailedPrecondition, &["expected"], &[expected, last]);
    assert_eq!(walship_proto::refusal(&status), Some(REFUSAL_EXPECTED_LAST), "{what}: {status:?}");
    assert_eq!(walship_proto::refused_last_seqno(&status), Some(last), "{what}: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_appends_let_exactly_one_racer_through() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut client = cluster.node(1).client().await;
    let grpc = cluster.node(1).grpc.clone();

    // An empty shard: expecting anything but 0 is refused, naming 0.
    for wrong in [1, 2, u64::MAX] {
        let result = client.append(append(&["x"], None, Some(wrong))).await.map(|r| r.into_inner());
        assert_expected_last(&format!("expecting {wrong} of an empty shard"), result, wrong, 0);
    }
    assert_eq!(last_seqno(cluster.node(1)).await, 0, "nothing written");
    let r = ok(&mut client, "expecting 0 of an empty shard", append(&["first"], None, Some(0))).await;
    assert_written("expecting 0 of an empty shard", &r, 1, 1);
    let again = client.append(append(&["again"], None, Some(0))).await.map(|r| r.into_inner());
    assert_expected_last("expecting 0 again", again, 0, 1);
    // The expected value covers the whole batch: it is about the newest
    // before it, not the batch's own last.
    let batch = client.append(append(&["x", "y"], None, Some(3))).await.map(|r| r.into_inner());
    assert_expected_last("a batch expecting its own last", batch, 3, 1);
    let r = ok(&mut client, "a batch expecting 1", append(&["second", "third"], None, Some(1))).await;
    assert_written("a batch expecting 1", &r, 2, 3);

    // Rounds of 16 clients, each on its own connection, expecting the same
    // newest seqno at once: exactly one is written, the others are refused
    // naming the winner's seqno.
    let mut clients = Vec::new();
    for _ in 0..16 {
        clients.push(connect(&grpc).await);
    }
    let mut winners = Vec::new();
    for round in 0..5u64 {
        let n = 3 + round;
        let barrier = Arc::new(tokio::sync::Barrier::new(clients.len()));
        let tasks: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (mut c, barrier) = (c.clone(), barrier.clone());
                let payload = format!("round {round} racer {i}");
                tokio::spawn(async move {
                    let request = append(&[&payload], None, Some(n));
                    barrier.wait().await;
                    (payload, c.append(request).await.map(|r| r.into_inner()))
                })
            })
            .collect();
        let mut won = Vec::new();
        for task in tasks {
            let (payload, result) = task.await.unwrap();
            match result {
                Ok(r) => {
                    assert_written(&format!("round {round}: the winner"), &r, n + 1, n + 1);
                    won.push(payload);
                }
                Err(status) => assert_expected_last(&format!("round {round}: a loser"), Err(status), n, n + 1),
            }
        }
        assert_eq!(won.len(), 1, "round {round}: exactly one racer written: {won:?}");
        assert_eq!(last_seqno(cluster.node(1)).await, n + 1, "round {round}: exactly one more record");
        winners.push(won.remove(0));
    }

    // The same race pipelined on one stream.
    let (tx, rx) = mpsc::channel(16);
    let mut answers = client.append_stream(ReceiverStream::new(rx)).await.unwrap().into_inner();
    for id in 0..16u64 {
        tx.send(AppendStreamRequest {
            request_id: id,
            append: Some(append(&[&format!("streamed {id}")], None, Some(8))),
        })
        .await
        .unwrap();
    }
    let mut streamed_winner = Vec::new();
    for _ in 0..16 {
        let answer = tokio::time::timeout(WAIT, answers.message()).await.unwrap().unwrap().unwrap();
        match answer.result {
            Some(Answer::Ok(r)) => {
                assert_written("the streamed winner", &r, 9, 9);
                streamed_winner.push(format!("streamed {}", answer.request_id));
            }
            Some(Answer::Failure(f)) => {
                assert_eq!(Code::from_i32(f.code), Code::FailedPrecondition, "{f:?}");
                assert_eq!(f.refusal, REFUSAL_EXPECTED_LAST, "{f:?}");
                assert_eq!(f.last_seqno, 9, "names the winner's seqno: {f:?}");
                assert!(numbers_in(&f.message).contains(&9), "{f:?}");
            }
            None => panic!("an answer without a result"),
        }
    }
    drop(tx);
    assert_eq!(streamed_winner.len(), 1, "exactly one streamed racer written");

    let (last, records) = shard_state(cluster.node(1)).await;
    assert_eq!(last, 9);
    let payloads: Vec<String> = stamps(&records).into_iter().map(|(_, p, _)| p).collect();
    let mut expected = vec!["first".to_string(), "second".into(), "third".into()];
    expected.extend(winners);
    expected.extend(streamed_winner);
    assert_eq!(payloads, expected, "the shard holds exactly the winners");
    assert!(records.iter().all(|r| r.producer.is_none()), "written without a producer: no stamp");
}

// ---------------------------------------------------------------------------
// The CLI.
// ---------------------------------------------------------------------------

/// `walship append` to shard 1 of `server` with `args`, JSON output.
async fn cli_append(server: &str, args: &[&str], stdin: &str) -> Output {
    let mut all = vec!["append", "--server", server, "--shard", "1", "--json"];
    all.extend_from_slice(args);
    run(walship(&all), Some(stdin)).await
}

/// The acknowledged batches a successful `--json` append printed, as
/// (first, last, duplicate).
fn acknowledged(output: &Output) -> Vec<(u64, u64, bool)> {
    assert_eq!(output.status.code(), Some(0), "{}", describe(output));
    json_lines(output)
        .iter()
        .map(|l| {
            assert_eq!(l["outcome"], "acknowledged", "{l}");
            (l["first_seqno"].as_u64().unwrap(), l["last_seqno"].as_u64().unwrap(), l["duplicate"].as_bool().unwrap())
        })
        .collect()
}

/// Asserts a `--json` conflict (exit 13) whose message names `newest`
/// (numbers of the server address aside).
fn assert_conflict(output: &Output, server: &str, newest: u64) {
    assert_eq!(output.status.code(), Some(13), "conflict exit code: {}", describe(output));
    let text = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON object on stderr: {}", describe(output));
    let error: Value = serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("stderr not JSON ({e}): {text}"));
    assert_eq!(error["error"]["kind"], "conflict", "{error}");
    assert_eq!(error["error"]["exit_code"], 13, "{error}");
    let message = error["error"]["message"].as_str().expect("message").replace(server, "");
    assert!(numbers_in(&message).contains(&newest), "the message names the newest seqno {newest}: {error}");
    assert!(json_lines(output).is_empty(), "nothing acknowledged: {}", describe(output));
}

/// Asserts a usage error (exit 2) mentioning `flag`.
fn assert_usage(output: &Output, flag: &str) {
    assert_eq!(output.status.code(), Some(2), "usage error: {}", describe(output));
    assert!(String::from_utf8_lossy(&output.stderr).contains(flag), "names {flag}: {}", describe(output));
    assert!(output.stdout.is_empty(), "nothing appended: {}", describe(output));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_expect_last_and_producer_flags() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1", &[]);
    node.wait_healthy().await;
    let server = node.grpc.as_str();

    // --expect-last on an empty shard: a wrong value is a conflict naming 0.
    let wrong = cli_append(server, &["--expect-last", "5"], "x\n").await;
    assert_conflict(&wrong, server, 0);
    assert_eq!(last_seqno(&node).await, 0, "nothing written");
    // In text too: exit 13, "conflict", the newest seqno.
    let text = run(walship(&["append", "--server", server, "--shard", "1", "--expect-last", "7"]), Some("x\n")).await;
    assert_eq!(text.status.code(), Some(13), "{}", describe(&text));
    let stderr = String::from_utf8_lossy(&text.stderr).replace(server, "");
    assert!(stderr.contains("conflict") && numbers_in(&stderr).contains(&0), "{}", describe(&text));
    assert_eq!(last_seqno(&node).await, 0, "nothing written");

    // The right value appends; each later batch expects the previous one's
    // last seqno.
    let right = cli_append(server, &["--expect-last", "0", "--batch", "2"], "a\nb\nc\n").await;
    assert_eq!(acknowledged(&right), vec![(1, 2, false), (3, 3, false)]);
    let stale = cli_append(server, &["--expect-last", "2"], "late\n").await;
    assert_conflict(&stale, server, 3);
    let r = cli_append(server, &["--expect-last", "3"], "d\n").await;
    assert_eq!(acknowledged(&r), vec![(4, 4, false)]);

    // A stable producer id: epoch 1, then epoch 2 takes over; epoch 1 is
    // then a conflict (fenced); epoch 2 run again from sequence 1 is a
    // duplicate of its first run, whatever the lines say.
    let e1 = cli_append(server, &["--producer-id", "5", "--producer-epoch", "1"], "p5e1\n").await;
    assert_eq!(acknowledged(&e1), vec![(5, 5, false)]);
    let e2 =
        cli_append(server, &["--producer-id", "5", "--producer-epoch", "2", "--batch", "1"], "p5e2-1\np5e2-2\n").await;
    assert_eq!(acknowledged(&e2), vec![(6, 6, false), (7, 7, false)]);
    let fenced = cli_append(server, &["--producer-id", "5", "--producer-epoch", "1"], "p5e1 late\n").await;
    assert_eq!(fenced.status.code(), Some(13), "a fenced producer is a conflict: {}", describe(&fenced));
    assert!(String::from_utf8_lossy(&fenced.stderr).contains("fenced"), "{}", describe(&fenced));
    let again = cli_append(server, &["--producer-id", "5", "--producer-epoch", "2"], "other\n").await;
    assert_eq!(acknowledged(&again), vec![(6, 6, true)]);
    assert_eq!(last_seqno(&node).await, 7);

    // Bad flag combinations are usage errors, before anything is sent.
    assert_usage(&cli_append(server, &["--producer-epoch", "3"], "x\n").await, "--producer-id");
    assert_usage(&cli_append(server, &["--producer-id", "0"], "x\n").await, "--producer-id");
    assert_usage(
        &cli_append(server, &["--producer-id", "5", "--producer-epoch", "0"], "x\n").await,
        "--producer-epoch",
    );
    assert_usage(&cli_append(server, &["--producer-id", "5", "--no-producer"], "x\n").await, "--no-producer");
    assert_usage(&cli_append(server, &["--expect-last=-1"], "x\n").await, "--expect-last");
    assert_eq!(last_seqno(&node).await, 7, "usage errors wrote nothing");

    // --no-producer writes unstamped records; the default is a random
    // producer at epoch 1 numbering its records from 1 across batches.
    let plain = cli_append(server, &["--no-producer"], "np\n").await;
    assert_eq!(acknowledged(&plain), vec![(8, 8, false)]);
    let default = cli_append(server, &["--batch", "1"], "r1\nr2\n").await;
    assert_eq!(acknowledged(&default), vec![(9, 9, false), (10, 10, false)]);

    let (last, records) = shard_state(&node).await;
    assert_eq!(last, 10);
    let got = stamps(&records);
    let payloads: Vec<(u64, &str)> = got.iter().map(|(s, p, _)| (*s, p.as_str())).collect();
    let want = ["a", "b", "c", "d", "p5e1", "p5e2-1", "p5e2-2", "np", "r1", "r2"];
    assert_eq!(payloads, (1..=10).zip(want).collect::<Vec<_>>());
    let stamp = |seqno: usize| got[seqno - 1].2.unwrap_or_else(|| panic!("seqno {seqno} has no producer: {got:?}"));
    // One default run, one random producer at epoch 1: a, b, c numbered
    // 1..=3 across two batches; d is another run's, a new producer.
    let run = stamp(1).0;
    assert_eq!([stamp(1), stamp(2), stamp(3)], [(run, 1, 1), (run, 1, 2), (run, 1, 3)], "{got:?}");
    assert_eq!((stamp(4).1, stamp(4).2), (1, 1), "{got:?}");
    assert_ne!(stamp(4).0, run, "each run is a new producer: {got:?}");
    let random = stamp(9).0;
    assert_ne!(random, run, "{got:?}");
    assert_eq!([stamp(5), stamp(6), stamp(7)], [(5, 1, 1), (5, 2, 1), (5, 2, 2)], "{got:?}");
    assert_eq!(got[7].2, None, "--no-producer: no stamp");
    assert_eq!([stamp(9), stamp(10)], [(random, 1, 1), (random, 1, 2)], "{got:?}");
}
