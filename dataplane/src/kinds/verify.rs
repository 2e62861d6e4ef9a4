//! `verify`: every replica of a shard sums a seqno range in chunks
//! ([`crate::verify`]), and the coordinator compares the sums to find the
//! first seqno where a replica differs and which one.
//!
//! * **On a node** ([`VerifyRunner`]): reads its *stored* records
//!   ([`walship_wal::Wal::read_stored`], never the tail cache, so on-disk
//!   damage counts) of `[from, to]`, capped at its own retained and durable
//!   range, page by page (each page's bytes taken from the node's task
//!   read budget, [`crate::limiter`]), and answers the chunk sums
//!   (an Arrow IPC stream, [`crate::verify::encode_chunk_sums`]). A record it cannot read
//!   (damage) is summed as a fixed "unreadable" record, so it shows as a
//!   divergence at exactly that seqno instead of failing the task.
//! * **On the coordinator** ([`run`]): one task per replica (each must run
//!   on its own node), then, if the replicas differ inside a chunk, a
//!   second pass over that chunk alone with one record per chunk, which
//!   names the exact seqno. The report: equal (with the range covered), or
//!   the first divergent seqno, the majority and the replicas that differ
//!   or lack records.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use walship_wal::{Frame, RecordFields, Wal};

use crate::coordinator::{Dispatcher, JobEvent};
use crate::limiter::RateLimiter;
use crate::task::{TaskSpec, TaskState};
use crate::verify::{ChunkSum, Summer, Verdict, decode_chunk_sums, encode_chunk_sums, first_divergence};
use crate::worker::{TaskContext, TaskOutcome, TaskRunner};

pub const KIND: &str = "verify";

/// Records summed per chunk in the first pass.
pub const DEFAULT_CHUNK_RECORDS: u64 = 4096;

/// Bytes read per page.
const PAGE_BYTES: usize = 4 << 20;

/// A verify task's parameters.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyBlob {
    pub shard: u32,
    pub from: u64,
    pub to: u64,
    pub chunk_records: u64,
}

/// Sums a range of this node's replica, its reads paced by the node's
/// task read budget.
pub struct VerifyRunner {
    pub wal: Wal,
    pub budget: Arc<RateLimiter>,
}

/// What a record that cannot be read is summed as: no real record has
/// epoch `u64::MAX`, so it differs from every intact copy.
fn unreadable(seqno: u64) -> Frame {
    Frame::encode(RecordFields {
        seqno,
        epoch: u64::MAX,
        timestamp_us: 0,
        key: b"",
        payload: b"walship: unreadable record",
    })
}

impl TaskRunner for VerifyRunner {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn run(&self, task: Arc<TaskContext>) -> Pin<Box<dyn Future<Output = TaskOutcome> + Send>> {
        let (wal, budget) = (self.wal.clone(), self.budget.clone());
        Box::pin(async move {
            let blob: VerifyBlob =
                serde_json::from_slice(&task.blob).map_err(|e| format!("a verify task's blob: {e}"))?;
            let mut summer = Summer::new(blob.chunk_records).map_err(|e| e.to_string())?;
            let p = wal.positions(blob.shard).map_err(|e| e.to_string())?;
            let mut next = blob.from.max(p.first_seqno);
            let to = blob.to.min(p.durable_seqno);
            while next <= to {
                if task.cancel.is_cancelled() {
                    return Err("cancelled".into());
                }
                match wal.read_stored(blob.shard, next, to, PAGE_BYTES).await {
                    Ok(frames) if frames.is_empty() => break,
                    Ok(frames) => {
                        let bytes: usize = frames.iter().map(|f| f.len()).sum();
                        budget.acquire(bytes).await;
                        for frame in &frames {
                            summer.push(frame).map_err(|e| e.to_string())?;
                        }
                        task.advance(frames.len() as i64, bytes as i64);
                        next = frames.last().map_or(to, |f| f.seqno()) + 1;
                    }
                    // Damage in this page: go record by record past it.
                    Err(_) => {
                        let frame = match wal.read_stored(blob.shard, next, next, usize::MAX).await {
                            Ok(mut one) if !one.is_empty() => one.remove(0),
                            Ok(_) => break,
                            Err(_) => unreadable(next),
                        };
                        budget.acquire(frame.len()).await;
                        summer.push(&frame).map_err(|e| e.to_string())?;
                        task.advance(1, frame.len() as i64);
                        next += 1;
                    }
                }
            }
            let sums = summer.finish();
            Ok((sums.len() as i32, encode_chunk_sums(&sums)))
        })
    }
}

/// What a verify found.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct VerifyReport {
    pub shard: u32,
    pub from: u64,
    pub to: u64,
    pub replicas: Vec<u32>,
    /// `equal`, `diverged`, `empty` (no replica holds a record of the
    /// range), `settled` (they differed in the first pass but agreed when
    /// the differing chunk was looked at again: a repair or catch-up ran in
    /// between; `note` names the range) or `failed` (a replica's task
    /// failed: `error` says why).
    pub verdict: String,
    /// The range every replica holds identically (`equal`).
    pub equal_through: Option<u64>,
    /// The first seqno where the replicas differ (`diverged`).
    pub first_divergent_seqno: Option<u64>,
    /// The replicas that agree there, if a strict majority does.
    pub majority: Vec<u32>,
    /// The replicas that differ from the majority there (all, on a tie).
    pub differing: Vec<u32>,
    /// The replicas that lack records from the divergence on.
    pub missing: Vec<u32>,
    pub error: Option<String>,
    pub note: Option<String>,
}

