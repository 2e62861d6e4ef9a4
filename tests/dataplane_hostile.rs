//! The DataPlane against hostile and stuck workers, over real sockets to a
//! real `walship coord` (and a real node where one is needed):
//!
//! * garbage frames on `DataPlane/Connect`, first or after a valid Hello:
//!   the stream ends with `INVALID_ARGUMENT` naming the protobuf decoding,
//!   and nothing else changes;
//! * an export batch whose payload is not Arrow IPC: the job fails naming
//!   the payload, and the coordinator carries on;
//! * negative and shrinking counters: ignored, progress stays monotonic;
//! * a worker that says Hello with a huge capacity and then never reads its
//!   stream: the coordinator's memory stays bounded, dispatch to healthy
//!   workers goes on, an operator's cancel answers;
//! * oversized Hello fields are refused.
//!
//! Every test starts its own processes and kills them when it ends
//! (`CoordProcess` and `Cluster` kill on drop, also on a failed assertion).

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Cluster, CoordProcess, SECRET, TOKEN, wait_until};
use prost::Message;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};
use walship_proto::dataplane::coord_envelope::Msg as Down;
use walship_proto::dataplane::data_plane_client::DataPlaneClient;
use walship_proto::dataplane::worker_envelope::Msg as Up;
use walship_proto::dataplane::{CoordEnvelope, Hello, ResultBatch, TaskDispatch, TaskProgress, WorkerEnvelope};

const WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------- helpers

/// A lone `walship coord` whose cluster declares node 1 (the replica of
/// shard 1) without starting it: a fake worker that says Hello as `node-1`
/// takes the tasks aimed at that node, exports included.
struct Lone {
    coord: CoordProcess,
    _dir: tempfile::TempDir,
}

impl Lone {
    async fn start(extra: &[&str]) -> Lone {
        let dir = tempfile::tempdir().unwrap();
        let (grpc, admin, node) = (common::free_port(), common::free_port(), common::free_port());
        let config = dir.path().join("cluster.toml");
        std::fs::write(
            &config,
            format!(
                "secret = \"{SECRET}\"\n[[coordinators]]\nid = \"c1\"\ngrpc_addr = \"127.0.0.1:{grpc}\"\nadmin_addr = \"127.0.0.1:{admin}\"\n\
                 [[nodes]]\nid = 1\ngrpc_addr = \"127.0.0.1:{node}\"\nadmin_addr = \"127.0.0.1:{}\"\n\
                 [[shards]]\nid = 1\nreplicas = [1]\nleader = 1\n",
                common::free_port()
            ),
        )
        .unwrap();
        let (child, fields) = common::spawn_listening(
            std::process::Command::new(common::walship_bin())
                .args(["coord", "--id", "c1", "--admin-token", TOKEN])
                .args(extra)
                .arg("--cluster")
                .arg(&config)
                .arg("--data-dir")
                .arg(dir.path().join("coord")),
            "coordinator",
        );
        let coord = CoordProcess { child, admin: fields["admin"].clone(), grpc: fields["grpc"].clone(), id: 1 };
        let lone = Lone { coord, _dir: dir };
        let admin = lone.admin().to_string();
        wait_until("the lone coordinator to be active", WAIT, || {
            let admin = admin.clone();
            async move { get(&admin, "/v1/cluster").await.1["coordinator"]["active"] == true }
        })
        .await;
        lone
    }

    fn admin(&self) -> &str {
        &self.coord.admin
    }

    fn grpc(&self) -> &str {
        &self.coord.grpc
    }

    fn pid(&self) -> u32 {
        self.coord.child.id()
    }
}

async fn get(admin: &str, path: &str) -> (u16, Value) {
    let (code, body) = common::http_get(&format!("{admin}{path}")).await;
    (code, serde_json::from_str(&body).unwrap_or(Value::Null))
}

async fn post(admin: &str, path: &str, body: &Value) -> (u16, Value) {
    let (code, body) = common::http_post(&format!("{admin}{path}"), &body.to_string(), Some(TOKEN)).await;
    (code, serde_json::from_str(&body).unwrap_or(Value::Null))
}

async fn workers(admin: &str) -> Vec<String> {
    let (code, view) = get(admin, "/v1/cluster").await;
    assert_eq!(code, 200, "{view}");
    worker_ids(&view)
}

/// The workers, or `None` while the coordinator cannot say yet (503 until
/// the cluster state is first written).
async fn workers_now(admin: &str) -> Option<Vec<String>> {
    let (code, view) = get(admin, "/v1/cluster").await;
    (code == 200).then(|| worker_ids(&view))
}

