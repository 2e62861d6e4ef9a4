//! The coordinator side of `DataPlane/Connect`: workers, dispatch, results.
//!
//! * **Connection.** Only the active coordinator takes workers (a standby
//!   answers `FAILED_PRECONDITION` naming the active one in
//!   `walship-active-coordinator`). The first message must be `Hello`
//!   (within [`HELLO_TIMEOUT`]), else `INVALID_ARGUMENT` and the stream
//!   closes; a second `Hello` on a stream closes it the same way. A build
//!   that differs from the coordinator's is refused or warned about
//!   ([`BuildPolicy`]). A worker id that is already connected is refused
//!   with `ALREADY_EXISTS`: two live workers claiming one id are a
//!   misconfiguration, and a restarted node's stale stream ends within
//!   HTTP/2 keepalive (the coordinator's gRPC server pings every 5 s), after
//!   which the node's reconnect succeeds.
//! * **Dispatch.** Tasks queue in creation order. A task with a target
//!   (verify and export run where the replica is) waits for that worker;
//!   any other goes to the connected worker with the most free capacity.
//!   A worker's capacity is bound by its `num_cpus` and memory
//!   ([`capacity`]); it never has more tasks in flight, and sends to it go
//!   through a bounded channel feeding HTTP/2: a worker that stops reading
//!   fills its channel and gets nothing more until it drains (nothing
//!   buffers without bound, and the other workers are not held up).
//! * **Results.** `ResultBatch`es are routed by `query_id` to the job
//!   waiting for them; unknown jobs, finished tasks and a worker the task
//!   is no longer assigned to are dropped and counted (duplicate
//!   completions after a redispatch), and the stream stays up. A terminal
//!   batch ends its task; one with `err` fails it and its job discards the
//!   partial output. A job takes its results at its own pace: the bytes of
//!   the batches it has not taken yet are bounded ([`JOB_QUEUE_BYTES`]),
//!   and past that the worker's stream is not read until it takes some
//!   (HTTP/2 flow control then holds the worker back; its other tasks'
//!   progress and results wait with it), so a job slower
//!   than its worker (an export to a slow disk) holds a bounded amount of
//!   the coordinator's memory, not its whole output.
//! * **Liveness.** A worker that goes away has its running tasks requeued
//!   (redispatched elsewhere or to it when it returns); a task whose
//!   counters stop growing for the stall time is cancelled and requeued;
//!   one past its deadline is cancelled and failed. After
//!   [`DataPlaneSettings::max_attempts`] a task fails for good and is kept
//!   as a dead letter (on the [`TaskBus`], where other coordinators and
//!   later runs see it) until re-driven.
//! * **Cancels** go to every connected worker and, through the bus, to
//!   every other coordinator; a worker's progress for a task no coordinator
//!   tracks (dispatched before a coordinator change) gets it cancelled.
//!
//! Files: this one holds the types, submission and the views;
//! `dispatch.rs` dispatch and the watchdog; `stream.rs` a worker's stream
//! and the gRPC service; `cancel.rs` cancels, dead letters and re-drives.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::Stream;
use parking_lot::Mutex;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use walship_proto::dataplane::coord_envelope::Msg as Down;
use walship_proto::dataplane::data_plane_server::DataPlane;
use walship_proto::dataplane::worker_envelope::Msg as Up;
use walship_proto::dataplane::{
    CoordEnvelope, Hello, ResultBatch, TaskCancel, TaskDispatch, TaskProgress, Welcome, WorkerEnvelope,
};

mod cancel;
mod dispatch;
mod stream;

pub use stream::DataPlaneService;

use crate::bus::{BusError, CancelNotice, DeadLetter, TaskBus};
use crate::task::{Task, TaskSpec, TaskState, unix_ms, unix_nanos};

/// How long a new stream may take to say `Hello`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Messages queued towards one worker before sends wait (HTTP/2 flow
/// control then holds them back).
const OUTBOX: usize = 64;

/// A reserved slot in one worker's outbox.
type Permit = mpsc::OwnedPermit<Result<CoordEnvelope, Status>>;

/// The metadata key a standby's refusal names the active coordinator in.
pub const ACTIVE_METADATA_KEY: &str = "walship-active-coordinator";

