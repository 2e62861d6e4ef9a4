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
//!   partial output.
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

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::Stream;
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use walship_proto::dataplane::coord_envelope::Msg as Down;
use walship_proto::dataplane::data_plane_server::DataPlane;
use walship_proto::dataplane::worker_envelope::Msg as Up;
use walship_proto::dataplane::{
    CoordEnvelope, Hello, ResultBatch, TaskCancel, TaskDispatch, TaskProgress, Welcome, WorkerEnvelope,
};

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
}

/// What a job hears about its tasks.
#[derive(Debug)]
pub enum JobEvent {
    /// A batch of task `task_id`'s output (from `worker`).
    Batch { task_id: String, worker: String, batch: ResultBatch },
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
            state.jobs.insert(query_id.to_string(), Job { results: tx });
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
        self.state.lock().jobs.remove(query_id);
    }

    /// Cancels a task: marked cancelled here, and a cancel broadcast to
    /// every coordinator (the bus) and from there to every worker, so it
    /// stops wherever it runs, also on a worker an earlier coordinator
    /// dispatched it to. A task unknown here is broadcast only when other
    /// coordinators hear the bus (one of them may know it).
    pub async fn cancel(&self, task_id: &str, reason: &str) -> Cancelled {
        if self.task(task_id).is_some_and(|t| t.on_coordinator && !t.state.finished()) {
            return Cancelled::NotCancellable;
        }
        let outcome = match self.cancel_here(task_id, reason) {
            Some(before) => Cancelled::Here(before),
            None if self.bus.shared() => Cancelled::Broadcast,
            None => return Cancelled::Unknown,
        };
        if !matches!(outcome, Cancelled::Here(before) if before.finished()) {
            let notice = CancelNotice {
                task_id: task_id.to_string(),
                reason: reason.to_string(),
                origin: self.settings.coordinator_id.clone(),
            };
            if let Err(e) = self.bus.publish_cancel(&notice).await {
                tracing::warn!(task_id, error = %e, "the cancel reached this coordinator's workers only");
            }
        }
        outcome
    }

    /// Marks a task cancelled (if known and running or queued) and tells
    /// every connected worker to stop it (a worker that does not run it
    /// ignores that). Answers its state before, or `None` if unknown.
    fn cancel_here(&self, task_id: &str, reason: &str) -> Option<TaskState> {
        let mut state = self.state.lock();
        let known = match state.tasks.get_mut(task_id) {
            None => None,
            Some(task) if task.on_coordinator => Some(task.state),
            Some(task) => {
                let before = task.state;
                if !before.finished() {
                    let assigned = task.assigned.take();
                    task.finish(TaskState::Cancelled, Some(reason.to_string()));
                    let job = task.spec.query_id.clone();
                    if let Some((worker, _)) = assigned
                        && let Some(w) = state.workers.get_mut(&worker)
                    {
                        w.in_flight = w.in_flight.saturating_sub(1);
                    }
                    if let Some(job) = state.jobs.get(&job) {
                        let _ = job.results.send(JobEvent::Finished {
                            task_id: task_id.to_string(),
                            state: TaskState::Cancelled,
                            error: Some(reason.to_string()),
                        });
                    }
                }
                Some(before)
            }
        };
        if known.is_none_or(|before| !before.finished()) {
            let cancel = TaskCancel { task_id: task_id.to_string(), reason: reason.to_string() };
            for w in state.workers.values() {
                // A worker whose outbox is full has stopped reading; its
                // stream ends by keepalive and the task with it.
                let _ = w.outbox.try_send(Ok(CoordEnvelope { msg: Some(Down::TaskCancel(cancel.clone())) }));
            }
        }
        drop(state);
        self.wake.notify_one();
        known
    }

    /// Applies the cancels the bus brings (this coordinator's own too:
    /// they are idempotent), until `stop`.
    async fn run_cancels(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let mut backoff = Duration::from_millis(200);
        loop {
            let mut cancels = tokio::select! {
                subscribed = self.bus.cancels() => match subscribed {
                    Ok(cancels) => cancels,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot hear task cancels; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = stop.cancelled() => return,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                },
                _ = stop.cancelled() => return,
            };
            backoff = Duration::from_millis(200);
            loop {
                let notice = tokio::select! {
                    notice = cancels.next() => notice,
                    _ = stop.cancelled() => return,
                };
                let Some(notice) = notice else { break };
                if notice.origin != self.settings.coordinator_id {
                    tracing::info!(task_id = %notice.task_id, origin = %notice.origin, "task cancel from another coordinator");
                }
                self.cancel_here(&notice.task_id, &notice.reason);
            }
        }
    }

    /// Writes dead letters to the bus in order, retrying while it is
    /// down (they are also in the task table meanwhile).
    async fn write_dead_letters(
        self: Arc<Self>,
        mut letters: mpsc::UnboundedReceiver<DeadLetter>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        while let Some(letter) = tokio::select! { l = letters.recv() => l, _ = stop.cancelled() => None } {
            loop {
                match self.bus.put_dead_letter(&letter).await {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::warn!(task_id = %letter.task_id, error = %e, "keeping a dead letter failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                            _ = stop.cancelled() => return,
                        }
                    }
                }
            }
        }
    }

    /// What carries cancels and keeps dead letters.
    pub fn bus_description(&self) -> String {
        self.bus.describe()
    }

    /// The dead letters (from the bus: those of earlier coordinators too).
    pub async fn dead_letters(&self) -> Result<Vec<DeadLetter>, BusError> {
        self.bus.dead_letters().await
    }

    /// Queues a dead letter again with fresh attempts: one in this
    /// coordinator's table, or one only the bus knows (failed under an
    /// earlier coordinator: its spec comes from the letter).
    pub async fn redrive(&self, task_id: &str) -> Result<Task, RedriveError> {
        if let Some(task) = self.task(task_id)
            && !task.dead_letter
        {
            return Err(RedriveError::NotDeadLetter(task_id.to_string(), task.state.name()));
        }
        let letter = self.bus.take_dead_letter(task_id).await?;
        let mut state = self.state.lock();
        let state = &mut *state;
        match (state.tasks.get_mut(task_id), letter) {
            (Some(task), _) if task.dead_letter => {
                task.dead_letter = false;
                task.attempts = 0;
                task.state = TaskState::Queued;
                task.finished_unix_ms = None;
            }
            (Some(task), _) => return Err(RedriveError::NotDeadLetter(task_id.to_string(), task.state.name())),
            (None, Some(letter)) => {
                state.order.push(task_id.to_string());
                state.tasks.insert(task_id.to_string(), Task::new(letter.spec()?));
            }
            (None, None) => return Err(RedriveError::NotFound(task_id.to_string())),
        }
        state.queue.push_back(task_id.to_string());
        let task = state.tasks[task_id].clone();
        self.wake.notify_one();
        Ok(task)
    }

    /// A job refused a task's output (a batch it cannot read): a running
    /// task is cancelled everywhere; one that already finished with that
    /// batch is marked failed with `error`.
    pub async fn reject_output(&self, task_id: &str, error: &str) {
        {
            let mut state = self.state.lock();
            if let Some(task) = state.tasks.get_mut(task_id)
                && task.state == TaskState::Succeeded
            {
                task.state = TaskState::Failed;
                task.error = Some(error.to_string());
                return;
            }
        }
        self.cancel(task_id, error).await;
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

    /// Checks a Hello; answers the worker's capacity.
    fn admit(&self, hello: &Hello) -> Result<(usize, bool), Status> {
        let id = &hello.worker_id;
        if id.is_empty() || id.len() > MAX_WORKER_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Status::invalid_argument(format!(
                "Hello.worker_id must be 1 to {MAX_WORKER_ID} printable characters without spaces"
            )));
        }
        if hello.build_sha.len() > MAX_BUILD_SHA || hello.build_sha.chars().any(char::is_control) {
            return Err(Status::invalid_argument(format!(
                "Hello.build_sha must be at most {MAX_BUILD_SHA} bytes without control characters"
            )));
        }
        if hello.num_cpus < 0 || hello.gomemlimit < 0 {
            return Err(Status::invalid_argument("Hello.num_cpus and Hello.gomemlimit must not be negative"));
        }
        let matches = hello.build_sha == self.settings.build_sha;
        if !matches {
            match self.settings.build_policy {
                BuildPolicy::Refuse => {
                    return Err(Status::failed_precondition(format!(
                        "worker {id} runs build {:?}, this coordinator {:?} (build_policy = refuse)",
                        hello.build_sha, self.settings.build_sha
                    )));
                }
                BuildPolicy::Warn => tracing::warn!(
                    worker = %id,
                    worker_build = %hello.build_sha,
                    coordinator_build = %self.settings.build_sha,
                    "a worker runs another build"
                ),
            }
        }
        Ok((capacity(hello.num_cpus, hello.gomemlimit), matches))
    }

    /// A worker's stream ended: its running tasks are requeued.
    fn disconnected(&self, worker: &str, conn: u64) {
        let mut state = self.state.lock();
        if state.workers.get(worker).is_none_or(|w| w.conn != conn) {
            return;
        }
        state.workers.remove(worker);
        let max = self.settings.max_attempts;
        let mut lost = 0;
        let mut finished = Vec::new();
        let State { tasks, queue, .. } = &mut *state;
        for task in tasks.values_mut() {
            if task.state == TaskState::Running
                && task.assigned.as_ref().is_some_and(|(w, c)| w == worker && *c == conn)
            {
                task.lost(&format!("worker {worker} disconnected"), max);
                lost += 1;
                if task.state == TaskState::Queued {
                    queue.push_back(task.spec.task_id.clone());
                }
                if task.state.finished() {
                    finished.push((task.spec.query_id.clone(), task.spec.task_id.clone(), task.error.clone()));
                }
                if task.dead_letter {
                    let _ = self.dead_letters.send(DeadLetter::of(task));
                }
            }
        }
        for (job, task_id, error) in finished {
            if let Some(job) = state.jobs.get(&job) {
                let _ = job.results.send(JobEvent::Finished { task_id, state: TaskState::Failed, error });
            }
        }
        drop(state);
        self.counters.redispatched.fetch_add(lost, Ordering::Relaxed);
        tracing::info!(worker, requeued = lost, "worker disconnected");
        self.wake.notify_one();
    }

    /// One message from `worker` (connection `conn`).
    fn on_message(&self, worker: &str, conn: u64, msg: Up) -> Result<(), Status> {
        match msg {
            Up::Hello(_) => Err(Status::invalid_argument("a second Hello on one stream; reconnect to introduce again")),
            Up::TaskProgress(p) => {
                self.on_progress(worker, conn, p);
                Ok(())
            }
            Up::ResultBatch(batch) => {
                self.on_batch(worker, conn, batch);
                Ok(())
            }
        }
    }

    fn on_progress(&self, worker: &str, conn: u64, p: TaskProgress) {
        let mut state = self.state.lock();
        let Some(task) = state.tasks.get_mut(&p.task_id) else {
            // Running on a worker, unknown here: dispatched by an earlier
            // coordinator (a failover), whose job is gone. Nobody waits
            // for its result, so it only costs the node: stop it.
            if let Some(w) = state.workers.get(worker) {
                let reason = "no coordinator tracks this task (dispatched before a coordinator change)".to_string();
                let cancel = TaskCancel { task_id: p.task_id.clone(), reason };
                let _ = w.outbox.try_send(Ok(CoordEnvelope { msg: Some(Down::TaskCancel(cancel)) }));
                self.counters.orphans_cancelled.fetch_add(1, Ordering::Relaxed);
                tracing::info!(worker, task_id = %p.task_id, "an orphaned task: cancelled");
            }
            return;
        };
        if task.state != TaskState::Running
            || task.assigned.as_ref().is_none_or(|(w, c)| w != worker || *c != conn)
            || (p.attempt != 0 && p.attempt != task.attempts)
        {
            return;
        }
        task.report(p.rows_processed, p.bytes_processed, (p.timestamp_unix_nano / 1_000_000).max(0) as u64);
    }

    fn on_batch(&self, worker: &str, conn: u64, batch: ResultBatch) {
        let mut state = self.state.lock();
        let state = &mut *state;
        let Some(job) = state.jobs.get(&batch.query_id) else {
            self.counters.dropped_results.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(worker, query_id = %batch.query_id, "a result for an unknown job: dropped");
            return;
        };
        let task_id = if batch.task_id.is_empty() {
            // A seed worker: the job's task on this worker.
            state
                .tasks
                .values()
                .find(|t| t.spec.query_id == batch.query_id && t.assigned.as_ref().is_some_and(|(w, _)| w == worker))
                .map(|t| t.spec.task_id.clone())
                .unwrap_or_default()
        } else {
            batch.task_id.clone()
        };
        let Some(task) = state.tasks.get_mut(&task_id) else {
            self.counters.dropped_results.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if task.state != TaskState::Running
            || task.assigned.as_ref().is_none_or(|(w, c)| w != worker || *c != conn)
            || (batch.attempt != 0 && batch.attempt != task.attempts)
        {
            // Finished already, cancelled, redispatched elsewhere, or the
            // late answer of an earlier dispatch.
            self.counters.duplicate_completions.fetch_add(1, Ordering::Relaxed);
            return;
        }
        task.result_rows += batch.row_count.max(0) as u64;
        task.result_bytes += batch.payload.len() as u64;
        let terminal = batch.terminal;
        let failed = !batch.err.is_empty();
        let error = failed.then(|| batch.err.clone());
        let _ = job.results.send(JobEvent::Batch { task_id: task_id.clone(), worker: worker.to_string(), batch });
        if terminal {
            let state_now = if failed { TaskState::Failed } else { TaskState::Succeeded };
            task.finish(state_now, error.clone());
            task.assigned = None;
            let _ = job.results.send(JobEvent::Finished { task_id, state: state_now, error });
            if let Some(w) = state.workers.get_mut(worker) {
                w.in_flight = w.in_flight.saturating_sub(1);
            }
            self.wake.notify_one();
        }
    }

    /// Picks queued tasks and sends them, until `stop`.
    async fn run_dispatch(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        loop {
            // A worker with room whose outbox is full wakes dispatch as soon
            // as it drains, not at the next tick.
            for (outbox, watched) in self.full_outboxes() {
                let me = self.clone();
                tokio::spawn(async move {
                    if let Ok(permit) = outbox.reserve().await {
                        drop(permit);
                    }
                    watched.store(false, Ordering::Release);
                    me.wake.notify_one();
                });
            }
            let sends = self.pick();
            if sends.is_empty() {
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = stop.cancelled() => return,
                    // Deadlines and reconnects also change what can go.
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
                continue;
            }
            for (permit, dispatch) in sends {
                tracing::debug!(task_id = %dispatch.task_id, "dispatched");
                permit.send(Ok(CoordEnvelope { msg: Some(Down::TaskDispatch(dispatch)) }));
                self.counters.dispatched.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Outboxes of workers with room that are full and nobody watches yet.
    #[allow(clippy::type_complexity)]
    fn full_outboxes(&self) -> Vec<(mpsc::Sender<Result<CoordEnvelope, Status>>, Arc<std::sync::atomic::AtomicBool>)> {
        let state = self.state.lock();
        state
            .workers
            .values()
            .filter(|w| w.in_flight < w.capacity && w.outbox.capacity() == 0)
            .filter(|w| !w.drain_watched.swap(true, Ordering::AcqRel))
            .map(|w| (w.outbox.clone(), w.drain_watched.clone()))
            .collect()
    }

    /// Assigns what can go now: queued tasks to workers with room, each
    /// with a slot already reserved in its worker's outbox. A worker whose
    /// outbox is full (it stopped reading: HTTP/2 flow control holds the
    /// messages back) has no room until it drains, so a stuck worker never
    /// holds up dispatch to the others.
    fn pick(&self) -> Vec<(Permit, TaskDispatch)> {
        let mut state = self.state.lock();
        let state = &mut *state;
        let mut sends = Vec::new();
        let has_room = |w: &Worker| w.in_flight < w.capacity && w.outbox.capacity() > 0;
        // Stop scanning once no worker has room: a busy cluster with a long
        // queue costs one pass per freed slot, not one per queued task.
        let mut room: usize = state
            .workers
            .values()
            .filter(|w| has_room(w))
            .map(|w| (w.capacity - w.in_flight).min(w.outbox.capacity()))
            .sum();
        let mut kept = std::collections::VecDeque::with_capacity(state.queue.len());
        while let Some(id) = state.queue.pop_front() {
            if room == 0 {
                kept.push_back(id);
                kept.extend(state.queue.drain(..));
                break;
            }
            let Some(task) = state.tasks.get_mut(&id) else { continue };
            if task.state != TaskState::Queued {
                continue;
            }
            let worker = match &task.spec.target {
                Some(target) => state.workers.get(target).filter(|w| has_room(w)).map(|_| target.clone()),
                None => state
                    .workers
                    .iter()
                    .filter(|(_, w)| has_room(w))
                    .max_by_key(|(id, w)| (w.capacity - w.in_flight, std::cmp::Reverse((*id).clone())))
                    .map(|(id, _)| id.clone()),
            };
            let w = worker.and_then(|worker| state.workers.get_mut(&worker).map(|w| (worker, w)));
            let Some((worker, w)) = w else {
                kept.push_back(id);
                continue;
            };
            // Another sender (a cancel) may have taken the last slot.
            let Ok(permit) = w.outbox.clone().try_reserve_owned() else {
                kept.push_back(id);
                continue;
            };
            w.in_flight += 1;
            room -= 1;
            task.dispatched(&worker, w.conn);
            let dispatch = TaskDispatch {
                task_id: task.spec.task_id.clone(),
                query_id: task.spec.query_id.clone(),
                stage_id: task.spec.kind.clone(),
                task_blob: task.spec.blob.clone().into(),
                deadline_unix_nano: task.spec.deadline_unix_nano,
                attempt: task.attempts,
            };
            sends.push((permit, dispatch));
        }
        state.queue = kept;
        sends
    }

    /// Every second: stalled tasks are cancelled and requeued, expired
    /// ones cancelled and failed; old finished tasks are forgotten.
    async fn run_watchdog(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            let now = unix_nanos();
            let (mut cancels, mut events) = (Vec::new(), Vec::new());
            {
                let mut state = self.state.lock();
                let state = &mut *state;
                for task in state.tasks.values_mut() {
                    let reason = if task.expired(now) {
                        Some(("deadline exceeded".to_string(), true))
                    } else if task.stalled(self.settings.stall) {
                        Some((format!("no progress for {:?}", self.settings.stall), false))
                    } else {
                        None
                    };
                    let Some((reason, fail)) = reason else { continue };
                    let assigned = task.assigned.clone();
                    if fail {
                        task.assigned = None;
                        task.finish(TaskState::Failed, Some(reason.clone()));
                    } else {
                        task.lost(&reason, self.settings.max_attempts);
                        if task.state == TaskState::Queued {
                            state.queue.push_back(task.spec.task_id.clone());
                        }
                    }
                    if task.state.finished() {
                        events.push((task.spec.query_id.clone(), task.spec.task_id.clone(), task.error.clone()));
                    }
                    if task.dead_letter {
                        let _ = self.dead_letters.send(DeadLetter::of(task));
                    }
                    if let Some((worker, _)) = assigned
                        && let Some(w) = state.workers.get_mut(&worker)
                    {
                        w.in_flight = w.in_flight.saturating_sub(1);
                        cancels.push((w.outbox.clone(), TaskCancel { task_id: task.spec.task_id.clone(), reason }));
                    }
                }
                for (job, task_id, error) in events.drain(..) {
                    if let Some(job) = state.jobs.get(&job) {
                        let _ = job.results.send(JobEvent::Finished { task_id, state: TaskState::Failed, error });
                    }
                }
                forget_old(state);
            }
            for (outbox, cancel) in cancels {
                let _ = outbox.try_send(Ok(CoordEnvelope { msg: Some(Down::TaskCancel(cancel)) }));
                self.wake.notify_one();
            }
        }
    }
}

/// Keeps at most [`KEEP_FINISHED`] finished tasks (dead letters are kept).
fn forget_old(state: &mut State) {
    let finished = state.order.iter().filter(|id| state.tasks.get(*id).is_some_and(|t| t.state.finished())).count();
    if finished <= KEEP_FINISHED {
        return;
    }
    let mut excess = finished - KEEP_FINISHED;
    let tasks = &mut state.tasks;
    state.order.retain(|id| {
        let drop = excess > 0 && tasks.get(id).is_some_and(|t| t.state.finished() && !t.dead_letter);
        if drop {
            excess -= 1;
            tasks.remove(id);
        }
        !drop
    });
}

type Outbound = Pin<Box<dyn Stream<Item = Result<CoordEnvelope, Status>> + Send>>;

/// The gRPC service over a [`Dispatcher`].
#[derive(Clone)]
pub struct DataPlaneService(pub Arc<Dispatcher>);

#[tonic::async_trait]
impl DataPlane for DataPlaneService {
    type ConnectStream = Outbound;

    async fn connect(&self, request: Request<Streaming<WorkerEnvelope>>) -> Result<Response<Outbound>, Status> {
        let dispatcher = self.0.clone();
        let refuse = |status: Status| {
            dispatcher.counters.refused_streams.fetch_add(1, Ordering::Relaxed);
            Err(status)
        };
        if let Err(active) = (dispatcher.active)() {
            let mut status = Status::failed_precondition(format!(
                "this coordinator is a standby; connect to the active one{}",
                active.as_deref().map(|a| format!(" at {a}")).unwrap_or_default()
            ));
            if let Some(active) = active.and_then(|a| a.parse().ok()) {
                status.metadata_mut().insert(ACTIVE_METADATA_KEY, active);
            }
            return refuse(status);
        }
        let mut inbound = request.into_inner();
        let first = match tokio::time::timeout(HELLO_TIMEOUT, inbound.message()).await {
            Err(_) => return refuse(Status::deadline_exceeded(format!("no Hello within {HELLO_TIMEOUT:?}"))),
            Ok(Err(status)) => return refuse(status),
            Ok(Ok(None)) => return refuse(Status::invalid_argument("the stream ended before its Hello")),
            Ok(Ok(Some(first))) => first,
        };
        let hello = match first.msg {
            Some(Up::Hello(hello)) => hello,
            Some(_) => {
                return refuse(Status::invalid_argument("the first message of a DataPlane stream must be Hello"));
            }
            None => {
                return refuse(Status::invalid_argument("an empty WorkerEnvelope: the first message must be Hello"));
            }
        };
        let (capacity, build_matches) = match dispatcher.admit(&hello) {
            Ok(admitted) => admitted,
            Err(status) => return refuse(status),
        };
        let worker = hello.worker_id.clone();
        let (tx, rx) = mpsc::channel(OUTBOX);
        let conn = dispatcher.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let mut state = dispatcher.state.lock();
            if let Some(existing) = state.workers.get(&worker)
                && !existing.outbox.is_closed()
            {
                drop(state);
                return refuse(Status::already_exists(format!(
                    "worker {worker} is already connected; a second stream with its id is refused"
                )));
            }
            state.workers.insert(
                worker.clone(),
                Worker {
                    conn,
                    hello: hello.clone(),
                    capacity,
                    in_flight: 0,
                    outbox: tx.clone(),
                    connected_unix_ms: unix_ms(),
                    build_matches,
                    drain_watched: Arc::default(),
                },
            );
        }
        let welcome = Welcome { cluster_id: dispatcher.settings.cluster_id.clone(), server_time: unix_nanos() };
        let _ = tx.send(Ok(CoordEnvelope { msg: Some(Down::Welcome(welcome)) })).await;
        tracing::info!(worker, capacity, build = %hello.build_sha, "worker connected");
        dispatcher.wake.notify_one();
        // Read until the worker goes away or breaks the protocol.
        let reader = dispatcher.clone();
        tokio::spawn(async move {
            let ended = loop {
                match inbound.next().await {
                    None => break None,
                    // A message it cannot take (over the size limit,
                    // undecodable): tell the worker why before closing.
                    Some(Err(status)) => {
                        let _ = tx.send(Err(status.clone())).await;
                        break Some(status.to_string());
                    }
                    Some(Ok(WorkerEnvelope { msg: None })) => {
                        let status = Status::invalid_argument("an empty WorkerEnvelope");
                        let _ = tx.send(Err(status.clone())).await;
                        break Some(status.to_string());
                    }
                    Some(Ok(WorkerEnvelope { msg: Some(msg) })) => {
                        if let Err(status) = reader.on_message(&worker, conn, msg) {
                            let _ = tx.send(Err(status.clone())).await;
                            break Some(status.to_string());
                        }
                    }
                }
            };
            if let Some(error) = ended {
                tracing::info!(worker, error, "worker stream ended");
            }
            reader.disconnected(&worker, conn);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx)) as Outbound))
    }
}

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