fn worker_ids(view: &Value) -> Vec<String> {
    view["workers"]
        .as_array()
        .map_or(Vec::new(), |w| w.iter().map(|w| w["worker_id"].as_str().unwrap_or_default().to_string()).collect())
}

async fn counter(admin: &str, name: &str) -> u64 {
    let (code, view) = get(admin, "/v1/cluster").await;
    assert_eq!(code, 200, "{view}");
    view["dataplane"][name].as_u64().unwrap_or_else(|| panic!("no dataplane.{name} in {view}"))
}

async fn task(admin: &str, id: &str) -> Value {
    let (code, view) = get(admin, &format!("/v1/tasks/{id}")).await;
    assert_eq!(code, 200, "{view}");
    view
}

async fn wait_state(admin: &str, id: &str, states: &[&str]) -> Value {
    let mut last = Value::Null;
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        last = task(admin, id).await;
        if states.iter().any(|s| last["state"] == *s) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("task {id} never reached {states:?}: {last}");
}

/// Starts a job; answers its query id and task ids.
async fn submit(admin: &str, body: Value) -> (String, Vec<String>) {
    let (code, answer) = post(admin, "/v1/tasks", &body).await;
    assert_eq!(code, 202, "{body} -> {answer}");
    let ids = answer["task_ids"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
    (answer["query_id"].as_str().unwrap().to_string(), ids)
}

/// (task id, state, attempts, node) of every task, oldest first.
async fn task_table(admin: &str) -> Vec<(String, String, u64, Value)> {
    let (code, page) = get(admin, "/v1/tasks?limit=1000").await;
    assert_eq!(code, 200, "{page}");
    page["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["task_id"].as_str().unwrap().to_string(),
                t["state"].as_str().unwrap().to_string(),
                t["attempts"].as_u64().unwrap(),
                t["node"].clone(),
            )
        })
        .collect()
}

async fn channel(grpc: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap()
}

async fn member(grpc: &str) -> DataPlaneClient<common::Member> {
    DataPlaneClient::new(common::as_member(channel(grpc).await))
}

fn hello(id: &str, build_sha: &str, num_cpus: i32) -> WorkerEnvelope {
    WorkerEnvelope {
        msg: Some(Up::Hello(Hello { worker_id: id.into(), build_sha: build_sha.into(), num_cpus, gomemlimit: 0 })),
    }
}

fn this_build() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// A hand-rolled worker that has said Hello and read its Welcome.
struct Fake {
    id: String,
    tx: mpsc::Sender<WorkerEnvelope>,
    inbound: Streaming<CoordEnvelope>,
}

impl Fake {
    async fn connect(grpc: &str, id: &str, num_cpus: i32) -> Fake {
        Fake::connect_with(grpc, hello(id, this_build(), num_cpus)).await
    }

    /// Connects with the build id `build_sha`.
    async fn connect_as(grpc: &str, id: &str, build_sha: &str) -> Fake {
        Fake::connect_with(grpc, hello(id, build_sha, 1)).await
    }

    async fn connect_with(grpc: &str, hello: WorkerEnvelope) -> Fake {
        let Some(Up::Hello(Hello { worker_id: id, .. })) = hello.msg.clone() else { panic!("not a Hello") };
        let (tx, rx) = mpsc::channel(64);
        tx.send(hello).await.unwrap();
        let mut inbound = member(grpc).await.connect(ReceiverStream::new(rx)).await.expect("connect").into_inner();
        let first = tokio::time::timeout(WAIT, inbound.message()).await.expect("a Welcome in time");
        assert!(matches!(&first, Ok(Some(CoordEnvelope { msg: Some(Down::Welcome(_)) }))), "{first:?}");
        Fake { id, tx, inbound }
    }

    async fn send(&self, msg: Up) {
        self.tx.send(WorkerEnvelope { msg: Some(msg) }).await.expect("the stream is up");
    }

    /// The next message down, within `wait`.
    async fn next(&mut self, wait: Duration) -> Option<Result<CoordEnvelope, Status>> {
        tokio::time::timeout(wait, self.inbound.message()).await.ok().and_then(Result::transpose)
    }

    async fn next_dispatch(&mut self) -> TaskDispatch {
        loop {
            match self.next(WAIT).await {
                Some(Ok(CoordEnvelope { msg: Some(Down::TaskDispatch(d)) })) => return d,
                Some(Ok(_)) => continue,
                other => panic!("{}: no TaskDispatch, got {other:?}", self.id),
            }
        }
    }

    fn batch(&self, d: &TaskDispatch, terminal: bool, row_count: i32, payload: &[u8]) -> Up {
        Up::ResultBatch(ResultBatch {
            query_id: d.query_id.clone(),
            worker_id: self.id.clone(),
            task_id: d.task_id.clone(),
            attempt: d.attempt,
            terminal,
            row_count,
            payload: Bytes::copy_from_slice(payload),
            err: String::new(),
        })
    }