/// Longest worker id taken.
const MAX_WORKER_ID: usize = 128;

/// Most tasks one worker is given at once, whatever it announces.
pub const MAX_CAPACITY: usize = 1024;

/// Longest build id taken.
const MAX_BUILD_SHA: usize = 256;

/// Tasks kept after they finished (the newest), for the admin API.
const KEEP_FINISHED: usize = 10_000;

/// Result bytes one job may have queued and not yet taken; a batch past it
/// waits, with the rest of its worker's stream, until the job takes some.
/// (A batch larger than this waits for the whole of it.)
pub const JOB_QUEUE_BYTES: usize = 64 << 20;

/// What to do with a worker whose build differs from the coordinator's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuildPolicy {
    /// Take it, and show the mismatch (admin API, a WARN line).
    Warn,
    /// Refuse it (`FAILED_PRECONDITION`).
    Refuse,
}

/// Tuning of the coordinator side.
#[derive(Debug, Clone)]
pub struct DataPlaneSettings {
    pub cluster_id: String,
    /// This coordinator's id (named in the cancels it broadcasts).
    pub coordinator_id: String,
    pub build_sha: String,
    pub build_policy: BuildPolicy,
    /// A running task whose counters do not grow for this long is stalled.
    pub stall: Duration,
    /// Dispatches of one task before it fails for good.
    pub max_attempts: u32,
}

/// Whether this coordinator is the active one; `Err` names the active one
/// (its gRPC address), if known.
pub type ActiveCheck = Arc<dyn Fn() -> Result<(), Option<String>> + Send + Sync>;

/// How many tasks a worker runs at once: two per CPU, and one per 64 MiB
/// of its task memory, whichever is less (at least one, at most
/// [`MAX_CAPACITY`]: a worker's word cannot claim the whole queue).
pub fn capacity(num_cpus: i32, memory_bytes: i64) -> usize {
    let by_cpu = (num_cpus.clamp(1, MAX_CAPACITY as i32 / 2) as usize) * 2;
    let by_memory = if memory_bytes > 0 { (memory_bytes as u64 / (64 << 20)) as usize } else { usize::MAX };
    by_cpu.min(by_memory).max(1)
}

/// A connected worker.
struct Worker {
    conn: u64,
    hello: Hello,
    capacity: usize,
    in_flight: usize,
    outbox: mpsc::Sender<Result<CoordEnvelope, Status>>,
    connected_unix_ms: u64,
    build_matches: bool,
    /// Someone waits for its full outbox to drain (then wakes dispatch).
    drain_watched: Arc<std::sync::atomic::AtomicBool>,
}

/// A job waiting for its tasks' results.
struct Job {
    results: mpsc::UnboundedSender<JobEvent>,
    /// Room for the result bytes queued in `results` ([`JOB_QUEUE_BYTES`]);
    /// closed when the job is.
    room: Arc<Semaphore>,
}

/// What a job hears about its tasks.
#[derive(Debug)]
pub enum JobEvent {
    /// A batch of task `task_id`'s output (from `worker`). `room` is the
    /// batch's share of the job's queue, given back when the event is
    /// dropped.
    Batch { task_id: String, worker: String, batch: ResultBatch, room: Option<OwnedSemaphorePermit> },
    /// Task `task_id` ended in `state` (with its error).
    Finished { task_id: String, state: TaskState, error: Option<String> },
}

/// A connected worker as the admin API shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct WorkerView {
    pub worker_id: String,
    pub build_sha: String,
    /// Whether its build is the coordinator's.
    pub build_matches: bool,
    pub num_cpus: i32,
    pub memory_bytes: i64,
    pub capacity: usize,
    pub in_flight: usize,
    pub connected_unix_ms: u64,
}

#[derive(Default)]
struct State {
    workers: BTreeMap<String, Worker>,
    tasks: BTreeMap<String, Task>,
    /// Task ids in creation order (listing order).
    order: Vec<String>,
    /// Ids of queued tasks, oldest first (dispatch order). Entries of
    /// tasks no longer queued (cancelled meanwhile) are dropped when met.
    queue: std::collections::VecDeque<String>,
    jobs: HashMap<String, Job>,
}

