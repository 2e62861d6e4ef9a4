//! NATS JetStream's counterpart of walship's re-seed drill, for
//! `walship-rebuild --systems nats`: how long an R3 stream takes to bring
//! back a replica that lost its whole store.
//!
//! On the comparison's cluster ([`crate::nats`]: three `nats-server`s on
//! loopback, stream `BENCH` R3 on file storage, `sync_interval: always`),
//! in the drill's order and with the drill's load:
//!
//! 1. One server that does not lead the stream is chosen to lose its store;
//!    the load's connections go to the two others (a client of the lost
//!    server would only measure its reconnects).
//! 2. **Before**: `clients` closed-loop publishers (each waits for its ack)
//!    for one second; their acks per second are the undisturbed rate.
//! 3. **Fill**: `4 × clients` publishers append `volume_bytes /
//!    record_bytes` records, as the drill's fill does.
//! 4. The stream is current on all three servers; its state at the leader
//!    (messages, bytes, last sequence) is what the lost replica must hold
//!    again.
//! 5. The chosen server is killed (SIGKILL to the PID the harness started),
//!    its whole store directory (`<dir>/nN`: the stream, the Raft logs and
//!    the JetStream meta state) deleted, and the server started again with
//!    the same config. The clock starts at that restart.
//! 6. **During**: `clients` publishers run on the two other servers from
//!    the restart until the restarted server's own copy of the stream
//!    (its `/jsz?streams=true`, the server's local state) holds at least
//!    the messages and last sequence of step 4 *and* the leader's
//!    `$JS.API.STREAM.INFO.BENCH` lists it as a current replica. Acks per
//!    second over that window ÷ the rate before is the live figure.
//! 7. With the load stopped, the restarted replica must reach the leader's
//!    final message count and last sequence (within 60 s), or the run
//!    fails.
//!
//! MiB/s counts the stream bytes of step 4 (JetStream's own count: payload
//! plus subject and per-message overhead) over the time of step 6. Every
//! server the harness started, the restarted one included, is stopped by
//! its PID on the way out, on an error too.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use async_nats::jetstream;
use bytes::Bytes;
use rand::RngCore;
use serde::{Deserialize, Serialize};

use crate::nats::{self, NatsCluster, STREAM};
use crate::proc::{self, Server};
use crate::system::{Appender, Cluster};

/// How long the stream may take to be current on all three servers after
/// the fill, and the restarted replica to match the leader at the end.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

/// What to run.
#[derive(Debug, Clone)]
pub struct NatsRebuildSpec {
    pub nats_server: PathBuf,
    /// The cluster's directory (wiped first, removed after a run that
    /// succeeds).
    pub dir: PathBuf,
    pub volume_bytes: u64,
    pub record_bytes: usize,
    pub clients: usize,
}

/// What one run measured (`nats` in `rebuild.json`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NatsCatchup {
    /// The server whose store was deleted, and the stream leader then.
    pub server: String,
    pub leader: String,
    /// The stream at the leader when the server was killed: what the
    /// restarted replica had to get back.
    pub messages: u64,
    pub last_seq: u64,
    pub bytes: u64,
    /// Bytes the deleted store directory took on disk.
    pub store_bytes_deleted: u64,
    /// Restart → the server accepts client connections.
    pub startup_seconds: f64,
    /// Restart → its local copy holds `messages` and `last_seq`.
    pub local_seconds: f64,
    /// Restart → the leader first lists it as a current replica, lag 0 or
    /// not reported, with its local copy caught up (the end of the rebuild).
    pub seconds: f64,
    /// `bytes` MiB ÷ `seconds`.
    pub mib_per_s: f64,
    /// The replica's lag (Raft operations) in the leader's info at the end
    /// (the server leaves the field out when it is 0).
    pub lag_at_end: u64,
    /// Acked publishes per second before the fill, and from the restart to
    /// the end of the rebuild.
    pub append_rate_before: f64,
    pub append_rate_during: f64,
    /// Publishes acknowledged by all three loads.
    pub acked: u64,
    /// With the load stopped: the restarted replica's message count and
    /// last sequence, which must equal the leader's.
    pub final_messages: u64,
    pub final_leader_messages: u64,
}

/// Starts the cluster under `spec.dir`, runs the steps of the module
/// documentation, stops every server and returns the figures.
pub async fn rebuild_replica(spec: &NatsRebuildSpec) -> Result<NatsCatchup> {
    let mut cluster = NatsCluster::start(&spec.dir, &spec.nats_server).await?;
    let logs = cluster.log_hint();
    let outcome = run(&mut cluster, spec).await;
    let stopped = Box::new(cluster).stop().await;
    let catchup = outcome.with_context(|| logs.clone())?;
    stopped?;
    let _ = std::fs::remove_dir_all(&spec.dir);
    Ok(catchup)
}