    fn progress(&self, d: &TaskDispatch, rows: i64, bytes: i64) -> Up {
        Up::TaskProgress(TaskProgress {
            query_id: d.query_id.clone(),
            stage_id: d.stage_id.clone(),
            task_id: d.task_id.clone(),
            worker_id: self.id.clone(),
            rows_processed: rows,
            bytes_processed: bytes,
            timestamp_unix_nano: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
                as i64,
            attempt: d.attempt,
        })
    }

    /// Waits until the coordinator has handled everything this worker sent
    /// so far: messages of one stream are handled in order, so a result
    /// for an unknown job sent now is counted as dropped only after them.
    async fn barrier(&self, admin: &str) {
        let before = counter(admin, "dropped_results").await;
        let stray = ResultBatch {
            query_id: format!("q-barrier-{before}"),
            worker_id: self.id.clone(),
            terminal: true,
            ..Default::default()
        };
        self.send(Up::ResultBatch(stray)).await;
        wait_until("the coordinator to handle what was sent", WAIT, || async move {
            counter(admin, "dropped_results").await > before
        })
        .await;
    }
}

/// Opens `DataPlane/Connect` with the cluster secret and sends whatever
/// bytes come through `messages` as its gRPC messages, verbatim.
async fn raw_connect(grpc: &str, messages: mpsc::Receiver<Bytes>) -> Result<Streaming<Bytes>, Status> {
    let mut client = tonic::client::Grpc::new(channel(grpc).await);
    client.ready().await.expect("channel ready");
    let mut request = tonic::Request::new(ReceiverStream::new(messages));
    request.metadata_mut().insert(walship_shipping::auth::SECRET_HEADER, SECRET.parse().unwrap());
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/dataplane.v1.DataPlane/Connect");
    client.streaming(request, path, common::raw::RawCodec).await.map(tonic::Response::into_inner)
}

/// Bytes that are not a `WorkerEnvelope`, each with what is wrong.
fn garbage() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("an endless varint", vec![0xff; 11]),
        ("tag 0", vec![0x00, 0x01, 0x02]),
        ("Hello as a varint", vec![0x08, 0x01]),
        ("a length past the end", vec![0x0a, 0x7f, 0x01]),
        ("a worker id that is not UTF-8", vec![0x0a, 0x03, 0x0a, 0x01, 0xff]),
        ("a truncated Hello", {
            let mut bytes = hello("truncated", this_build(), 1).encode_to_vec();
            bytes.pop();
            bytes
        }),
    ]
}

fn assert_decoding_status(status: &Status, what: &str) {
    assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
    let message = status.message().to_lowercase();
    assert!(
        message.contains("protobuf") || message.contains("decod"),
        "{what}: the status names no decoding: {status:?}"
    );
}

/// The coordinator's resident set, from `/proc/<pid>/status`.
fn rss_bytes(pid: u32) -> u64 {
    common::proc_status_bytes(pid, "VmRSS")
}

