//! What coordinators share about tasks beyond one process: cancellations
//! broadcast to every coordinator (and through the active one to every
//! worker), and the dead letters (tasks that failed on every attempt),
//! kept where a coordinator restart or failover does not lose them.
//!
//! One trait, two implementations, one conformance suite (the tests below
//! run it on [`LocalBus`]; `tests/dataplane_nats.rs` runs it against a real
//! NATS server):
//!
//! * [`LocalBus`], the embedded default: cancels on an in-process
//!   broadcast channel, dead letters in a JSON file in the coordinator's
//!   data dir (rewritten atomically, so a restart finds them);
//! * [`NatsBus`] (production, with `walship coord --nats`): cancels on the
//!   core NATS subject `walship.<cluster>.tasks.cancel` (every coordinator
//!   subscribes), dead letters in the JetStream stream
//!   `WALSHIP_DEAD_LETTERS_<cluster>` with one message per task
//!   (`walship.<cluster>.dead.<task id>`, at most one kept per subject), so
//!   `nats stream view` shows them too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use futures::StreamExt;
use futures::stream::BoxStream;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::task::{Task, TaskSpec};

/// Dead letters kept; past this the oldest are dropped (with a WARN).
pub const MAX_DEAD_LETTERS: usize = 10_000;

/// A request to stop a task everywhere it may run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelNotice {
    pub task_id: String,
    pub reason: String,
    /// The coordinator that asked (logs).
    pub origin: String,
}

/// A task that failed on every attempt, with everything needed to run it
/// again (on any coordinator: it carries the task's spec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeadLetter {
    pub task_id: String,
    /// Its job.
    pub query_id: String,
    pub kind: String,
    pub target: Option<String>,
    pub shard: Option<u32>,
    /// The task's parameters, base64.
    pub blob_b64: String,
    pub deadline_unix_nano: i64,
    pub attempts: u32,
    /// Why its last attempt failed.
    pub error: String,
    pub last_worker: Option<String>,
    pub failed_unix_ms: u64,
}

impl DeadLetter {
    pub fn of(task: &Task) -> DeadLetter {
        DeadLetter {
            task_id: task.spec.task_id.clone(),
            query_id: task.spec.query_id.clone(),
            kind: task.spec.kind.clone(),
            target: task.spec.target.clone(),
            shard: task.spec.shard,
            blob_b64: base64::engine::general_purpose::STANDARD.encode(&task.spec.blob),
            deadline_unix_nano: task.spec.deadline_unix_nano,
            attempts: task.attempts,
            error: task.error.clone().unwrap_or_default(),
            last_worker: task.last_worker.clone(),
            failed_unix_ms: task.finished_unix_ms.unwrap_or_else(crate::task::unix_ms),
        }
    }

    /// The task to queue again (a re-drive). Its deadline is dropped: one
    /// that made it fail would fail it again at once.
    pub fn spec(&self) -> Result<TaskSpec, BusError> {
        let blob = base64::engine::general_purpose::STANDARD
            .decode(&self.blob_b64)
            .map_err(|e| BusError::Corrupt(format!("dead letter {}: blob: {e}", self.task_id)))?;
        Ok(TaskSpec {
            task_id: self.task_id.clone(),
            query_id: self.query_id.clone(),
            kind: self.kind.clone(),
            target: self.target.clone(),
            shard: self.shard,
            blob,
            deadline_unix_nano: 0,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("task bus unavailable: {0}")]
    Unavailable(String),
    #[error("task bus holds something unreadable: {0}")]
    Corrupt(String),
}

/// Cancellations and dead letters, shared by the cluster's coordinators.
#[async_trait::async_trait]
pub trait TaskBus: Send + Sync + 'static {
    /// Tells every coordinator (this one included) to cancel a task.
    async fn publish_cancel(&self, notice: &CancelNotice) -> Result<(), BusError>;
    /// Cancellations published from now on (by any coordinator).
    async fn cancels(&self) -> Result<BoxStream<'static, CancelNotice>, BusError>;
    /// Keeps a dead letter (replacing one with the same task id).
    async fn put_dead_letter(&self, letter: &DeadLetter) -> Result<(), BusError>;
    /// Every dead letter, oldest failure first.
    async fn dead_letters(&self) -> Result<Vec<DeadLetter>, BusError>;
    /// Removes a dead letter and answers it (`None`: there is none, e.g.
    /// another coordinator re-drove it first).
    async fn take_dead_letter(&self, task_id: &str) -> Result<Option<DeadLetter>, BusError>;
    /// What backs it, for status pages.
    fn describe(&self) -> String;
    /// Whether other coordinator processes hear this bus (a cancel for a
    /// task this coordinator does not know may reach one that does).
    fn shared(&self) -> bool;
}

fn sort(mut letters: Vec<DeadLetter>) -> Vec<DeadLetter> {
    letters.sort_by(|a, b| (a.failed_unix_ms, &a.task_id).cmp(&(b.failed_unix_ms, &b.task_id)));
    letters
}

// ---- in process ----------------------------------------------------------

/// The embedded bus: one process's broadcast channel and a file.
pub struct LocalBus {
    cancels: broadcast::Sender<CancelNotice>,
    /// `<dir>/dead-letters.json`, or memory only (unit tests).
    file: Option<PathBuf>,
    letters: Mutex<BTreeMap<String, DeadLetter>>,
}

impl LocalBus {
    /// A bus keeping its dead letters in `dir` (created), reading what an
    /// earlier run left there.
    pub fn open(dir: &Path) -> Result<LocalBus, BusError> {
        std::fs::create_dir_all(dir).map_err(|e| BusError::Unavailable(format!("{}: {e}", dir.display())))?;
        let file = dir.join("dead-letters.json");
        let letters: BTreeMap<String, DeadLetter> = match std::fs::read(&file) {
            Ok(bytes) => serde_json::from_slice::<Vec<DeadLetter>>(&bytes)
                .map_err(|e| BusError::Corrupt(format!("{}: {e}", file.display())))?
                .into_iter()
                .map(|l| (l.task_id.clone(), l))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(BusError::Unavailable(format!("{}: {e}", file.display()))),
        };
        Ok(LocalBus { cancels: broadcast::channel(1024).0, file: Some(file), letters: Mutex::new(letters) })
    }

