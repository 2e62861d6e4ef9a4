//! The `catchup` DataPlane task kind, run by a node on one of its follower
//! replicas: the coordinator's handle on a catch-up. The replica catches up
//! by itself (its leader's keepalives start it: sealed segments from peers
//! then the object store when it lacks what the leader retains, then the
//! leader's stream, all within the node's `catchup_rate_bytes_per_s`); the
//! task brings the coordinator-minted PeerExchange token its fetches use,
//! reports progress (records and bytes applied) every few seconds, and ends
//! once the replica holds `until_seqno` durably, with bytes by source, time
//! and MiB/s as its result. Blob: `{"shard": N, "until_seqno": S,
//! "token": "..."}` (token optional).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use walship_dataplane::worker::{TaskContext, TaskOutcome, TaskRunner};
use walship_shipping::replica::ReplicationNode;

pub const KIND: &str = "catchup";

/// How often the task looks at the replica.
const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Catchup {
    shard: u32,
    until_seqno: u64,
    #[serde(default)]
    token: Option<String>,
}

/// A finished catch-up (the task's result).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CatchupReport {
    pub shard: u32,
    pub from_seqno: u64,
    pub until_seqno: u64,
    pub durable_seqno: u64,
    pub seconds: f64,
    pub mib_per_s: f64,
    pub bytes_peer: u64,
    pub bytes_archive: u64,
    pub bytes_stream: u64,
    pub bytes_push: u64,
}

pub struct CatchupRunner {
    pub node: Arc<ReplicationNode>,
}

impl TaskRunner for CatchupRunner {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn run(&self, task: Arc<TaskContext>) -> Pin<Box<dyn Future<Output = TaskOutcome> + Send>> {
        let node = self.node.clone();
        Box::pin(async move {
            let c: Catchup = serde_json::from_slice(&task.blob).map_err(|e| format!("a catchup task's blob: {e}"))?;
            let replica =
                node.replica(c.shard).ok_or_else(|| format!("shard {} is not hosted by this node", c.shard))?;
            if replica.is_leader() {
                return Err(format!("this node leads shard {}: there is nothing to catch up", c.shard));
            }
            if let Some(token) = c.token {
                node.set_fetch_token(c.shard, token);
            }
            let position = async || node.position(c.shard).await.map_err(|e| e.to_string());
            let start = position().await?;
            let started = Instant::now();
            let applied = |p: &walship_proto::log::FenceResponse| {
                p.applied_peer_bytes + p.applied_archive_bytes + p.applied_stream_bytes + p.applied_push_bytes
            };
            // Progress counts records written (a catch-up makes them durable
            // in large steps) and bytes applied.
            let (mut records_told, mut bytes_told) = (start.last_seqno, applied(&start));
            loop {
                let p = position().await?;
                task.advance(
                    p.last_seqno.saturating_sub(records_told) as i64,
                    applied(&p).saturating_sub(bytes_told) as i64,
                );
                (records_told, bytes_told) = (records_told.max(p.last_seqno), bytes_told.max(applied(&p)));
                if p.durable_seqno >= c.until_seqno {
                    let seconds = started.elapsed().as_secs_f64();
                    let bytes = applied(&p) - applied(&start);
                    let report = CatchupReport {
                        shard: c.shard,
                        from_seqno: start.durable_seqno,
                        until_seqno: c.until_seqno,
                        durable_seqno: p.durable_seqno,
                        seconds,
                        mib_per_s: if seconds > 0.0 { bytes as f64 / seconds / (1 << 20) as f64 } else { 0.0 },
                        bytes_peer: p.applied_peer_bytes - start.applied_peer_bytes,
                        bytes_archive: p.applied_archive_bytes - start.applied_archive_bytes,
                        bytes_stream: p.applied_stream_bytes - start.applied_stream_bytes,
                        bytes_push: p.applied_push_bytes - start.applied_push_bytes,
                    };
                    return Ok((1, serde_json::to_vec(&report).expect("plain data")));
                }
                tokio::select! {
                    _ = tokio::time::sleep(POLL) => {}
                    _ = task.cancel.cancelled() => return Err("cancelled".into()),
                }
            }
        })
    }
}