/// Waits until the coordinator's `dispatched` counter has not moved for
/// `quiet`; answers it.
async fn dispatch_settled(admin: &str, quiet: Duration) -> u64 {
    let mut last = counter(admin, "dispatched").await;
    let mut since = Instant::now();
    let deadline = Instant::now() + WAIT * 2;
    while since.elapsed() < quiet {
        assert!(Instant::now() < deadline, "dispatch never settled (dispatched = {last})");
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = counter(admin, "dispatched").await;
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    last
}

/// A worker that says Hello with `num_cpus` and then never reads its
/// stream (the sending side stays open, so the stream stays up).
async fn stuck_worker(grpc: &str, id: &str, num_cpus: i32) -> (mpsc::Sender<WorkerEnvelope>, Streaming<CoordEnvelope>) {
    let (tx, rx) = mpsc::channel(8);
    tx.send(hello(id, this_build(), num_cpus)).await.unwrap();
    let inbound = member(grpc).await.connect(ReceiverStream::new(rx)).await.expect("connect").into_inner();
    (tx, inbound)
}

/// Capacity a stuck worker claims: `num_cpus` 1,000,000 gives room for two
/// million tasks (the Hello takes any non-negative count), so every queued
/// no-op goes to it and enough dispatches are pushed at it to fill its
/// outbox, tonic's encode buffer, hyper's send buffer and the HTTP/2
/// windows (about 2.5 MiB of ~100-byte dispatches: some 25,000).
const STUCK_CPUS: i32 = 1_000_000;

/// The most no-op tasks one `POST /v1/tasks` takes.
const MAX_COUNT: usize = 10_000;

// ------------------------------------------------------------------ tests

/// 1a. Frames that are not a `WorkerEnvelope`, as the first message or
/// after a valid Hello: the stream ends with `INVALID_ARGUMENT` naming the
/// decoding, the worker is gone, the tasks are as they were, and the
/// coordinator still takes a worker and runs a task on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_frames_end_the_stream_and_change_nothing() {
    let lone = Lone::start(&[]).await;
    let admin = lone.admin().to_string();
    // A task for node-1 (not connected yet): queued until it is. The
    // garbage workers below have other ids, so it cannot go to them.
    let (_, ids) = submit(&admin, json!({"kind": "noop", "node": "node-1"})).await;
    let pending = ids[0].clone();
    let before = task_table(&admin).await;
    assert_eq!(before, vec![(pending.clone(), "queued".to_string(), 0, Value::Null)]);

    // As the first message: refused before any Hello.
    for (what, bytes) in garbage() {
        let (tx, rx) = mpsc::channel(4);
        tx.send(Bytes::from(bytes)).await.unwrap();
        let refused = raw_connect(lone.grpc(), rx).await;
        let status = match refused {
            Err(status) => status,
            Ok(mut stream) => match tokio::time::timeout(WAIT, stream.message()).await.expect("an answer") {
                Err(status) => status,
                Ok(answer) => panic!("{what} as the first message was answered with {answer:?}"),
            },
        };
        assert_decoding_status(&status, what);
    }

    // After a valid Hello and Welcome: the stream ends with the status.
    for (i, (what, bytes)) in garbage().into_iter().enumerate() {
        let id = format!("garbage-{i}");
        let (tx, rx) = mpsc::channel(4);
        tx.send(Bytes::from(hello(&id, this_build(), 1).encode_to_vec())).await.unwrap();
        let mut stream = raw_connect(lone.grpc(), rx).await.expect("a valid Hello is taken");
        let welcome = tokio::time::timeout(WAIT, stream.message()).await.expect("a Welcome").expect("Welcome");
        let welcome = CoordEnvelope::decode(welcome.expect("a message")).expect("a CoordEnvelope");
        assert!(matches!(welcome.msg, Some(Down::Welcome(_))), "{welcome:?}");
        tx.send(Bytes::from(bytes)).await.unwrap();
        let ended = tokio::time::timeout(WAIT, stream.message()).await.expect("the stream ends");
        let Err(status) = ended else { panic!("{what} after Hello: the stream went on with {ended:?}") };
        assert_decoding_status(&status, what);
        let admin = admin.clone();
        wait_until(&format!("{id} to be gone from the workers"), WAIT, || {
            let (admin, id) = (admin.clone(), id.clone());
            async move { !workers(&admin).await.contains(&id) }
        })
        .await;
    }

    // Kinds the API does not know: refused, nothing created. (The plain
    // unknown kind is in tests/dataplane.rs; these are near misses.)
    for body in [
        json!({"kind": "NOOP"}),
        json!({"kind": " noop"}),
        json!({"kind": "noop\u{0}"}),
        json!({"kind": "noop", "count": 2, "stage_id": "mystery"}),
        json!({"kind": 5}),
        json!({"kind": null}),
        json!({"kind": ["noop"]}),
        json!({}),
    ] {
        let (code, answer) = post(&admin, "/v1/tasks", &body).await;
        assert!((400..500).contains(&code), "{body} -> {code} {answer}");
    }

    // Nothing else changed; the admin API answers.
    assert_eq!(task_table(&admin).await, before, "garbage streams or refused requests changed the tasks");
    assert_eq!(workers(&admin).await, Vec::<String>::new());
    let (code, health) = get(&admin, "/v1/cluster").await;
    assert_eq!(code, 200, "{health}");

    // A proper worker still connects and gets the pending task run.
    let mut worker = Fake::connect(lone.grpc(), "node-1", 1).await;
    let dispatch = worker.next_dispatch().await;
    assert_eq!(dispatch.task_id, pending);
    assert_eq!(dispatch.attempt, 1, "the garbage streams never had it: {dispatch:?}");
    worker.send(worker.batch(&dispatch, true, 0, b"")).await;
    let done = wait_state(&admin, &pending, &["succeeded", "failed"]).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["attempts"], 1, "{done}");
}

