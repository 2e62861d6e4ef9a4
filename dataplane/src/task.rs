//! The coordinator's view of a task: what it is, where it runs, how far it
//! got, how it ended. Pure data plus the state transitions, unit-tested.
//!
//! A *job* (`query_id`) is what an operator asked for (verify shard 3,
//! export a range); it runs as one or more *tasks* (`task_id`), each on one
//! worker; `stage_id` on the wire is the task's kind. A task's blob is
//! opaque to the stream: JSON that its kind's runner decodes.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Where a task is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// Waiting for a worker (its target, or any with capacity).
    Queued,
    /// Dispatched; the worker has not finished it.
    Running,
    Succeeded,
    /// Failed for good: its error says why (also a dead letter when it
    /// failed on every attempt).
    Failed,
    Cancelled,
}

impl TaskState {
    pub fn finished(self) -> bool {
        matches!(self, TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled)
    }

    pub fn name(self) -> &'static str {
        match self {
            TaskState::Queued => "queued",
            TaskState::Running => "running",
            TaskState::Succeeded => "succeeded",
            TaskState::Failed => "failed",
            TaskState::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<TaskState> {
        [TaskState::Queued, TaskState::Running, TaskState::Succeeded, TaskState::Failed, TaskState::Cancelled]
            .into_iter()
            .find(|s| s.name() == text)
    }
}

/// What a task is asked to do, as the coordinator keeps it.
#[derive(Debug, Clone)]
pub struct TaskSpec {
    pub task_id: String,
    pub query_id: String,
    /// The kind (`stage_id` on the wire), e.g. `verify`.
    pub kind: String,
    /// The worker that must run it (`node-3`), or any worker.
    pub target: Option<String>,
    /// The shard it concerns, if any (filters, the admin API).
    pub shard: Option<u32>,
    /// The kind's parameters (JSON).
    pub blob: Vec<u8>,
    /// Unix nanoseconds; 0 = none.
    pub deadline_unix_nano: i64,
}

/// Rows and bytes a task reported, and when the coordinator last saw them
/// grow (stall detection) or arrive at all (liveness).
#[derive(Debug, Clone, Copy, Default, Serialize, utoipa::ToSchema)]
pub struct Progress {
    pub rows: i64,
    pub bytes: i64,
    /// Rows per second over the last two reports.
    pub rows_per_s: f64,
    /// Bytes per second over the last two reports.
    pub bytes_per_s: f64,
    /// Unix milliseconds of the last report.
    pub reported_unix_ms: u64,
}

/// A task as the coordinator tracks it.
#[derive(Debug, Clone)]
pub struct Task {
    pub spec: TaskSpec,
    pub state: TaskState,
    /// The worker and connection it runs on now.
    pub assigned: Option<(String, u64)>,
    /// The worker it was last dispatched to (kept after it finished).
    pub last_worker: Option<String>,
    /// Dispatches so far (a redispatch after a disconnect or stall counts,
    /// and those before a re-drive: each dispatch's number is its own, so a
    /// late answer of an earlier one is never taken for the current one's).
    pub attempts: u32,
    /// `attempts` when it was last re-driven from the dead letters: it gets
    /// `max_attempts` more from there.
    pub redriven_after: u32,
    pub progress: Progress,
    /// When its counters last grew (or it was dispatched).
    pub advanced_at: std::time::Instant,
    /// When it was last dispatched.
    dispatched_at: Option<std::time::Instant>,
    pub created_unix_ms: u64,
    /// Microseconds from its last dispatch to its finish, once finished
    /// (the dispatch benchmark's latency).
    pub took_us: Option<u64>,
    pub finished_unix_ms: Option<u64>,
    pub error: Option<String>,
    /// Rows in its result batches.
    pub result_rows: u64,
    /// Bytes of its result payloads.
    pub result_bytes: u64,
    /// A short, kind-specific account of the result (JSON).
    pub summary: Option<serde_json::Value>,
    /// Failed on every attempt: kept in the dead letters until re-driven.
    pub dead_letter: bool,
    /// Run by the coordinator itself (a drill: it orchestrates the cluster,
    /// so no node can run it), never dispatched; its progress comes from
    /// the coordinator, so it does not stall and cannot be cancelled.
    pub on_coordinator: bool,
}

pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

pub fn unix_nanos() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64)
}

impl Task {
    pub fn new(spec: TaskSpec) -> Task {
        Task {
            spec,
            state: TaskState::Queued,
            assigned: None,
            last_worker: None,
            attempts: 0,
            redriven_after: 0,
            progress: Progress::default(),
            advanced_at: std::time::Instant::now(),
            dispatched_at: None,
            created_unix_ms: unix_ms(),
            took_us: None,
            finished_unix_ms: None,
            error: None,
            result_rows: 0,
            result_bytes: 0,
            summary: None,
            dead_letter: false,
            on_coordinator: false,
        }
    }

    /// Dispatched to `worker` on connection `conn`: a new attempt, whose
    /// progress and results count from zero (its worker starts over, and
    /// a count below the last attempt's must still be progress, or the
    /// attempt would be cancelled as stalled).
    pub fn dispatched(&mut self, worker: &str, conn: u64) {
        self.progress = Progress::default();
        self.result_rows = 0;
        self.result_bytes = 0;
        self.took_us = None;
        self.dispatched_at = Some(std::time::Instant::now());
        self.state = TaskState::Running;
        self.assigned = Some((worker.to_string(), conn));
        self.last_worker = Some(worker.to_string());
        self.attempts += 1;
        self.advanced_at = std::time::Instant::now();
    }

