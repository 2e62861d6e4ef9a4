//! The node side of `DataPlane/Connect`: one long-lived stream to the
//! active coordinator, tasks run by kind, progress and results sent back.
//!
//! * Dials the coordinators in turn (a standby's refusal names the active
//!   one, which is tried next), says `Hello`, waits for `Welcome`; on any
//!   failure waits with backoff from [`BACKOFF_START`] doubling to
//!   [`BACKOFF_MAX`], with jitter, then tries again (a coordinator restart
//!   or failover is just another reconnect).
//! * Every message up goes through one bounded channel feeding the stream:
//!   sends are serialized, and a slow coordinator holds tasks back instead
//!   of growing a buffer.
//! * De-dupes dispatches on `task_id`: one already running is ignored; one
//!   finished recently has its terminal batch sent again (the first may
//!   have been lost with the stream).
//! * Each task runs under a cancellation token (a `TaskCancel`, its
//!   deadline, or shutdown) and reports `TaskProgress` every
//!   [`PROGRESS_EVERY`].

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use walship_proto::dataplane::coord_envelope::Msg as Down;
use walship_proto::dataplane::data_plane_client::DataPlaneClient;
use walship_proto::dataplane::worker_envelope::Msg as Up;
use walship_proto::dataplane::{Hello, ResultBatch, TaskDispatch, TaskProgress, WorkerEnvelope};

use crate::task::unix_nanos;

pub const BACKOFF_START: Duration = Duration::from_millis(500);
pub const BACKOFF_MAX: Duration = Duration::from_secs(10);
pub const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Messages waiting to go up before senders wait.
const UPBOX: usize = 64;

/// Finished task ids remembered for de-duplication.
const REMEMBER_FINISHED: usize = 4096;

/// A task's counters now, as a `TaskProgress`.
fn progress_of(task: &TaskContext, worker_id: &str) -> TaskProgress {
    TaskProgress {
        query_id: task.query_id.clone(),
        stage_id: task.stage_id.clone(),
        task_id: task.task_id.clone(),
        attempt: task.attempt,
        worker_id: worker_id.to_string(),
        rows_processed: task.rows.load(Ordering::Relaxed),
        bytes_processed: task.bytes.load(Ordering::Relaxed),
        timestamp_unix_nano: unix_nanos(),
    }
}

/// What a running task sees: its identity and parameters, where its output
/// and progress go, and whether to stop.
pub struct TaskContext {
    pub task_id: String,
    /// Which dispatch of the task this is.
    pub attempt: u32,
    pub query_id: String,
    /// The stage its dispatch named (the task kind): progress names it, so
    /// the coordinator can watch each stage's progress.
    pub stage_id: String,
    pub blob: Vec<u8>,
    pub cancel: CancellationToken,
    rows: AtomicI64,
    bytes: AtomicI64,
    out: mpsc::Sender<WorkerEnvelope>,
    worker_id: String,
}

