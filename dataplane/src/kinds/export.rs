//! `export`: a shard's records of a range as Arrow (seqno, epoch,
//! timestamp, key, payload; [`crate::arrow_export`]).
//!
//! * **On a node** ([`ExportRunner`]): reads `[from, to]` (capped at what
//!   its replica knows committed: nothing a failover could still take
//!   back) page by page (each page's bytes taken from the node's
//!   task read budget, [`crate::limiter`]) and sends each page as one `ResultBatch`
//!   holding an Arrow IPC stream.
//! * **On the coordinator** ([`run`]): one task on the shard's leader; its
//!   batches are appended, in order, to an Arrow IPC *file*
//!   (`<coordinator data dir>/exports/<job>.arrow`) that pyarrow, DuckDB or
//!   any Arrow reader opens. If the task is dispatched again (its node went
//!   away), the file starts over; if it fails, the partial file is removed.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use walship_wal::Wal;

use crate::arrow_export::{IpcFileWriter, ipc_stream};
use crate::coordinator::{Dispatcher, JobEvent};
use crate::limiter::RateLimiter;
use crate::task::{TaskSpec, TaskState};
use crate::worker::{TaskContext, TaskOutcome, TaskRunner};

pub const KIND: &str = "export";

/// Record bytes per batch (each batch is one DataPlane message).
const PAGE_BYTES: usize = 4 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportBlob {
    pub shard: u32,
    pub from: u64,
    pub to: u64,
}

/// Reads a range of this node's replica as Arrow batches, its reads paced
/// by the node's task read budget.
pub struct ExportRunner {
    pub wal: Wal,
    pub budget: Arc<RateLimiter>,
    pub committed: super::Committed,
}

impl TaskRunner for ExportRunner {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn run(&self, task: Arc<TaskContext>) -> Pin<Box<dyn Future<Output = TaskOutcome> + Send>> {
        let (wal, budget, committed) = (self.wal.clone(), self.budget.clone(), self.committed.clone());
        Box::pin(async move {
            let blob: ExportBlob =
                serde_json::from_slice(&task.blob).map_err(|e| format!("an export task's blob: {e}"))?;
            let p = wal.positions(blob.shard).map_err(|e| e.to_string())?;
            let committed = committed(blob.shard).ok_or_else(|| format!("shard {}: no replica here", blob.shard))?;
            if blob.from < p.first_seqno {
                return Err(format!(
                    "shard {}: records before {} are no longer retained here (asked from {})",
                    blob.shard, p.first_seqno, blob.from
                ));
            }
            let to = blob.to.min(p.durable_seqno).min(committed);
            let mut next = blob.from;
            while next <= to {
                if task.cancel.is_cancelled() {
                    return Err("cancelled".into());
                }
                let frames = wal.read(blob.shard, next, to, PAGE_BYTES).await.map_err(|e| e.to_string())?;
                let Some(last) = frames.last().map(|f| f.seqno()) else { break };
                let bytes: usize = frames.iter().map(|f| f.len()).sum();
                budget.acquire(bytes).await;
                let payload = ipc_stream(&frames).map_err(|e| e.to_string())?;
                task.send(frames.len() as i32, payload).await?;
                task.advance(frames.len() as i64, bytes as i64);
                next = last + 1;
            }
            Ok((0, Vec::new()))
        })
    }
}

/// What an export wrote.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ExportReport {
    pub shard: u32,
    pub from: u64,
    pub to: u64,
    /// The node that read the records.
    pub node: u32,
    /// `done` or `failed`.
    pub state: String,
    pub rows: u64,
    pub bytes: u64,
    /// The Arrow IPC file on the coordinator (`GET /v1/jobs/{id}/export`).
    pub file: Option<String>,
    pub error: Option<String>,
}

/// Where job `job`'s export file lives under `dir`.
pub fn file_of(dir: &Path, job: &str) -> PathBuf {
    dir.join(format!("{job}.arrow"))
}

