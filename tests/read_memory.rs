//! A node's read memory budget against callers that ask and never take the
//! answer: a raw HTTP/2 client keeps every stream's flow-control window shut,
//! so the node can send nothing of the `Read` answers it built. Without the
//! budget each such read pins its whole answer (up to 32 MiB) for as long as
//! the stream stays open; with it, a real `walship node` process holds at
//! most `--read-memory-bytes` of them, refuses the rest `RESOURCE_EXHAUSTED`
//! naming the limit, and serves reads again once the stalled caller goes.

mod common;

use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use common::NodeProcess;
use prost::Message;
use tonic::Code;
use tonic::transport::Endpoint;
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest};

const MIB: usize = 1 << 20;
/// The node's budget in this test.
const BUDGET: usize = 8 * MIB;
/// What each stalled read asks for.
const ASK: u64 = 4 * MIB as u64;

/// A gRPC message frame: not compressed, 4-byte big-endian length.
fn grpc_frame(message: &impl Message) -> Bytes {
    let body = message.encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + body.len());
    frame.put_u8(0);
    frame.put_u32(body.len() as u32);
    frame.put_slice(&body);
    frame.freeze()
}

/// An HTTP/2 connection that never opens its streams' receive windows.
async fn stalled_connection(grpc: &str) -> (h2::client::SendRequest<Bytes>, tokio::task::JoinHandle<()>) {
    let tcp = tokio::net::TcpStream::connect(grpc).await.expect("connect");
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(0)
        .max_concurrent_streams(1000)
        .handshake::<_, Bytes>(tcp)
        .await
        .expect("HTTP/2 handshake");
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    (send, driver)
}

/// A stalled `Read`: its response headers, and both halves of its stream
/// (dropping either would reset the stream and free the answer).
struct Stalled {
    /// grpc-status of the response headers: `None` when the node answered
    /// with a body (built, waiting for the window), `Some(code)` for a
    /// trailers-only refusal.
    status: Option<i32>,
    _response: http::Response<h2::RecvStream>,
    _request: h2::SendStream<Bytes>,
}

/// Sends a `Read` of [`ASK`] bytes on `send` and never reads the answer.
async fn stalled_read(send: h2::client::SendRequest<Bytes>, grpc: &str, timeout: &str) -> Stalled {
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{grpc}/walship.v1.Log/Read"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", timeout)
        .body(())
        .unwrap();
    let read = ReadRequest { shard_id: 1, from_seqno: 1, max_bytes: ASK, ..Default::default() };
    let mut ready = send.ready().await.expect("stream slot");
    let (response, mut body) = ready.send_request(request, false).expect("send headers");
    body.send_data(grpc_frame(&read), true).expect("send message");
    let response = response.await.expect("response headers");
    assert_eq!(response.status(), 200);
    let status = response.headers().get("grpc-status").map(|v| v.to_str().unwrap().parse().unwrap());
    Stalled { status, _response: response, _request: body }
}