impl TaskContext {
    /// Adds to the task's monotonic counters.
    pub fn advance(&self, rows: i64, bytes: i64) {
        self.rows.fetch_add(rows, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Sends a non-terminal batch of output (an Arrow IPC stream).
    pub async fn send(&self, row_count: i32, payload: Vec<u8>) -> Result<(), String> {
        self.out
            .send(envelope(Up::ResultBatch(ResultBatch {
                query_id: self.query_id.clone(),
                worker_id: self.worker_id.clone(),
                task_id: self.task_id.clone(),
                attempt: self.attempt,
                terminal: false,
                row_count,
                payload: payload.into(),
                err: String::new(),
            })))
            .await
            .map_err(|_| "the stream to the coordinator closed".to_string())
    }
}

/// What a task's runner answers: its last batch (rows, payload), or why
/// it failed.
pub type TaskOutcome = Result<(i32, Vec<u8>), String>;

/// Runs the tasks of one kind.
pub trait TaskRunner: Send + Sync + 'static {
    /// The kind (`stage_id`) it runs.
    fn kind(&self) -> &'static str;
    fn run(&self, task: Arc<TaskContext>) -> Pin<Box<dyn Future<Output = TaskOutcome> + Send>>;
}

/// How this worker introduces itself and where it connects.
#[derive(Clone)]
pub struct WorkerSettings {
    pub worker_id: String,
    pub build_sha: String,
    pub num_cpus: i32,
    pub memory_bytes: i64,
    /// The coordinators' gRPC addresses, in the order to try them.
    pub coordinators: Vec<String>,
}

/// Opens a client to a coordinator (TLS, credentials: the caller's).
pub type Dial<C> = Arc<dyn Fn(&str) -> Option<DataPlaneClient<C>> + Send + Sync>;

fn envelope(msg: Up) -> WorkerEnvelope {
    WorkerEnvelope { msg: Some(msg) }
}

#[derive(Default)]
struct Memory {
    running: HashMap<String, Arc<TaskContext>>,
    finished: VecDeque<(String, ResultBatch)>,
}

/// The node's worker.
pub struct Worker<C> {
    settings: WorkerSettings,
    dial: Dial<C>,
    runners: HashMap<&'static str, Arc<dyn TaskRunner>>,
    memory: Mutex<Memory>,
    /// The coordinator it is connected to, if any (status).
    pub connected_to: Mutex<Option<String>>,
}

impl<C> Worker<C>
where
    C: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + Sync + 'static,
    C::Error: Into<tonic::codegen::StdError>,
    C::ResponseBody: tonic::codegen::Body<Data = bytes::Bytes> + Send + 'static,
    <C::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
    C::Future: Send,
{
    pub fn new(settings: WorkerSettings, dial: Dial<C>, runners: Vec<Arc<dyn TaskRunner>>) -> Arc<Worker<C>> {
        Arc::new(Worker {
            settings,
            dial,
            runners: runners.into_iter().map(|r| (r.kind(), r)).collect(),
            memory: Mutex::new(Memory::default()),
            connected_to: Mutex::new(None),
        })
    }

    /// Keeps a stream to the active coordinator until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut backoff = BACKOFF_START;
        let mut next: Option<String> = None;
        let mut turn = 0usize;
        loop {
            let target = next.take().unwrap_or_else(|| {
                let list = &self.settings.coordinators;
                let t = list[turn % list.len().max(1)].clone();
                turn += 1;
                t
            });
            let outcome = tokio::select! {
                outcome = self.clone().session(&target, &stop) => outcome,
                _ = stop.cancelled() => return,
            };
            *self.connected_to.lock() = None;
            match outcome {
                Session::Welcomed => backoff = BACKOFF_START,
                Session::Standby(active) => {
                    if let Some(active) = active {
                        next = Some(active);
                        continue;
                    }
                }
                Session::Failed(error) => tracing::debug!(coordinator = %target, error, "DataPlane stream failed"),
            }
            let jitter = rand::random::<f64>() * 0.5 + 0.75;
            tokio::select! {
                _ = tokio::time::sleep(backoff.mul_f64(jitter)) => {}
                _ = stop.cancelled() => return,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    async fn session(self: Arc<Self>, target: &str, stop: &CancellationToken) -> Session {
        let Some(mut client) = (self.dial)(target) else { return Session::Failed(format!("bad address {target}")) };
        let (up_tx, up_rx) = mpsc::channel::<WorkerEnvelope>(UPBOX);
        let hello = Hello {
            worker_id: self.settings.worker_id.clone(),
            build_sha: self.settings.build_sha.clone(),
            num_cpus: self.settings.num_cpus,
            gomemlimit: self.settings.memory_bytes,
        };
        if up_tx.send(envelope(Up::Hello(hello))).await.is_err() {
            return Session::Failed("closed".into());
        }
        let outbound = tokio_stream::wrappers::ReceiverStream::new(up_rx);
        let mut inbound = match client.connect(outbound).await {
            Ok(response) => response.into_inner(),
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {
                let active = status
                    .metadata()
                    .get(crate::coordinator::ACTIVE_METADATA_KEY)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
                    .filter(|a| a != target);
                return Session::Standby(active);
            }
            Err(status) => return Session::Failed(status.to_string()),
        };
        match inbound.message().await {
            Ok(Some(m)) if matches!(m.msg, Some(Down::Welcome(_))) => {}
            Ok(other) => return Session::Failed(format!("expected Welcome, got {other:?}")),
            Err(status) => return Session::Failed(status.to_string()),
        }
        *self.connected_to.lock() = Some(target.to_string());
        tracing::info!(coordinator = target, "DataPlane connected");
        let session_stop = stop.child_token();
        let progress = tokio::spawn(self.clone().report_progress(up_tx.clone(), session_stop.clone()));
        let error = loop {
            match inbound.message().await {
                Ok(Some(message)) => match message.msg {
                    Some(Down::TaskDispatch(dispatch)) => self.clone().start(dispatch, up_tx.clone(), stop),
                    Some(Down::TaskCancel(cancel)) => {
                        if let Some(task) = self.memory.lock().running.get(&cancel.task_id) {
                            tracing::info!(task_id = %cancel.task_id, reason = %cancel.reason, "task cancelled");
                            task.cancel.cancel();
                        }
                    }
                    Some(Down::Welcome(_)) | None => {}
                },
                Ok(None) => break "the coordinator closed the stream".to_string(),
                Err(status) => break status.to_string(),
            }
        };
        session_stop.cancel();
        let _ = progress.await;
        tracing::info!(coordinator = target, error, "DataPlane stream ended; reconnecting");
        Session::Welcomed
    }

    /// Starts a dispatched task (or answers a duplicate).
    fn start(self: Arc<Self>, dispatch: TaskDispatch, up: mpsc::Sender<WorkerEnvelope>, stop: &CancellationToken) {
        let cancel = stop.child_token();
        let context = Arc::new(TaskContext {
            task_id: dispatch.task_id.clone(),
            attempt: dispatch.attempt,
            query_id: dispatch.query_id.clone(),
            stage_id: dispatch.stage_id.clone(),
            blob: dispatch.task_blob.to_vec(),
            cancel: cancel.clone(),
            rows: AtomicI64::new(0),
            bytes: AtomicI64::new(0),
            out: up.clone(),
            worker_id: self.settings.worker_id.clone(),
        });
        {
            let mut memory = self.memory.lock();
            if let Some(running) = memory.running.get(&dispatch.task_id) {
                if running.attempt >= dispatch.attempt {
                    tracing::debug!(task_id = %dispatch.task_id, "duplicate dispatch of a running task: ignored");
                    return;
                }
                // A newer dispatch of a task still winding down here.
                running.cancel.cancel();
            }
            if let Some((_, last)) =
                memory.finished.iter().find(|(id, last)| *id == dispatch.task_id && last.attempt == dispatch.attempt)
            {
                // Finished here already: say so again on this stream.
                let last = last.clone();
                tokio::spawn(async move {
                    let _ = up.send(envelope(Up::ResultBatch(last))).await;
                });
                return;
            }
            memory.running.insert(dispatch.task_id.clone(), context.clone());
        }
        let runner = self.runners.get(dispatch.stage_id.as_str()).cloned();
        tokio::spawn(async move {
            let deadline = (dispatch.deadline_unix_nano > 0)
                .then(|| Duration::from_nanos((dispatch.deadline_unix_nano - unix_nanos()).max(0) as u64));
            let outcome = match runner {
                None => Err(format!("unknown task kind {:?}", dispatch.stage_id)),
                Some(runner) => {
                    let run = runner.run(context.clone());
                    let deadline = async {
                        match deadline {
                            Some(d) => tokio::time::sleep(d).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        outcome = run => outcome,
                        _ = cancel.cancelled() => Err("cancelled".to_string()),
                        _ = deadline => Err("deadline exceeded".to_string()),
                    }
                }
            };
            let (row_count, payload, err) = match outcome {
                Ok((rows, payload)) => (rows, payload, String::new()),
                Err(error) => (0, Vec::new(), error),
            };
            let last = ResultBatch {
                query_id: dispatch.query_id.clone(),
                worker_id: context.worker_id.clone(),
                task_id: dispatch.task_id.clone(),
                attempt: dispatch.attempt,
                terminal: true,
                row_count,
                payload: payload.into(),
                err,
            };
            {
                let mut memory = self.memory.lock();
                if memory.running.get(&dispatch.task_id).is_some_and(|r| r.attempt == dispatch.attempt) {
                    memory.running.remove(&dispatch.task_id);
                }
                memory.finished.push_back((dispatch.task_id.clone(), last.clone()));
                while memory.finished.len() > REMEMBER_FINISHED {
                    memory.finished.pop_front();
                }
            }
            // Its last counters first, so a task shorter than the progress
            // period still shows what it did.
            let _ = up.send(envelope(Up::TaskProgress(progress_of(&context, &self.settings.worker_id)))).await;
            let _ = up.send(envelope(Up::ResultBatch(last))).await;
        });
    }

    /// Every [`PROGRESS_EVERY`], each running task's counters.
    async fn report_progress(self: Arc<Self>, up: mpsc::Sender<WorkerEnvelope>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(PROGRESS_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            let running: Vec<Arc<TaskContext>> = self.memory.lock().running.values().cloned().collect();
            for task in running {
                let progress = progress_of(&task, &self.settings.worker_id);
                if up.send(envelope(Up::TaskProgress(progress))).await.is_err() {
                    return;
                }
            }
        }
    }

    /// Tasks running here now (status).
    pub fn running(&self) -> Vec<String> {
        self.memory.lock().running.keys().cloned().collect()
    }
}

enum Session {
    /// Connected and welcomed; the stream ended later.
    Welcomed,
    /// A standby refused, naming the active coordinator if it could.
    Standby(Option<String>),
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> Arc<Worker<tonic::transport::Channel>> {
        let settings = WorkerSettings {
            worker_id: "node-1".into(),
            build_sha: "test".into(),
            num_cpus: 1,
            memory_bytes: 0,
            coordinators: Vec::new(),
        };
        let dial: Dial<tonic::transport::Channel> = Arc::new(|_| None);
        Worker::new(settings, dial, vec![Arc::new(crate::kinds::noop::NoopRunner)])
    }

    fn dispatch(kind: &str) -> TaskDispatch {
        TaskDispatch {
            task_id: "t-1".into(),
            query_id: "q-1".into(),
            stage_id: kind.into(),
            task_blob: bytes::Bytes::from_static(b"{}"),
            deadline_unix_nano: 0,
            attempt: 1,
        }
    }

    /// The next batch sent up (a task's last progress, sent just before
    /// its terminal batch, skipped).
    async fn next_batch(up: &mut mpsc::Receiver<WorkerEnvelope>) -> ResultBatch {
        loop {
            let message = tokio::time::timeout(Duration::from_secs(10), up.recv()).await.expect("an answer in time");
            match message.and_then(|m| m.msg) {
                Some(Up::ResultBatch(batch)) => return batch,
                Some(Up::TaskProgress(_)) => continue,
                other => panic!("expected a ResultBatch, got {other:?}"),
            }
        }
    }

    /// A task shorter than the progress period still reports its counters:
    /// its last progress goes up right before its terminal batch.
    #[tokio::test]
    async fn a_finished_task_sends_its_last_counters_before_its_result() {
        let worker = worker();
        let stop = CancellationToken::new();
        let (up, mut sent) = mpsc::channel(8);
        let blob = br#"{"sleep_ms": 250}"#.to_vec();
        worker.clone().start(TaskDispatch { task_blob: blob.into(), ..dispatch("noop") }, up, &stop);
        let first = tokio::time::timeout(Duration::from_secs(10), sent.recv()).await.unwrap().and_then(|m| m.msg);
        let Some(Up::TaskProgress(progress)) = first else { panic!("expected the last progress first, got {first:?}") };
        assert_eq!((progress.task_id.as_str(), progress.rows_processed), ("t-1", 3), "one per step: 100, 100, 50 ms");
        assert_eq!(progress.stage_id, "noop", "progress names the dispatch's stage");
        let batch = next_batch(&mut sent).await;
        assert!(batch.terminal && batch.err.is_empty(), "{batch:?}");
    }

    /// A dispatch of a kind this node has no runner for (an unknown
    /// `stage_id`, from a newer coordinator say): the task fails at once
    /// with a terminal batch naming the kind, is not left running, and a
    /// duplicate of that dispatch is answered the same without running.
    #[tokio::test]
    async fn an_unknown_kind_fails_its_task_and_is_not_left_running() {
        let worker = worker();
        let stop = CancellationToken::new();
        let (up, mut sent) = mpsc::channel(8);
        worker.clone().start(dispatch("mystery"), up.clone(), &stop);
        let batch = next_batch(&mut sent).await;
        assert!(batch.terminal, "{batch:?}");
        assert!(batch.err.contains("unknown task kind") && batch.err.contains("mystery"), "{batch:?}");
        assert_eq!((batch.task_id.as_str(), batch.query_id.as_str(), batch.attempt), ("t-1", "q-1", 1));
        assert_eq!((batch.row_count, batch.payload.len(), batch.worker_id.as_str()), (0, 0, "node-1"));
        assert!(worker.running().is_empty(), "{:?}", worker.running());

        worker.clone().start(dispatch("mystery"), up.clone(), &stop);
        let again = next_batch(&mut sent).await;
        assert_eq!(again, batch, "a duplicate dispatch is answered from memory");
        assert!(worker.running().is_empty());

        // An empty kind is just as unknown; a known kind still runs.
        worker.clone().start(TaskDispatch { task_id: "t-2".into(), ..dispatch("") }, up.clone(), &stop);
        let empty = next_batch(&mut sent).await;
        assert!(empty.terminal && empty.err.contains("unknown task kind"), "{empty:?}");
        worker.clone().start(TaskDispatch { task_id: "t-3".into(), ..dispatch("noop") }, up, &stop);
        let noop = next_batch(&mut sent).await;
        assert!(noop.terminal && noop.err.is_empty(), "{noop:?}");
    }
}