    /// A bus that keeps nothing on disk.
    pub fn in_memory() -> LocalBus {
        LocalBus { cancels: broadcast::channel(1024).0, file: None, letters: Mutex::new(BTreeMap::new()) }
    }

    /// Writes the letters (under the lock: writes stay in order).
    fn save(&self, letters: &BTreeMap<String, DeadLetter>) -> Result<(), BusError> {
        let Some(file) = &self.file else { return Ok(()) };
        let all: Vec<&DeadLetter> = letters.values().collect();
        let bytes = serde_json::to_vec_pretty(&all).map_err(|e| BusError::Corrupt(e.to_string()))?;
        let tmp = file.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, file)?;
            if let Some(dir) = file.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| BusError::Unavailable(format!("{}: {e}", file.display())))
    }
}

#[async_trait::async_trait]
impl TaskBus for LocalBus {
    async fn publish_cancel(&self, notice: &CancelNotice) -> Result<(), BusError> {
        // No subscriber is not an error: nobody runs anything to stop.
        let _ = self.cancels.send(notice.clone());
        Ok(())
    }

    async fn cancels(&self) -> Result<BoxStream<'static, CancelNotice>, BusError> {
        let rx = self.cancels.subscribe();
        Ok(tokio_stream::wrappers::BroadcastStream::new(rx).filter_map(|n| async move { n.ok() }).boxed())
    }

    async fn put_dead_letter(&self, letter: &DeadLetter) -> Result<(), BusError> {
        let mut letters = self.letters.lock();
        letters.insert(letter.task_id.clone(), letter.clone());
        while letters.len() > MAX_DEAD_LETTERS {
            let oldest = sort(letters.values().cloned().collect()).remove(0).task_id;
            tracing::warn!(task_id = %oldest, "more than {MAX_DEAD_LETTERS} dead letters: the oldest is dropped");
            letters.remove(&oldest);
        }
        self.save(&letters)
    }

    async fn dead_letters(&self) -> Result<Vec<DeadLetter>, BusError> {
        Ok(sort(self.letters.lock().values().cloned().collect()))
    }

    async fn take_dead_letter(&self, task_id: &str) -> Result<Option<DeadLetter>, BusError> {
        let mut letters = self.letters.lock();
        let Some(letter) = letters.remove(task_id) else { return Ok(None) };
        if let Err(e) = self.save(&letters) {
            letters.insert(task_id.to_string(), letter);
            return Err(e);
        }
        Ok(Some(letter))
    }

    fn describe(&self) -> String {
        match &self.file {
            Some(file) => format!("in-process (dead letters in {})", file.display()),
            None => "in-process (memory)".to_string(),
        }
    }

    fn shared(&self) -> bool {
        false
    }
}

// ---- NATS ----------------------------------------------------------------

/// The production bus: core NATS for cancels, JetStream for dead letters.
pub struct NatsBus {
    client: async_nats::Client,
    stream: async_nats::jetstream::stream::Stream,
    js: async_nats::jetstream::Context,
    cancel_subject: String,
    dead_prefix: String,
    stream_name: String,
}