fn peak_rss(node: &NodeProcess) -> u64 {
    common::proc_status_bytes(node.child.id(), "VmHWM")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_no_caller_takes_hold_at_most_the_read_memory_budget_and_the_rest_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    let toml = format!(
        "node_id = 1\ndata_dir = {:?}\n[limits]\nmax_read_bytes = {ASK}\nread_memory_bytes = {BUDGET}\n",
        dir.path().join("data")
    );
    std::fs::write(&config, toml).unwrap();
    let node = NodeProcess::start(1, &dir.path().join("data"), "1", &["--config", config.to_str().unwrap()]);
    node.wait_healthy().await;
    let channel = Endpoint::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();
    let mut client = LogClient::new(channel).max_decoding_message_size(64 * MIB);
    // 16 MiB in the shard: every stalled read has a full 4 MiB answer.
    for _ in 0..16 {
        let records = (0..16).map(|_| AppendRecord { key: Bytes::new(), payload: vec![7u8; 64 << 10].into() });
        client
            .append(AppendRequest {
                shard_id: 1,
                records: records.collect(),
                durability: Durability::Local as i32,
                ..Default::default()
            })
            .await
            .expect("append");
    }
    let full = ReadRequest { shard_id: 1, from_seqno: 1, max_bytes: ASK, ..Default::default() };
    let first = client.read(full).await.expect("a read with room").into_inner();
    assert!(first.records.len() >= 60, "a 4 MiB answer: {} records", first.records.len());
    let before = peak_rss(&node);

    // 40 reads of 4 MiB that nobody takes: room for two of them.
    let (send, driver) = stalled_connection(&node.grpc).await;
    let started = Instant::now();
    let stalled = futures::future::join_all((0..40).map(|_| stalled_read(send.clone(), &node.grpc, "2S"))).await;
    let answers: Vec<Option<i32>> = stalled.iter().map(|s| s.status).collect();
    let held = answers.iter().filter(|a| a.is_none()).count();
    let refused = answers.iter().filter(|a| **a == Some(Code::ResourceExhausted as i32)).count();
    assert_eq!((held, refused), (2, 38), "answers held and refused: {answers:?}");
    assert!(started.elapsed() < Duration::from_secs(20), "the refusals waited {:?}", started.elapsed());
    let grew = peak_rss(&node).saturating_sub(before);
    // Two held answers (8 MiB) and what building a refused one never
    // reached; 40 answers held would be 160 MiB.
    assert!(grew < 64 * MIB as u64, "peak RSS grew by {} MiB", grew >> 20);

    let held_bytes = held_gauge(&node).await;
    assert!(held_bytes > 2 * 4_000_000 && held_bytes <= BUDGET as u64, "held {held_bytes} bytes");

    // A well-behaved caller is refused while the budget is held, with a
    // message naming the limit.
    let mut call = tonic::Request::new(ReadRequest { max_bytes: MIB as u64, ..full });
    call.set_timeout(Duration::from_secs(2));
    let Err(status) = client.read(call).await else { panic!("a 1 MiB read found room beside the stalled answers") };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("read_memory_bytes"), "{}", status.message());
    assert!(status.message().contains(&BUDGET.to_string()), "{}", status.message());

    // A Tail's batch takes room in the same budget: it waits for it.
    let mut tail = client
        .tail(walship_proto::log::TailRequest { shard_id: 1, from_seqno: 1 })
        .await
        .expect("a tail opens")
        .into_inner();
    let waited = tokio::time::timeout(Duration::from_millis(500), tail.message()).await;
    assert!(waited.is_err(), "a tail batch was built with no room in the budget: {:?}", waited.map(|m| m.is_ok()));

    // The stalled caller goes: its answers' room comes back.
    drop((stalled, send));
    driver.abort();
    let batch = tokio::time::timeout(Duration::from_secs(10), tail.message())
        .await
        .expect("the tail's batch once room came back")
        .expect("a tail batch")
        .expect("the tail goes on");
    assert_eq!(batch.records.first().map(|r| r.seqno), Some(1));
    drop(tail);
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        match client.read(full).await {
            Ok(answer) => break answer.into_inner(),
            Err(status) if status.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(status) => panic!("reading after the stalled caller left: {status}"),
        }
    };
    assert_eq!(again, first, "the same answer as before the stalled reads");
    common::wait_until("the read memory budget to hold nothing", Duration::from_secs(10), || async {
        held_gauge(&node).await == 0
    })
    .await;
}

/// `walship_read_memory_held_bytes` of `node`.
async fn held_gauge(node: &NodeProcess) -> u64 {
    let (code, body) = common::http_get(&format!("{}/metrics", node.admin)).await;
    assert_eq!(code, 200);
    body.lines()
        .find_map(|l| l.strip_prefix("walship_read_memory_held_bytes "))
        .expect("walship_read_memory_held_bytes in /metrics")
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_node_refuses_a_read_memory_budget_smaller_than_the_largest_read() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(common::walship_bin())
        .args(["node", "--node-id", "1", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--shards", "1"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args(["--read-memory-bytes", "1048576"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the node started");
    for word in ["read_memory_bytes", "1048576", "max_read_bytes", "33554432"] {
        assert!(stderr.contains(word), "{word} missing: {stderr}");
    }
}