/// Exports `[from, to]` of `shard` read on `node` into `file_of(dir, job)`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    dispatcher: Arc<Dispatcher>,
    dir: PathBuf,
    job: String,
    shard: u32,
    node: u32,
    from: u64,
    to: u64,
    deadline_unix_nano: i64,
) -> ExportReport {
    let path = file_of(&dir, &job);
    let mut report =
        ExportReport { shard, from, to, node, state: "failed".into(), rows: 0, bytes: 0, file: None, error: None };
    let outcome: Result<u64, String> = async {
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let task_id = dispatcher.new_id("t");
        let blob = serde_json::to_vec(&ExportBlob { shard, from, to }).expect("plain data");
        let spec = TaskSpec {
            task_id: task_id.clone(),
            query_id: job.clone(),
            kind: KIND.to_string(),
            target: Some(format!("node-{node}")),
            shard: Some(shard),
            blob,
            deadline_unix_nano,
        };
        let mut events = dispatcher.submit(&job, vec![spec]);
        let mut writer = IpcFileWriter::create(&path).map_err(|e| e.to_string())?;
        let mut attempt = 1;
        let result = loop {
            let Some(event) = events.recv().await else { break Err("the job's events ended".to_string()) };
            match event {
                JobEvent::Batch { batch, .. } => {
                    let of = if batch.attempt != 0 {
                        batch.attempt
                    } else {
                        dispatcher.task(&task_id).map_or(attempt, |t| t.attempts)
                    };
                    match Attempt::of(of, attempt) {
                        // Queued before its dispatch was lost: the next
                        // attempt sends these rows again.
                        Attempt::Earlier => continue,
                        Attempt::Current => {}
                        // A dispatch after the first starts over from `from`.
                        Attempt::Later => {
                            attempt = of;
                            match IpcFileWriter::create(&path) {
                                Ok(fresh) => writer = fresh,
                                Err(e) => break Err(e.to_string()),
                            }
                        }
                    }
                    if !batch.payload.is_empty()
                        && let Err(e) = writer.write_ipc_stream(&batch.payload)
                    {
                        let error = format!("a batch from node {node}: {e}");
                        // Its output is refused: the task stops (or, if
                        // that was its last batch, counts as failed).
                        dispatcher.reject_output(&task_id, &error).await;
                        break Err(error);
                    }
                }
                JobEvent::Finished { state: TaskState::Succeeded, .. } => break Ok(()),
                JobEvent::Finished { state, error, .. } => {
                    break Err(format!("the export task {}: {}", state.name(), error.unwrap_or_default()));
                }
            }
        };
        dispatcher.close_job(&job);
        result?;
        writer.finish().map_err(|e| e.to_string())
    }
    .await;
    match outcome {
        Ok(rows) => {
            report.state = "done".into();
            report.rows = rows;
            report.bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
            report.file = Some(path.display().to_string());
        }
        Err(error) => {
            let _ = std::fs::remove_file(&path);
            report.error = Some(error);
        }
    }
    report
}

/// Where a result batch's dispatch stands against the one the file is being
/// written from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Earlier,
    Current,
    Later,
}

impl Attempt {
    fn of(batch: u32, writing: u32) -> Attempt {
        match batch.cmp(&writing) {
            std::cmp::Ordering::Less => Attempt::Earlier,
            std::cmp::Ordering::Equal => Attempt::Current,
            std::cmp::Ordering::Greater => Attempt::Later,
        }
    }
}

#[cfg(test)]
mod attempt_tests {
    use super::Attempt;

    #[test]
    fn batches_of_a_lost_dispatch_are_dropped_and_a_new_one_starts_the_file_over() {
        // Batches of attempt 1 still queued when attempt 2 began: before,
        // the file was started over at the first of them (the task's
        // attempt count was already 2) and they were written into it, then
        // all of attempt 2: rows twice.
        assert_eq!(Attempt::of(1, 2), Attempt::Earlier);
        assert_eq!(Attempt::of(2, 2), Attempt::Current);
        assert_eq!(Attempt::of(3, 2), Attempt::Later);
    }
}