/// 1b. An export whose worker sends a batch that is not Arrow IPC: the job
/// ends failed naming the payload (no panic, no hang), the coordinator
/// carries on (the same worker's next export is written), and the failed
/// job's task does not keep running on its worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_batch_that_is_not_arrow_fails_its_job() {
    // No stall catches the task while the test looks at it.
    let lone = Lone::start(&["--task-stall-s", "600"]).await;
    let admin = lone.admin().to_string();
    // The fake worker is node-1, the shard's only replica: exports go to it.
    let mut worker = Fake::connect(lone.grpc(), "node-1", 1).await;
    let export = json!({"kind": "export", "shard": 1, "node": "node-1", "from": 1, "to": 10});
    let (job, _) = submit(&admin, export.clone()).await;
    let dispatch = worker.next_dispatch().await;
    assert_eq!((dispatch.stage_id.as_str(), dispatch.query_id.as_str()), ("export", job.as_str()), "{dispatch:?}");
    worker.send(worker.batch(&dispatch, false, 5, b"PAR1 these bytes are not an Arrow IPC stream")).await;

    let report = wait_job(&admin, &job).await;
    assert_eq!(report["state"], "failed", "{report}");
    let error = report["error"].as_str().unwrap_or_default();
    assert!(error.contains("batch") && error.contains("Arrow IPC"), "the error names no payload: {report}");
    assert!(report["file"].is_null(), "{report}");
    let (code, _) = get(&admin, &format!("/v1/jobs/{job}/export")).await;
    assert_eq!(code, 404, "a failed export serves no file");

    // The failed job's task: stopped on its worker (a TaskCancel) and no
    // longer running, well before the 30 s stall would catch it.
    let failed_task = dispatch.task_id.clone();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut cancelled = false;
    while Instant::now() < deadline && !cancelled {
        match worker.next(Duration::from_millis(500)).await {
            Some(Ok(CoordEnvelope { msg: Some(Down::TaskCancel(c)) })) if c.task_id == failed_task => cancelled = true,
            Some(Err(status)) => panic!("the stream ended: {status:?}"),
            _ => {}
        }
    }
    let shown = task(&admin, &failed_task).await;
    assert!(
        cancelled && shown["state"] != "running",
        "the export job failed but its task was left running on node-1 (no TaskCancel within 15 s): {shown}"
    );

    // The coordinator carries on: the stream is up, another export of the
    // same worker is written.
    worker.barrier(&admin).await;
    assert!(workers(&admin).await.contains(&"node-1".to_string()));
    let (job2, _) = submit(&admin, export).await;
    let second = loop {
        let d = worker.next_dispatch().await;
        if d.query_id == job2 {
            break d;
        }
    };
    worker.send(worker.batch(&second, true, 0, b"")).await;
    let report2 = wait_job(&admin, &job2).await;
    assert_eq!((report2["state"].as_str(), report2["rows"].as_u64()), (Some("done"), Some(0)), "{report2}");
}

/// An export job on a lone coordinator whose only worker, `node-1`, is a
/// fake this test drives, with the job's one task dispatched to it (no
/// stall redispatches it meanwhile).
struct ExportOnFake {
    _lone: Lone,
    admin: String,
    worker: Fake,
    job: String,
    dispatch: TaskDispatch,
}

impl ExportOnFake {
    async fn start() -> ExportOnFake {
        let lone = Lone::start(&["--task-stall-s", "600"]).await;
        let admin = lone.admin().to_string();
        let mut worker = Fake::connect(lone.grpc(), "node-1", 1).await;
        let (job, _) =
            submit(&admin, json!({"kind": "export", "shard": 1, "node": "node-1", "from": 1, "to": 10})).await;
        let dispatch = worker.next_dispatch().await;
        ExportOnFake { _lone: lone, admin, worker, job, dispatch }
    }
}

/// 1b'. The same garbage as the export task's terminal batch: the job
/// fails naming the payload, and the task is not shown as succeeded (its
/// only output was refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_export_batch_that_is_not_arrow_fails_job_and_task() {
    let ExportOnFake { _lone, admin, worker, job, dispatch } = ExportOnFake::start().await;
    worker.send(worker.batch(&dispatch, true, 10, &[0xff; 64])).await;
    let report = wait_job(&admin, &job).await;
    assert_eq!(report["state"], "failed", "{report}");
    let error = report["error"].as_str().unwrap_or_default();
    assert!(error.contains("batch") && error.contains("Arrow IPC"), "the error names no payload: {report}");
    worker.barrier(&admin).await;
    let shown = task(&admin, &dispatch.task_id).await;
    assert!(
        shown["state"] == "failed" || shown["state"] == "cancelled",
        "the export job failed on this task's payload, yet the task shows {}: {shown}",
        shown["state"]
    );
}