/// A cluster id or task id as one NATS subject token / stream name part.
fn token(text: &str) -> String {
    text.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

impl NatsBus {
    /// Opens (creating if needed) the dead-letter stream of `cluster_id`.
    pub async fn open(client: async_nats::Client, cluster_id: &str) -> Result<NatsBus, BusError> {
        let cluster = token(cluster_id);
        let js = async_nats::jetstream::new(client.clone());
        let stream_name = format!("WALSHIP_DEAD_LETTERS_{cluster}");
        let dead_prefix = format!("walship.{cluster}.dead");
        let stream = js
            .get_or_create_stream(async_nats::jetstream::stream::Config {
                name: stream_name.clone(),
                subjects: vec![format!("{dead_prefix}.>")],
                max_messages_per_subject: 1,
                max_messages: MAX_DEAD_LETTERS as i64,
                discard: async_nats::jetstream::stream::DiscardPolicy::Old,
                storage: async_nats::jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| BusError::Unavailable(format!("JetStream stream {stream_name}: {e}")))?;
        Ok(NatsBus {
            client,
            stream,
            js,
            cancel_subject: format!("walship.{cluster}.tasks.cancel"),
            dead_prefix,
            stream_name,
        })
    }

    fn subject(&self, task_id: &str) -> String {
        format!("{}.{}", self.dead_prefix, token(task_id))
    }
}

fn unavailable(e: impl std::fmt::Display) -> BusError {
    BusError::Unavailable(e.to_string())
}

/// How long one JetStream call may take before the bus counts as down.
const NATS_TIMEOUT: Duration = Duration::from_secs(5);

#[async_trait::async_trait]
impl TaskBus for NatsBus {
    async fn publish_cancel(&self, notice: &CancelNotice) -> Result<(), BusError> {
        let payload = serde_json::to_vec(notice).map_err(|e| BusError::Corrupt(e.to_string()))?;
        self.client.publish(self.cancel_subject.clone(), payload.into()).await.map_err(unavailable)?;
        self.client.flush().await.map_err(unavailable)
    }

    async fn cancels(&self) -> Result<BoxStream<'static, CancelNotice>, BusError> {
        let subscriber = self.client.subscribe(self.cancel_subject.clone()).await.map_err(unavailable)?;
        // Make sure the server has the subscription before answering: a
        // cancel published right after must reach it.
        self.client.flush().await.map_err(unavailable)?;
        Ok(subscriber
            .filter_map(|message| async move {
                match serde_json::from_slice::<CancelNotice>(&message.payload) {
                    Ok(notice) => Some(notice),
                    Err(e) => {
                        tracing::warn!(subject = %message.subject, error = %e, "an unreadable task cancel on NATS: ignored");
                        None
                    }
                }
            })
            .boxed())
    }

    async fn put_dead_letter(&self, letter: &DeadLetter) -> Result<(), BusError> {
        let payload = serde_json::to_vec(letter).map_err(|e| BusError::Corrupt(e.to_string()))?;
        let ack = self.js.publish(self.subject(&letter.task_id), payload.into()).await.map_err(unavailable)?;
        tokio::time::timeout(NATS_TIMEOUT, ack).await.map_err(unavailable)?.map_err(unavailable)?;
        Ok(())
    }

    async fn dead_letters(&self) -> Result<Vec<DeadLetter>, BusError> {
        let mut info = self.stream.info_with_subjects(format!("{}.>", self.dead_prefix)).await.map_err(unavailable)?;
        let mut subjects = Vec::new();
        while let Some(entry) = info.next().await {
            subjects.push(entry.map_err(unavailable)?.0);
        }
        let mut letters = Vec::with_capacity(subjects.len());
        for subject in subjects {
            // Taken (re-driven) since the listing: skip it.
            let Ok(message) = self.stream.get_last_raw_message_by_subject(&subject).await else { continue };
            letters.push(
                serde_json::from_slice(&message.payload)
                    .map_err(|e| BusError::Corrupt(format!("{} {subject}: {e}", self.stream_name)))?,
            );
        }
        Ok(sort(letters))
    }

    async fn take_dead_letter(&self, task_id: &str) -> Result<Option<DeadLetter>, BusError> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        let message = match self.stream.get_last_raw_message_by_subject(&self.subject(task_id)).await {
            Ok(message) => message,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(None),
            Err(e) => return Err(unavailable(e)),
        };
        let letter: DeadLetter = serde_json::from_slice(&message.payload)
            .map_err(|e| BusError::Corrupt(format!("{} {task_id}: {e}", self.stream_name)))?;
        // Whoever deletes it re-drives it; a coordinator racing us loses.
        match self.stream.delete_message(message.sequence).await {
            Ok(true) => Ok(Some(letter)),
            Ok(false) | Err(_) => Ok(None),
        }
    }

    fn describe(&self) -> String {
        format!("NATS (cancels on {}, dead letters in stream {})", self.cancel_subject, self.stream_name)
    }

    fn shared(&self) -> bool {
        true
    }
}

