//! Jobs the coordinator starts on its own or runs itself:
//!
//! * **verify**, on demand ([`launch_verify`], `POST /v1/tasks`) and on a
//!   schedule ([`schedule_verify`], `walship coord --verify-every`): every
//!   shard in turn, over all it has committed, one shard at a time so a
//!   scrub never loads more than one shard's replicas at once. The last
//!   scheduled verdict of each shard shows in `GET /v1/cluster`; a
//!   divergence is logged at ERROR.
//! * **drills** ([`track_drill`]): a drill orchestrates the cluster from the
//!   coordinator (it pauses leaders, fences epochs, damages a replica), so
//!   no node can run it; it is listed in the task table as a task run by
//!   the coordinator (`drill-failover`, `drill-catchup`, ...), with its
//!   progress, and its report as the task's summary when it ends.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use std::sync::Mutex;
use tokio::task::JoinHandle;
use walship_dataplane::kinds::verify::{self, VerifyReport};
use walship_dataplane::task::{TaskSpec, TaskState, unix_ms};

use crate::coord::CoordAdmin;

/// Why a verify could not start.
#[derive(Debug)]
pub enum VerifyRefused {
    NoShard,
    Bad(String),
}

/// Starts a verify job of `shard` over `[from, to]` (defaults: 1 and the
/// leader's commit seqno now). Answers its job id and its report to come.
pub fn launch_verify(
    admin: &Arc<CoordAdmin>,
    shard: u32,
    from: Option<u64>,
    to: Option<u64>,
    chunk_records: Option<u64>,
    deadline_unix_nano: i64,
) -> Result<(String, JoinHandle<VerifyReport>), VerifyRefused> {
    let Some(spec) = admin.coordinator.config.shards.iter().find(|s| s.id == shard) else {
        return Err(VerifyRefused::NoShard);
    };
    let from = from.unwrap_or(1).max(1);
    let to = to.or_else(|| crate::tasks::leader_and_commit(admin, shard).1).unwrap_or(u64::MAX);
    let chunk = chunk_records.unwrap_or(verify::DEFAULT_CHUNK_RECORDS);
    if !(1..=1_000_000).contains(&chunk) {
        return Err(VerifyRefused::Bad(format!("chunk_records {chunk} is outside 1..=1000000")));
    }
    let dispatcher = admin.dataplane.clone();
    let job = dispatcher.new_id("v");
    dispatcher.set_report(&job, None);
    let (j, replicas) = (job.clone(), spec.replicas.clone());
    let report = tokio::spawn(async move {
        let report = verify::run(dispatcher.clone(), shard, replicas, from, to, chunk, deadline_unix_nano).await;
        tracing::info!(job = %j, verdict = %report.verdict, first = ?report.first_divergent_seqno, "verify finished");
        dispatcher.set_report(&j, Some(serde_json::to_value(&report).expect("plain data")));
        report
    });
    Ok((job, report))
}

/// The last scheduled verify of one shard.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ScheduledVerify {
    pub shard: u32,
    /// Its job (`GET /v1/jobs/{id}` has the whole report).
    pub job_id: String,
    /// The report's verdict: equal, diverged, empty, settled or failed.
    pub verdict: String,
    pub first_divergent_seqno: Option<u64>,
    pub differing: Vec<u32>,
    /// The range it covered.
    pub from: u64,
    pub to: u64,
    pub finished_unix_ms: u64,
}

/// The verify schedule as `GET /v1/cluster` shows it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct VerifySchedule {
    /// Seconds between scrubs of the whole cluster (0: off).
    pub every_s: u64,
    /// Each shard's last scheduled verify, by shard.
    pub last: Vec<ScheduledVerify>,
}

/// The schedule's state, kept in [`CoordAdmin`].
#[derive(Default)]
pub struct VerifyScheduleState {
    every: Mutex<Duration>,
    last: Mutex<BTreeMap<u32, ScheduledVerify>>,
}

impl VerifyScheduleState {
    pub fn view(&self) -> VerifySchedule {
        VerifySchedule {
            every_s: self.every.lock().expect("not poisoned").as_secs(),
            last: self.last.lock().expect("not poisoned").values().cloned().collect(),
        }
    }
}