/// 1b''. A batch carrying an error but not marked terminal, with a
/// payload: the task fails with that error, the job fails, and the payload
/// is discarded (the contract sets `err` only on a failed task's terminal
/// batch, whose partial output the receiver drops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_an_error_fails_its_task_whatever_its_terminal_flag_says() {
    let ExportOnFake { _lone, admin, worker, job, dispatch } = ExportOnFake::start().await;
    let Up::ResultBatch(mut failing) = worker.batch(&dispatch, false, 10, &[0xff; 64]) else { unreachable!() };
    failing.err = "the disk under the export went away".to_string();
    worker.send(Up::ResultBatch(failing)).await;
    let report = wait_job(&admin, &job).await;
    assert_eq!(report["state"], "failed", "{report}");
    let error = report["error"].as_str().unwrap_or_default();
    assert!(error.contains("the disk under the export went away"), "the job does not carry the task's error: {report}");
    assert!(!error.contains("Arrow"), "the failed batch's payload was read: {report}");
    worker.barrier(&admin).await;
    let shown = task(&admin, &dispatch.task_id).await;
    assert_eq!(shown["state"], "failed", "{shown}");
    assert_eq!(shown["result_rows"].as_u64(), Some(0), "a failed batch's rows were counted: {shown}");
}

/// The first message down a DataPlane stream is the Welcome, also when
/// tasks wait to be dispatched the moment a worker connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn welcome_comes_first_even_with_tasks_waiting_for_the_worker() {
    let lone = Lone::start(&[]).await;
    let admin = lone.admin().to_string();
    submit(&admin, json!({"kind": "noop", "count": 200})).await;
    for round in 0..20 {
        // `connect_with` asserts that the first message is the Welcome.
        let mut worker = Fake::connect(lone.grpc(), &format!("w{round}"), 4).await;
        worker.next_dispatch().await;
    }
}

async fn wait_job(admin: &str, job: &str) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let (code, view) = get(admin, &format!("/v1/jobs/{job}")).await;
        assert_eq!(code, 200, "{view}");
        if view["state"] == "done" {
            return view["report"].clone();
        }
        assert!(Instant::now() < deadline, "job {job} never finished: {view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// 1c. Progress with negative or shrinking counters and batches with a
/// negative `row_count`: ignored; what the task shows only grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_and_shrinking_counters_are_ignored() {
    // No stall redispatches the task while the test reports on it.
    let lone = Lone::start(&["--task-stall-s", "600"]).await;
    let admin = lone.admin().to_string();
    let mut worker = Fake::connect(lone.grpc(), "counter", 1).await;
    let (_, ids) = submit(&admin, json!({"kind": "noop", "sleep_ms": 60000})).await;
    let d = worker.next_dispatch().await;
    assert_eq!(d.task_id, ids[0]);

    let shown =
        |t: &Value| (t["rows"].as_i64().unwrap(), t["bytes"].as_i64().unwrap(), t["result_rows"].as_u64().unwrap());
    let mut seen = Vec::new();
    worker.send(worker.progress(&d, 100, 1000)).await;
    worker.barrier(&admin).await;
    let t = task(&admin, &d.task_id).await;
    assert_eq!(shown(&t), (100, 1000, 0), "{t}");
    seen.push(shown(&t));

    for (rows, bytes) in [(-5, -7), (50, 2000), (200, -1), (i64::MIN, i64::MIN), (99, 999), (100, 999)] {
        worker.send(worker.progress(&d, rows, bytes)).await;
        worker.barrier(&admin).await;
        let t = task(&admin, &d.task_id).await;
        assert_eq!(shown(&t), (100, 1000, 0), "progress ({rows}, {bytes}) was taken: {t}");
        assert!(t["rows_per_s"].as_f64().unwrap() >= 0.0 && t["bytes_per_s"].as_f64().unwrap() >= 0.0, "{t}");
        seen.push(shown(&t));
    }
    for row_count in [-1, -1000, i32::MIN] {
        worker.send(worker.batch(&d, false, row_count, b"")).await;
        worker.barrier(&admin).await;
        let t = task(&admin, &d.task_id).await;
        assert_eq!(t["result_rows"], 0, "row_count {row_count} was counted: {t}");
        assert_eq!(t["state"], "running", "{t}");
        seen.push(shown(&t));
    }
    worker.send(worker.progress(&d, 150, 1500)).await;
    worker.send(worker.batch(&d, false, 7, b"")).await;
    worker.barrier(&admin).await;
    let t = task(&admin, &d.task_id).await;
    assert_eq!(shown(&t), (150, 1500, 7), "{t}");
    seen.push(shown(&t));
    worker.send(worker.batch(&d, true, -3, b"")).await;
    let done = wait_state(&admin, &d.task_id, &["succeeded", "failed"]).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(shown(&done), (150, 1500, 7), "a terminal row_count of -3 was counted: {done}");
    seen.push(shown(&done));
    assert!(
        seen.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1 && w[0].2 <= w[1].2),
        "what the task showed went down: {seen:?}"
    );
}