/// The conformance suite every [`TaskBus`] passes.
pub mod conformance {
    use super::*;

    pub fn letter(task_id: &str, failed_unix_ms: u64) -> DeadLetter {
        DeadLetter {
            task_id: task_id.to_string(),
            query_id: "q-1".into(),
            kind: "noop".into(),
            target: Some("node-1".into()),
            shard: Some(3),
            blob_b64: base64::engine::general_purpose::STANDARD.encode(b"{\"x\":1}"),
            deadline_unix_nano: 42,
            attempts: 3,
            error: "worker node-1 disconnected; gave up after 3 attempts".into(),
            last_worker: Some("node-1".into()),
            failed_unix_ms,
        }
    }

    /// Runs every check on a fresh (empty) bus.
    pub async fn run(bus: &dyn TaskBus) {
        // Cancels reach a subscriber, in order.
        let mut cancels = bus.cancels().await.expect("subscribe");
        for n in 0..3 {
            let notice = CancelNotice { task_id: format!("t-{n}"), reason: "test".into(), origin: "c1".into() };
            bus.publish_cancel(&notice).await.expect("publish");
        }
        for n in 0..3 {
            let got = tokio::time::timeout(Duration::from_secs(5), cancels.next()).await.expect("a cancel in time");
            assert_eq!(got.expect("stream open").task_id, format!("t-{n}"));
        }

        // Dead letters: kept, replaced by task id, listed oldest first.
        assert_eq!(bus.dead_letters().await.unwrap(), vec![]);
        bus.put_dead_letter(&letter("t-b", 20)).await.unwrap();
        bus.put_dead_letter(&letter("t-a", 10)).await.unwrap();
        let mut again = letter("t-b", 30);
        again.error = "again".into();
        bus.put_dead_letter(&again).await.unwrap();
        let listed = bus.dead_letters().await.unwrap();
        assert_eq!(listed.iter().map(|l| l.task_id.as_str()).collect::<Vec<_>>(), ["t-a", "t-b"]);
        assert_eq!(listed[1], again, "a second letter for one task replaces the first");

        // Taken once: the second taker gets nothing.
        let taken = bus.take_dead_letter("t-a").await.unwrap().expect("there");
        assert_eq!(taken, letter("t-a", 10));
        assert_eq!(taken.spec().unwrap().blob, b"{\"x\":1}");
        assert_eq!(taken.spec().unwrap().deadline_unix_nano, 0, "a re-drive drops the deadline");
        assert_eq!(bus.take_dead_letter("t-a").await.unwrap(), None);
        assert_eq!(bus.take_dead_letter("never").await.unwrap(), None);
        assert_eq!(bus.dead_letters().await.unwrap(), vec![again]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_local_bus_passes_the_conformance_suite() {
        conformance::run(&LocalBus::in_memory()).await;
        let dir = tempfile::tempdir().unwrap();
        conformance::run(&LocalBus::open(dir.path()).unwrap()).await;
    }

    #[tokio::test]
    async fn local_dead_letters_survive_a_restart_and_a_torn_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bus = LocalBus::open(dir.path()).unwrap();
        bus.put_dead_letter(&conformance::letter("t-1", 1)).await.unwrap();
        bus.put_dead_letter(&conformance::letter("t-2", 2)).await.unwrap();
        bus.take_dead_letter("t-1").await.unwrap();
        drop(bus);
        let reopened = LocalBus::open(dir.path()).unwrap();
        assert_eq!(reopened.dead_letters().await.unwrap(), vec![conformance::letter("t-2", 2)]);
        std::fs::write(dir.path().join("dead-letters.json"), b"[{\"task_id\": ").unwrap();
        let err = LocalBus::open(dir.path()).err().expect("a torn file is refused");
        assert!(err.to_string().contains("dead-letters.json"), "{err}");
    }

    #[test]
    fn a_bad_blob_is_named() {
        let mut letter = conformance::letter("t-1", 1);
        letter.blob_b64 = "***".into();
        assert!(letter.spec().unwrap_err().to_string().contains("t-1"));
    }

    #[test]
    fn ids_become_subject_tokens() {
        assert_eq!(token("prod.eu west/1"), "prod_eu_west_1");
        assert_eq!(token("t-0a1b_2"), "t-0a1b_2");
    }
}