async fn run(cluster: &mut NatsCluster, spec: &NatsRebuildSpec) -> Result<NatsCatchup> {
    let clients = spec.clients.max(1);
    let admin = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(5))
        .build(nats::connect(&cluster.nodes[0], "walship-rebuild-admin").await?);
    let info = nats::wait_stream_current(&admin, SETTLE_TIMEOUT).await?;
    let victim = non_leader(cluster, &info)?;
    let survivors: Vec<usize> = (0..cluster.nodes.len()).filter(|&i| i != victim).collect();

    eprintln!("  nats: measuring publish throughput before the fill");
    let before = Load::start(cluster.appenders_on(&survivors, clients).await?, spec.record_bytes, None);
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rate_before = before.acked() as f64 / t.elapsed().as_secs_f64();
    let mut acked = before.stop().await?;

    let records = (spec.volume_bytes / spec.record_bytes as u64).max(1);
    eprintln!("  nats: appending {records} records of {} B", spec.record_bytes);
    let fill = Load::start(cluster.appenders_on(&survivors, clients * 4).await?, spec.record_bytes, Some(records));
    acked += fill.finish().await?;

    // Every replica holds everything; the leader's state is the target.
    let info = nats::wait_stream_current(&admin, SETTLE_TIMEOUT).await?;
    let mut victim = victim;
    if info.cluster.as_ref().and_then(|c| c.leader.as_deref()) == Some(cluster.nodes[victim].name.as_str()) {
        // Leadership moved onto the chosen server during the fill.
        victim = non_leader(cluster, &info)?;
    }
    let survivors: Vec<usize> = (0..cluster.nodes.len()).filter(|&i| i != victim).collect();
    let admin = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(5))
        .build(nats::connect(&cluster.nodes[survivors[0]], "walship-rebuild-admin").await?);
    let info = admin.get_stream(STREAM).await.context("stream info before the kill")?.cached_info().clone();
    let leader = info.cluster.as_ref().and_then(|c| c.leader.clone()).context("the stream has no leader")?;
    let target = (info.state.messages, info.state.last_sequence, info.state.bytes);
    let node = cluster.nodes[victim].clone();
    let store_bytes_deleted = disk_usage(&node.store_dir);
    let during_appenders = cluster.appenders_on(&survivors, clients).await?;

    eprintln!(
        "  nats: killing {} (pid {}), deleting its store ({:.1} MiB), restarting it",
        node.name,
        cluster.servers[victim].pid(),
        store_bytes_deleted as f64 / (1 << 20) as f64
    );
    let server = &mut cluster.servers[victim];
    tokio::task::block_in_place(|| server.kill()).with_context(|| format!("killing {}", node.name))?;
    std::fs::remove_dir_all(&node.store_dir).with_context(|| format!("deleting {}", node.store_dir.display()))?;
    let mut command = Command::new(&spec.nats_server);
    command.arg("-c").arg(&node.conf);
    cluster.servers[victim] = Server::spawn(&node.name, command, &node.log, libc::SIGINT)?;
    let restarted = Instant::now();
    let during = Load::start(during_appenders, spec.record_bytes, None);
    let server = &mut cluster.servers[victim];
    tokio::task::block_in_place(|| proc::wait_for_port(node.client, Duration::from_secs(10), server))
        .with_context(|| format!("restarting {} (see {})", node.name, node.log.display()))?;
    let startup_seconds = restarted.elapsed().as_secs_f64();

    let timeout = Duration::from_secs(600 + (spec.volume_bytes >> 20));
    let mut local_seconds = None;
    let lag_at_end = loop {
        let local = local_state(node.monitor).await.ok().flatten();
        if local_seconds.is_none() && local.is_some_and(|l| l.messages >= target.0 && l.last_seq >= target.1) {
            local_seconds = Some(restarted.elapsed().as_secs_f64());
        }
        if local_seconds.is_some()
            && let Some(replica) = replica_info(&admin, &node.name).await
            && replica.current
            && !replica.offline
        {
            break replica.lag.unwrap_or(0);
        }
        cluster.servers[victim].check_running()?;
        if restarted.elapsed() > timeout {
            during.stop().await?;
            bail!(
                "{}'s replica of {STREAM} did not catch up within {timeout:?}: local state {local:?}, target {target:?}",
                node.name
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let seconds = restarted.elapsed().as_secs_f64();
    let rate_during = during.acked() as f64 / seconds;
    acked += during.stop().await?;

    // With the load stopped the replica must match the leader exactly.
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    let (final_messages, final_leader_messages) = loop {
        let leader_state =
            admin.get_stream(STREAM).await.context("stream info after the rebuild")?.cached_info().state.clone();
        let local = local_state(node.monitor).await?.unwrap_or_default();
        if local.messages == leader_state.messages && local.last_seq == leader_state.last_sequence {
            break (local.messages, leader_state.messages);
        }
        if Instant::now() > deadline {
            bail!(
                "{}'s replica holds {} messages through seq {} {SETTLE_TIMEOUT:?} after the load stopped; the \
                 leader {} through {}",
                node.name,
                local.messages,
                local.last_seq,
                leader_state.messages,
                leader_state.last_sequence
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    Ok(NatsCatchup {
        server: node.name.clone(),
        leader,
        messages: target.0,
        last_seq: target.1,
        bytes: target.2,
        store_bytes_deleted,
        startup_seconds,
        local_seconds: local_seconds.unwrap_or(seconds),
        seconds,
        mib_per_s: target.2 as f64 / (1 << 20) as f64 / seconds,
        lag_at_end,
        append_rate_before: rate_before,
        append_rate_during: rate_during,
        acked,
        final_messages,
        final_leader_messages,
    })
}

/// The index of the first server that does not lead the stream.
fn non_leader(cluster: &NatsCluster, info: &jetstream::stream::Info) -> Result<usize> {
    let leader = info.cluster.as_ref().and_then(|c| c.leader.as_deref()).context("the stream has no leader")?;
    cluster.nodes.iter().position(|n| n.name != leader).context("no server but the leader")
}

/// The leader's view of `server`'s replica (`cluster.replicas` in
/// `$JS.API.STREAM.INFO`); `None` while it is not listed or the request fails.
async fn replica_info(js: &jetstream::Context, server: &str) -> Option<jetstream::stream::PeerInfo> {
    let stream = js.get_stream(STREAM).await.ok()?;
    let cluster = stream.cached_info().cluster.as_ref()?;
    cluster.replicas.iter().find(|r| r.name == server).cloned()
}

/// A server's own copy of the stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct LocalState {
    messages: u64,
    last_seq: u64,
}

/// The stream's state as the server at `monitor` holds it
/// (`/jsz?accounts=true&streams=true`); `None` while it has no copy.
async fn local_state(monitor: SocketAddr) -> Result<Option<LocalState>> {
    let (status, body) = crate::walship::http_request(monitor, "GET", "/jsz?accounts=true&streams=true", None, None)
        .await
        .context("GET /jsz")?;
    if status != 200 {
        bail!("GET /jsz on {monitor}: {status} {body}");
    }
    let jsz: serde_json::Value = serde_json::from_str(&body).with_context(|| format!("/jsz answered {body}"))?;
    Ok(parse_local_state(&jsz))
}

fn parse_local_state(jsz: &serde_json::Value) -> Option<LocalState> {
    let accounts = jsz["account_details"].as_array()?;
    let stream =
        accounts.iter().filter_map(|a| a["stream_detail"].as_array()).flatten().find(|s| s["name"] == STREAM)?;
    Some(LocalState {
        messages: stream["state"]["messages"].as_u64()?,
        last_seq: stream["state"]["last_seq"].as_u64()?,
    })
}

/// Bytes the files under `dir` take on disk.
fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_usage(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// Closed-loop publishers: each appends its own random payload back to
/// back and waits for the ack; at most `limit` appends in all, if given.
struct Load {
    acked: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Result<()>>>,
}

impl Load {
    fn start(appenders: Vec<Arc<dyn Appender>>, record_bytes: usize, limit: Option<u64>) -> Load {
        let acked = Arc::new(AtomicU64::new(0));
        let issued = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = appenders
            .into_iter()
            .map(|appender| {
                let mut payload = vec![0u8; record_bytes];
                rand::thread_rng().fill_bytes(&mut payload);
                let payload = Bytes::from(payload);
                let (acked, issued, stop) = (acked.clone(), issued.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        if limit.is_some_and(|limit| issued.fetch_add(1, Ordering::Relaxed) >= limit) {
                            break;
                        }
                        appender.append(payload.clone()).await?;
                        acked.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        Load { acked, stop, tasks }
    }

    fn acked(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }

    /// Waits for every publisher to end by itself (a load with a limit);
    /// returns the acks.
    async fn finish(self) -> Result<u64> {
        for task in self.tasks {
            task.await.context("publisher panicked")??;
        }
        Ok(self.acked.load(Ordering::Relaxed))
    }

    /// Stops the publishers after their current append; returns the acks.
    async fn stop(self) -> Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.finish().await
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_the_servers_own_copy_of_the_stream_from_jsz() {
        let jsz = json!({"account_details": [
            {"name": "$SYS", "stream_detail": []},
            {"name": "$G", "stream_detail": [
                {"name": "OTHER", "state": {"messages": 1, "last_seq": 1}},
                {"name": "BENCH", "state": {"messages": 70, "bytes": 300, "first_seq": 1, "last_seq": 70}},
            ]},
        ]});
        assert_eq!(parse_local_state(&jsz), Some(LocalState { messages: 70, last_seq: 70 }));
        assert_eq!(parse_local_state(&json!({"account_details": [{"name": "$G"}]})), None);
        assert_eq!(parse_local_state(&json!({"streams": 0})), None);
    }

    #[tokio::test]
    async fn a_limited_load_appends_exactly_its_limit() {
        #[derive(Default)]
        struct Count(AtomicU64);
        #[async_trait::async_trait]
        impl Appender for Count {
            async fn append(&self, payload: Bytes) -> Result<()> {
                assert_eq!(payload.len(), 16);
                self.0.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
                Ok(())
            }
        }
        let count = Arc::new(Count::default());
        let appenders: Vec<Arc<dyn Appender>> = (0..5).map(|_| count.clone() as Arc<dyn Appender>).collect();
        assert_eq!(Load::start(appenders, 16, Some(103)).finish().await.unwrap(), 103);
        assert_eq!(count.0.load(Ordering::Relaxed), 103);
    }
}