/// 2(i). A worker that says Hello with a huge capacity and never reads:
/// pushing every queued task at it must cost the coordinator a bounded
/// amount of memory, not some per task pushed.
///
/// The bound: the coordinator's side of one stream holds at most the
/// outbox (64 messages of ~100 bytes), tonic's encode buffer (it yields at
/// 32 KiB) and hyper's HTTP/2 send buffer (400 KiB per stream); the
/// HTTP/2 windows (2 MiB per stream, 5 MiB per connection, hyper's client
/// defaults) are what the *worker* buffers. Counting all of those on the
/// coordinator's side, plus allocator slack, stays under 16 MiB. The
/// tasks' own records are made before the baseline (they are queued with
/// no worker connected), so what grows after is what dispatch holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_worker_costs_the_coordinator_bounded_memory() {
    const BOUND: u64 = 16 << 20;
    // No stall requeues the pushed tasks while the test measures.
    let lone = Lone::start(&["--task-stall-s", "600"]).await;
    let admin = lone.admin().to_string();
    let (_, ids) = submit(&admin, json!({"kind": "noop", "count": MAX_COUNT})).await;
    assert_eq!(ids.len(), MAX_COUNT);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let baseline = rss_bytes(lone.pid());

    let (_keep, _never_read) = stuck_worker(lone.grpc(), "stuck", STUCK_CPUS).await;
    let sent = dispatch_settled(&admin, Duration::from_secs(3)).await;
    let (_, view) = get(&admin, "/v1/cluster").await;
    let in_flight = view["workers"][0]["in_flight"].as_u64().unwrap_or(0);
    let after = rss_bytes(lone.pid());
    let growth = after.saturating_sub(baseline);
    eprintln!(
        "stuck worker: {sent} dispatches sent, {in_flight} tasks assigned; coordinator RSS {} -> {} KiB (+{} KiB, {:.0} B per assigned task)",
        baseline >> 10,
        after >> 10,
        growth >> 10,
        growth as f64 / in_flight.max(1) as f64
    );
    assert!(sent > 0 && in_flight > 0, "nothing was pushed at the stuck worker: {view}");
    assert!(
        growth < BOUND,
        "the coordinator grew by {} KiB while pushing at a worker that does not read ({sent} sent, {in_flight} assigned): \
         more than the {} KiB its outbox and HTTP/2 buffers account for",
        growth >> 10,
        BOUND >> 10
    );
}