/// Verifies every shard, one after the other, every `every` (counted from
/// the end of the previous round), while this coordinator is the active
/// one; until the coordinator shuts down. `every` zero: never.
pub fn schedule_verify(admin: Arc<CoordAdmin>, every: Duration) {
    *admin.verify_schedule.every.lock().expect("not poisoned") = every;
    if every.is_zero() {
        return;
    }
    let stop = admin.coordinator.shutdown.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.cancelled() => return,
            }
            if !admin.coordinator.is_active() {
                continue;
            }
            let shards: Vec<u32> = admin.coordinator.config.shards.iter().map(|s| s.id).collect();
            for shard in shards {
                let Ok((job, report)) = launch_verify(&admin, shard, None, None, None, 0) else { continue };
                let report = tokio::select! {
                    report = report => report,
                    _ = stop.cancelled() => return,
                };
                let Ok(report) = report else { continue };
                if report.verdict == "diverged" || report.verdict == "failed" {
                    tracing::error!(
                        shard, job = %job, verdict = %report.verdict, first = ?report.first_divergent_seqno,
                        differing = ?report.differing, error = ?report.error,
                        "scheduled verify: the replicas do not hold the same records"
                    );
                }
                admin.verify_schedule.last.lock().expect("not poisoned").insert(
                    shard,
                    ScheduledVerify {
                        shard,
                        job_id: job,
                        verdict: report.verdict,
                        first_divergent_seqno: report.first_divergent_seqno,
                        differing: report.differing,
                        from: report.from,
                        to: report.to,
                        finished_unix_ms: unix_ms(),
                    },
                );
            }
        }
    });
}

/// Lists drill `id` (just started) in the task table as a task the
/// coordinator runs, and keeps its progress and outcome current there.
pub fn track_drill(admin: &CoordAdmin, id: &str) {
    let drills = admin.coordinator.clone();
    let Some(report) = drills.drills.get(id) else { return };
    let (kind, shard, id) = (format!("drill-{}", report.kind), report.shard, id.to_string());
    let poll = {
        let id = id.clone();
        move || {
            let report = drills.drills.get(&id)?;
            let ended = (report.state != "running").then(|| (report.state == "done", report.error.clone()));
            let summary = match ended {
                None => serde_json::json!({ "progress": report.progress }),
                Some(_) => serde_json::to_value(&report).expect("plain data"),
            };
            Some(Tick { rows: 0, bytes: report.bytes_written as i64, summary, ended })
        }
    };
    track_here(admin, &id, kind, shard, poll);
}

/// What a task the coordinator runs itself reports on one look.
pub(crate) struct Tick {
    pub rows: i64,
    pub bytes: i64,
    pub summary: serde_json::Value,
    /// None while it runs; once it ended, whether it succeeded, and why not.
    pub ended: Option<(bool, Option<String>)>,
}

/// Lists task `id` (kind `kind`, on `shard`), run by the coordinator
/// itself, in the task table, and every 250 ms copies what `poll` reports
/// into its row until it ends (or `poll` no longer knows it).
pub(crate) fn track_here(
    admin: &CoordAdmin,
    id: &str,
    kind: String,
    shard: u32,
    poll: impl Fn() -> Option<Tick> + Send + 'static,
) {
    let dispatcher = admin.dataplane.clone();
    let spec = TaskSpec {
        task_id: id.to_string(),
        query_id: id.to_string(),
        kind,
        target: None,
        shard: Some(shard),
        blob: Vec::new(),
        deadline_unix_nano: 0,
    };
    if !dispatcher.track_here(spec) {
        return;
    }
    let id = id.to_string();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            let Some(now) = poll() else { return };
            dispatcher.progress_here(&id, now.rows, now.bytes);
            match now.ended {
                None => dispatcher.set_summary(&id, now.summary),
                Some((succeeded, error)) => {
                    let outcome = if succeeded { TaskState::Succeeded } else { TaskState::Failed };
                    dispatcher.finish_here(&id, outcome, error, now.summary);
                    return;
                }
            }
        }
    });
}