    fn advanced_since_dispatch(&self) -> u64 {
        self.dispatched_at.map_or(0, |t| t.elapsed().as_micros() as u64)
    }

    /// Its worker went away or it stalled: back in the queue, or failed
    /// for good (a dead letter) after `max_attempts`.
    pub fn lost(&mut self, why: &str, max_attempts: u32) {
        self.assigned = None;
        let attempts = self.attempts - self.redriven_after;
        if attempts >= max_attempts {
            self.finish(TaskState::Failed, Some(format!("{why}; gave up after {attempts} attempts")));
            self.dead_letter = true;
        } else {
            self.state = TaskState::Queued;
            self.error = Some(why.to_string());
        }
    }

    pub fn finish(&mut self, state: TaskState, error: Option<String>) {
        self.state = state;
        self.error = error;
        self.finished_unix_ms = Some(unix_ms());
        if self.dispatched_at.is_some() {
            self.took_us = Some(self.advanced_since_dispatch());
        }
    }

    /// A progress report: monotonic counters only (a smaller one is
    /// ignored); counts as liveness, and as advance when a counter grew.
    pub fn report(&mut self, rows: i64, bytes: i64, at_unix_ms: u64) {
        let previous = self.progress;
        if rows < previous.rows || bytes < previous.bytes {
            return;
        }
        let seconds = at_unix_ms.saturating_sub(previous.reported_unix_ms) as f64 / 1000.0;
        if previous.reported_unix_ms > 0 && seconds > 0.0 {
            self.progress.rows_per_s = (rows - previous.rows) as f64 / seconds;
            self.progress.bytes_per_s = (bytes - previous.bytes) as f64 / seconds;
        }
        if rows > previous.rows || bytes > previous.bytes {
            self.advanced_at = std::time::Instant::now();
        }
        self.progress.rows = rows;
        self.progress.bytes = bytes;
        self.progress.reported_unix_ms = at_unix_ms;
    }

    /// Running without its counters growing for `stall`.
    pub fn stalled(&self, stall: Duration) -> bool {
        self.state == TaskState::Running && !self.on_coordinator && self.advanced_at.elapsed() > stall
    }

    /// Past its deadline.
    pub fn expired(&self, now_unix_nano: i64) -> bool {
        self.spec.deadline_unix_nano > 0 && now_unix_nano > self.spec.deadline_unix_nano && !self.state.finished()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TaskSpec {
        TaskSpec {
            task_id: "t1".into(),
            query_id: "q1".into(),
            kind: "noop".into(),
            target: None,
            shard: None,
            blob: b"{}".to_vec(),
            deadline_unix_nano: 0,
        }
    }

    #[test]
    fn a_lost_task_is_requeued_until_its_attempts_run_out() {
        let mut t = Task::new(spec());
        t.dispatched("node-1", 1);
        t.lost("node-1 disconnected", 3);
        assert_eq!((t.state, t.assigned.clone(), t.dead_letter), (TaskState::Queued, None, false));
        t.dispatched("node-2", 2);
        t.lost("node-2 disconnected", 3);
        t.dispatched("node-3", 3);
        t.lost("node-3 disconnected", 3);
        assert_eq!(t.state, TaskState::Failed);
        assert!(t.dead_letter);
        assert!(t.error.as_deref().unwrap().contains("after 3 attempts"), "{:?}", t.error);
    }

    #[test]
    fn progress_is_monotonic_and_rates_come_from_deltas() {
        let mut t = Task::new(spec());
        t.dispatched("node-1", 1);
        t.report(100, 1000, 10_000);
        t.report(300, 5000, 12_000);
        assert_eq!((t.progress.rows, t.progress.bytes), (300, 5000));
        assert!((t.progress.rows_per_s - 100.0).abs() < 1e-9);
        assert!((t.progress.bytes_per_s - 2000.0).abs() < 1e-9);
        t.report(200, 6000, 13_000);
        assert_eq!(t.progress.rows, 300, "a smaller counter is ignored");
    }

    #[test]
    fn a_dispatch_again_counts_progress_from_zero() {
        let mut t = Task::new(spec());
        t.dispatched("node-1", 1);
        t.report(5_000, 50_000, 10_000);
        t.result_rows = 5_000;
        t.lost("node-1 disconnected", 3);
        t.dispatched("node-2", 2);
        assert_eq!((t.progress.rows, t.result_rows), (0, 0), "a new attempt starts from nothing");
        std::thread::sleep(Duration::from_millis(5));
        // Its first report is below the last attempt's: progress all the same.
        t.report(10, 100, 20_000);
        assert_eq!(t.progress.rows, 10);
        assert!(!t.stalled(Duration::from_millis(4)), "the new attempt advanced");
    }

    #[test]
    fn stall_and_deadline() {
        let mut t = Task::new(TaskSpec { deadline_unix_nano: 1_000, ..spec() });
        assert!(!t.stalled(Duration::ZERO), "a queued task does not stall");
        t.dispatched("node-1", 1);
        std::thread::sleep(Duration::from_millis(5));
        assert!(t.stalled(Duration::from_millis(1)));
        assert!(!t.stalled(Duration::from_secs(60)));
        assert!(t.expired(2_000) && !t.expired(500));
        t.finish(TaskState::Succeeded, None);
        assert!(!t.expired(2_000), "a finished task does not expire");
    }
}