/// 2(ii). With a stuck worker connected (huge capacity, never reads) and a
/// real node's worker too, tasks for the real node still run: one full
/// outbox must not hold up dispatch to every other worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_worker_does_not_stall_dispatch_to_healthy_ones() {
    let mut cluster = Cluster::start_with(1, 1, 1, "", None);
    let admin = cluster.coordinator(1).admin.clone();
    let grpc = cluster.coordinator(1).grpc.clone();
    wait_until("node-1 connected", WAIT, || {
        let admin = admin.clone();
        async move { workers_now(&admin).await.is_some_and(|w| w == ["node-1"]) }
    })
    .await;
    // The real node runs a task first: it is healthy.
    let (_, ids) = submit(&admin, json!({"kind": "noop", "node": "node-1"})).await;
    assert_eq!(wait_state(&admin, &ids[0], &["succeeded", "failed"]).await["state"], "succeeded");

    let (_keep, _never_read) = stuck_worker(&grpc, "stuck", STUCK_CPUS).await;
    wait_until("the stuck worker connected", WAIT, || {
        let admin = admin.clone();
        async move { workers_now(&admin).await.is_some_and(|w| w.len() == 2) }
    })
    .await;
    // Untargeted no-ops go to the worker with the most room: the stuck one
    // takes as many as any worker may hold at once (its Hello claims far
    // more), the rest go to the healthy node.
    submit(&admin, json!({"kind": "noop", "count": 5000})).await;
    let stuck_in_flight = || async {
        let (_, view) = get(&admin, "/v1/cluster").await;
        let workers = view["workers"].as_array().cloned().unwrap_or_default();
        workers.iter().find(|w| w["worker_id"] == "stuck").map(|w| (w["in_flight"].clone(), w["capacity"].clone()))
    };
    wait_until("the stuck worker to be full", WAIT, || async {
        stuck_in_flight().await.is_some_and(|(n, cap)| n == 1024 && cap == 1024)
    })
    .await;
    let sent = counter(&admin, "dispatched").await;

    // Tasks for the healthy node: they must run there.
    let (_, healthy) = submit(&admin, json!({"kind": "noop", "node": "node-1", "count": 5})).await;
    for id in &healthy {
        let deadline = Instant::now() + WAIT;
        loop {
            let t = task(&admin, id).await;
            if t["state"] == "succeeded" {
                break;
            }
            assert!(t["state"] != "failed", "{t}");
            assert!(
                Instant::now() < deadline,
                "a task for the healthy node-1 never ran while a stuck worker was connected \
                 (dispatch stalled after {sent} sends, now {}): {t}",
                counter(&admin, "dispatched").await
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// 2(iii). An operator's cancel of a task assigned to a stuck worker
/// answers (the cancel must not wait for room in that worker's outbox).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_task_of_a_stuck_worker_answers() {
    let lone = Lone::start(&[]).await;
    let admin = lone.admin().to_string();
    let (_keep, _never_read) = stuck_worker(lone.grpc(), "stuck", STUCK_CPUS).await;
    submit(&admin, json!({"kind": "noop", "count": MAX_COUNT})).await;
    dispatch_settled(&admin, Duration::from_secs(3)).await;
    let (_, page) = get(&admin, "/v1/tasks?state=running&limit=1").await;
    let id = page["tasks"][0]["task_id"].as_str().expect("a task running on the stuck worker").to_string();
    let url = format!("{admin}/v1/tasks/{id}/cancel");
    let answer = tokio::time::timeout(Duration::from_secs(15), common::http_post(&url, "{}", Some(TOKEN))).await;
    let Ok((code, body)) = answer else {
        panic!("POST /v1/tasks/{id}/cancel did not answer within 15 s: it waits for room in the stuck worker's outbox")
    };
    assert_eq!(code, 200, "{body}");
    assert_eq!(task(&admin, &id).await["state"], "cancelled");
    let (code, _) = get(&admin, "/v1/cluster").await;
    assert_eq!(code, 200);
}

/// 3a. A Hello whose worker id is 1 MiB: refused with `INVALID_ARGUMENT`,
/// not listed as a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_with_a_huge_worker_id_is_refused() {
    let lone = Lone::start(&[]).await;
    let admin = lone.admin().to_string();
    for id in ["w".repeat(1 << 20), "w".repeat(129)] {
        let status =
            member(lone.grpc()).await.connect(tokio_stream::iter(vec![hello(&id, this_build(), 1)])).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{} bytes: {:?}", id.len(), status.code());
        assert!(status.message().contains("worker_id") && status.message().len() < 1024, "{:?}", status.message());
    }
    // 128 bytes is the limit: taken.
    let _at_limit = Fake::connect(lone.grpc(), &"w".repeat(128), 1).await;
    assert_eq!(workers(&admin).await, vec!["w".repeat(128)]);
}

/// 3b. A Hello whose `build_sha` is huge (over 256 bytes; 1 MiB): refused
/// with `INVALID_ARGUMENT`, not listed as a worker (its build would be
/// copied into every `/v1/cluster` answer and into the coordinator's log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_with_a_huge_build_sha_is_refused() {
    let lone = Lone::start(&[]).await;
    let admin = lone.admin().to_string();
    for (id, sha) in [("big-sha", "b".repeat(1 << 20)), ("long-sha", "b".repeat(257))] {
        // The sending side stays open: a Hello that is taken stays listed.
        let (tx, rx) = mpsc::channel(4);
        tx.send(hello(id, &sha, 1)).await.unwrap();
        let answer = member(lone.grpc()).await.connect(ReceiverStream::new(rx)).await;
        let (code, cluster) = get(&admin, "/v1/cluster").await;
        assert_eq!(code, 200);
        let listed: Vec<(String, usize)> = cluster["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| (w["worker_id"].as_str().unwrap().to_string(), w["build_sha"].as_str().unwrap().len()))
            .collect();
        let status = match answer {
            Err(status) => status,
            Ok(_) => panic!(
                "a Hello with a build_sha of {} bytes was taken: GET /v1/cluster lists (worker, build_sha bytes) {listed:?}; \
                 expected INVALID_ARGUMENT for a build_sha over 256 bytes",
                sha.len()
            ),
        };
        assert_eq!(status.code(), Code::InvalidArgument, "{} bytes: {status:?}", sha.len());
        assert!(status.message().len() < 1024, "the refusal echoes the build: {} bytes", status.message().len());
        assert!(listed.iter().all(|(w, _)| w != id), "{listed:?}");
        drop(tx);
    }
    // A build id of ordinary length (a 40-hex git sha with a suffix) is
    // taken (another build: the default policy warns).
    let _ordinary = Fake::connect_as(lone.grpc(), "ordinary", &format!("{}-dirty", "a".repeat(40))).await;
    assert_eq!(workers(&admin).await, vec!["ordinary".to_string()]);
}