/// Counters the admin API and metrics show.
#[derive(Default, Debug)]
pub struct Counters {
    pub dispatched: AtomicU64,
    pub redispatched: AtomicU64,
    pub dropped_results: AtomicU64,
    pub duplicate_completions: AtomicU64,
    pub refused_streams: AtomicU64,
    /// Cancels sent for tasks workers ran that no coordinator tracks.
    pub orphans_cancelled: AtomicU64,
}

/// The coordinator's DataPlane: the gRPC service and the dispatcher.
pub struct Dispatcher {
    settings: DataPlaneSettings,
    active: ActiveCheck,
    state: Mutex<State>,
    wake: Notify,
    next_conn: AtomicU64,
    next_id: AtomicU64,
    pub counters: Counters,
    /// Reports of jobs a coordinator-side planner runs (verify): `None`
    /// while running. The newest [`KEEP_FINISHED`].
    reports: Mutex<BTreeMap<String, Option<serde_json::Value>>>,
    /// Cancels to and from the other coordinators; where dead letters live.
    bus: Arc<dyn TaskBus>,
    /// Dead letters on their way to the bus (written in order by one task).
    dead_letters: mpsc::UnboundedSender<DeadLetter>,
}

/// What [`Dispatcher::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// A task of this coordinator's, in this state before (finished ones
    /// stay as they were).
    Here(TaskState),
    /// Unknown here; broadcast to the other coordinators and every worker.
    Broadcast,
    /// Unknown, and no other coordinator could know it.
    Unknown,
    /// Run by the coordinator itself (a drill), which sees it through.
    NotCancellable,
}