/// One pass: a task per replica over `[from, to]`; answers each node's
/// sums, or the first failure.
async fn pass(
    dispatcher: &Arc<Dispatcher>,
    shard: u32,
    replicas: &[u32],
    from: u64,
    to: u64,
    chunk_records: u64,
    deadline_unix_nano: i64,
) -> Result<(String, Vec<(u32, Vec<ChunkSum>)>), String> {
    let query_id = dispatcher.new_id("q");
    let blob = serde_json::to_vec(&VerifyBlob { shard, from, to, chunk_records }).expect("plain data");
    let mut tasks = BTreeMap::new();
    let specs = replicas
        .iter()
        .map(|&node| {
            let task_id = dispatcher.new_id("t");
            tasks.insert(task_id.clone(), node);
            TaskSpec {
                task_id,
                query_id: query_id.clone(),
                kind: KIND.to_string(),
                target: Some(format!("node-{node}")),
                shard: Some(shard),
                blob: blob.clone(),
                deadline_unix_nano,
            }
        })
        .collect();
    let mut events = dispatcher.submit(&query_id, specs);
    let mut sums: BTreeMap<u32, Vec<ChunkSum>> = BTreeMap::new();
    let mut done = 0;
    let outcome = loop {
        let Some(event) = events.recv().await else { break Err("the job's events ended".to_string()) };
        match event {
            JobEvent::Batch { task_id, batch, .. } if batch.terminal && batch.err.is_empty() => {
                let Some(&node) = tasks.get(&task_id) else { continue };
                match decode_chunk_sums(&batch.payload) {
                    Ok(s) => {
                        sums.insert(node, s);
                    }
                    Err(e) => break Err(format!("node {node} answered unreadable sums: {e}")),
                }
            }
            JobEvent::Batch { .. } => {}
            JobEvent::Finished { task_id, state, error } => {
                if state != TaskState::Succeeded {
                    let node = tasks.get(&task_id).copied().unwrap_or_default();
                    break Err(format!("node {node}'s task {}: {}", state.name(), error.unwrap_or_default()));
                }
                done += 1;
                if done == tasks.len() {
                    break Ok(());
                }
            }
        }
    };
    dispatcher.close_job(&query_id);
    if let Err(e) = outcome {
        for task_id in tasks.keys() {
            dispatcher.cancel(task_id, "another replica's verify task failed").await;
        }
        return Err(e);
    }
    Ok((query_id, sums.into_iter().collect()))
}

/// Verifies `[from, to]` of `shard` across `replicas`; records the report
/// as the summary of every task it ran.
pub async fn run(
    dispatcher: Arc<Dispatcher>,
    shard: u32,
    replicas: Vec<u32>,
    from: u64,
    to: u64,
    chunk_records: u64,
    deadline_unix_nano: i64,
) -> VerifyReport {
    let mut report = VerifyReport {
        shard,
        from,
        to,
        replicas: replicas.clone(),
        verdict: "failed".into(),
        equal_through: None,
        first_divergent_seqno: None,
        majority: Vec::new(),
        differing: Vec::new(),
        missing: Vec::new(),
        error: None,
        note: None,
    };
    let mut jobs = Vec::new();
    let mut rechecked = None;
    let outcome = async {
        let (job, sums) = pass(&dispatcher, shard, &replicas, from, to, chunk_records, deadline_unix_nano).await?;
        jobs.push(job);
        let mut verdict = first_divergence(&sums).map_err(|e| e.to_string())?;
        if let Verdict::Diverged(d) = &verdict
            && d.exact_seqno().is_none()
        {
            rechecked = Some((d.first, d.last));
            let (job, sums) = pass(&dispatcher, shard, &replicas, d.first, d.last, 1, deadline_unix_nano).await?;
            jobs.push(job);
            verdict = first_divergence(&sums).map_err(|e| e.to_string())?;
        }
        Ok::<Verdict, String>(verdict)
    }
    .await;
    match outcome {
        Ok(Verdict::AllEqual { .. } | Verdict::Empty) if rechecked.is_some() => {
            let (first, last) = rechecked.expect("checked");
            report.verdict = "settled".into();
            report.note = Some(format!(
                "the replicas differed in [{first}, {last}] in the first pass and agreed on a second look: \
                 a repair or catch-up ran in between; verify again to confirm"
            ));
        }
        Err(e) => report.error = Some(e),
        Ok(Verdict::Empty) => report.verdict = "empty".into(),
        Ok(Verdict::AllEqual { last, .. }) => {
            report.verdict = "equal".into();
            report.equal_through = Some(last);
        }
        Ok(Verdict::Diverged(d)) => {
            report.verdict = "diverged".into();
            report.first_divergent_seqno = Some(d.first);
            report.majority = d.majority_nodes().map(<[u32]>::to_vec).unwrap_or_default();
            report.differing = d.dissenters();
            report.missing = d.missing();
        }
    }
    let summary = serde_json::to_value(&report).expect("plain data");
    for task in dispatcher.tasks() {
        if jobs.contains(&task.spec.query_id) {
            dispatcher.set_summary(&task.spec.task_id, summary.clone());
        }
    }
    report
}