/// Why a re-drive was refused.
#[derive(Debug, thiserror::Error)]
pub enum RedriveError {
    #[error("no task {0} and no dead letter of it")]
    NotFound(String),
    #[error("task {0} is {1}, not a dead letter")]
    NotDeadLetter(String, &'static str),
    #[error(transparent)]
    Bus(#[from] BusError),
}

impl Dispatcher {
    /// Starts the dispatcher and its watchdog (stalls, deadlines) until
    /// `stop`.
    pub fn start(
        settings: DataPlaneSettings,
        active: ActiveCheck,
        bus: Arc<dyn TaskBus>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Arc<Dispatcher> {
        let (dead_tx, dead_rx) = mpsc::unbounded_channel();
        let dispatcher = Arc::new(Dispatcher {
            bus,
            dead_letters: dead_tx,
            settings,
            active,
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            next_conn: AtomicU64::new(1),
            next_id: AtomicU64::new(1),
            counters: Counters::default(),
            reports: Mutex::new(BTreeMap::new()),
        });
        tokio::spawn(dispatcher.clone().run_dispatch(stop.clone()));
        tokio::spawn(dispatcher.clone().run_cancels(stop.clone()));
        tokio::spawn(dispatcher.clone().write_dead_letters(dead_rx, stop.clone()));
        tokio::spawn(dispatcher.clone().run_watchdog(stop));
        dispatcher
    }

    /// A fresh id with `prefix` (`q-…` for jobs, `t-…` for tasks): unique
    /// per coordinator process, ordered, and random enough across restarts.
    pub fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:08x}-{n}", rand::random::<u32>())
    }

    /// Queues a job's tasks; the returned receiver hears their batches and
    /// ends. A task id already known is ignored (idempotent submission).
    pub fn submit(&self, query_id: &str, tasks: Vec<TaskSpec>) -> mpsc::UnboundedReceiver<JobEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut state = self.state.lock();
            let room = Arc::new(Semaphore::new(JOB_QUEUE_BYTES));
            if let Some(replaced) = state.jobs.insert(query_id.to_string(), Job { results: tx, room }) {
                replaced.room.close();
            }
            for spec in tasks {
                if state.tasks.contains_key(&spec.task_id) {
                    continue;
                }
                state.order.push(spec.task_id.clone());
                state.queue.push_back(spec.task_id.clone());
                state.tasks.insert(spec.task_id.clone(), Task::new(spec));
            }
        }
        self.wake.notify_one();
        rx
    }

    /// Records a planned job's report (`None`: still running).
    pub fn set_report(&self, job: &str, report: Option<serde_json::Value>) {
        let mut reports = self.reports.lock();
        reports.insert(job.to_string(), report);
        while reports.len() > KEEP_FINISHED {
            let oldest = reports.keys().next().cloned().expect("non-empty");
            reports.remove(&oldest);
        }
    }

    /// A planned job's report: `Some(None)` while it runs.
    pub fn report(&self, job: &str) -> Option<Option<serde_json::Value>> {
        self.reports.lock().get(job).cloned()
    }

    /// Forgets a job's result routing (its tasks stay listed).
    pub fn close_job(&self, query_id: &str) {
        // A batch waiting for room in its queue goes on (and is dropped).
        if let Some(job) = self.state.lock().jobs.remove(query_id) {
            job.room.close();
        }
    }

    /// Lists a task the coordinator runs itself (a drill) as running on
    /// it; [`Dispatcher::progress_here`] and [`Dispatcher::finish_here`]
    /// keep it current. `false` if the id is taken.
    pub fn track_here(&self, spec: TaskSpec) -> bool {
        let mut state = self.state.lock();
        if state.tasks.contains_key(&spec.task_id) {
            return false;
        }
        let mut task = Task::new(spec);
        task.on_coordinator = true;
        task.dispatched(&format!("coordinator {}", self.settings.coordinator_id), 0);
        task.assigned = None;
        state.order.push(task.spec.task_id.clone());
        state.tasks.insert(task.spec.task_id.clone(), task);
        true
    }

    /// A coordinator-run task's counters now.
    pub fn progress_here(&self, task_id: &str, rows: i64, bytes: i64) {
        if let Some(task) = self.state.lock().tasks.get_mut(task_id).filter(|t| t.on_coordinator) {
            task.report(rows, bytes, unix_ms());
        }
    }

    /// A coordinator-run task ended.
    pub fn finish_here(&self, task_id: &str, state: TaskState, error: Option<String>, summary: serde_json::Value) {
        if let Some(task) = self.state.lock().tasks.get_mut(task_id).filter(|t| t.on_coordinator) {
            task.finish(state, error);
            task.summary = Some(summary);
        }
    }

    /// Every task, oldest first.
    pub fn tasks(&self) -> Vec<Task> {
        let state = self.state.lock();
        state.order.iter().filter_map(|id| state.tasks.get(id).cloned()).collect()
    }

    pub fn task(&self, task_id: &str) -> Option<Task> {
        self.state.lock().tasks.get(task_id).cloned()
    }

    /// Records a finished task's summary (the job that ran it computed it).
    pub fn set_summary(&self, task_id: &str, summary: serde_json::Value) {
        if let Some(task) = self.state.lock().tasks.get_mut(task_id) {
            task.summary = Some(summary);
        }
    }

    /// The connected workers.
    pub fn workers(&self) -> Vec<WorkerView> {
        self.state
            .lock()
            .workers
            .iter()
            .map(|(id, w)| WorkerView {
                worker_id: id.clone(),
                build_sha: w.hello.build_sha.clone(),
                build_matches: w.build_matches,
                num_cpus: w.hello.num_cpus,
                memory_bytes: w.hello.gomemlimit,
                capacity: w.capacity,
                in_flight: w.in_flight,
                connected_unix_ms: w.connected_unix_ms,
            })
            .collect()
    }

    pub fn is_connected(&self, worker: &str) -> bool {
        self.state.lock().workers.contains_key(worker)
    }
}

#[cfg(test)]
#[path = "results_test.rs"]
mod results_test;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_bound_by_cpus_and_memory() {
        assert_eq!(capacity(4, 0), 8);
        assert_eq!(capacity(4, 128 << 20), 2);
        assert_eq!(capacity(0, 0), 2);
        assert_eq!(capacity(8, 1), 1, "at least one");
        assert_eq!(capacity(1_000_000, 0), MAX_CAPACITY, "at most MAX_CAPACITY");
        assert_eq!(capacity(i32::MAX, i64::MAX), MAX_CAPACITY);
    }
}
