//! The corruption drill (`POST /v1/drills/corruption`): under a light
//! QUORUM load, one replica (a follower unless asked otherwise) damages its
//! own stored copy of one committed record (`Control.DamageRecord`, honoured
//! only by nodes started with `--allow-crash-drills`: dev and test
//! clusters). The drill measures how fast the node reports the damage and
//! repairs it from an intact replica, how many bytes it refetched, and
//! checks that every acknowledged record reads back identical from the
//! damaged node and the leader.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use walship_proto::log::DamageRecordRequest;

use super::*;

/// `POST /v1/drills/corruption`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CorruptionDrillRequest {
    #[serde(deserialize_with = "crate::control::lenient::int")]
    pub shard: u32,
    /// Replica whose copy is damaged; default: the first follower.
    #[serde(default, deserialize_with = "crate::control::lenient::opt_int")]
    pub node: Option<NodeId>,
    /// Required to damage the leader's copy (the coordinator then fails the
    /// shard over to an intact replica).
    #[serde(default)]
    pub allow_leader: bool,
    /// Concurrent appenders of the light load (1..=256).
    #[serde(default = "default_light_clients", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 256)]
    pub clients: usize,
    /// Load before the damage (at most 60 s).
    #[serde(default = "default_phase_ms", deserialize_with = "crate::control::lenient::int")]
    #[schema(maximum = 60000)]
    pub phase_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct CorruptionDrillResult {
    /// The node whose copy was damaged, and the shard's leader then.
    pub node: NodeId,
    pub leader_before: NodeId,
    pub leader_after: NodeId,
    /// The damaged record, the WAL file and the offset of the flipped bytes.
    pub seqno: u64,
    pub file: String,
    pub offset: u64,
    /// The corrupt range the node reported (a WAL batch shares one
    /// checksum, so it can hold several records).
    pub first_bad_seqno: u64,
    pub last_bad_seqno: u64,
    pub detected: bool,
    /// Damage requested -> the node reports the range.
    pub detection_ms: u64,
    pub repaired: bool,
    /// Detection -> range cleared and the node durable at the leader's commit.
    pub repair_ms: u64,
    /// Bytes the damaged node applied again for records it had dropped with
    /// the corrupt tail (`walship_repair_refetched_bytes_total`, pushed or
    /// streamed).
    pub bytes_refetched: u64,
    /// Records acknowledged by the drill's load.
    pub acked: u64,
    /// Acknowledged records (and the damaged one) missing or different on
    /// the damaged node or the leader.
    pub records_lost: u64,
}

impl Coordinator {
    /// Starts a corruption drill; returns its id. Refuses (changing
    /// nothing) an unknown shard, a node without a replica, and the leader
    /// unless `allow_leader`.
    pub async fn start_corruption_drill(
        self: &Arc<Self>,
        request: CorruptionDrillRequest,
    ) -> Result<String, CoordError> {
        if !(1..=256).contains(&request.clients) || request.phase_ms > 60_000 {
            return Err(CoordError::BadRequest("clients must be 1..=256 and phase_ms at most 60000".into()));
        }
        let state = self.state().ok_or(CoordError::NotActive)?;
        let record = state.shards.get(&request.shard).ok_or(CoordError::UnknownShard(request.shard))?;
        let leader = record.leader.ok_or(CoordError::Busy(request.shard))?;
        let node = match request.node {
            Some(n) if !record.replicas.contains(&n) => {
                return Err(CoordError::NotAReplica { shard: request.shard, node: n });
            }
            Some(n) if n == leader && !request.allow_leader => {
                return Err(CoordError::BadRequest(format!(
                    "node {n} leads shard {}; pass allow_leader to damage the leader's copy",
                    request.shard
                )));
            }
            Some(n) => n,
            None => *record
                .replicas
                .iter()
                .find(|&&r| r != leader)
                .ok_or(CoordError::NotAReplica { shard: request.shard, node: leader })?,
        };
        let headroom = self.retention_headroom(request.shard, &record.replicas, MIN_DRILL_HEADROOM).await?;
        let budget = Budget::new(headroom.min(MAX_LOAD_BYTES));
        let id = self.drills.create("corruption", request.shard)?;
        let (me, drill, load_budget) = (self.clone(), id.clone(), budget.clone());
        self.run_drill(
            id.clone(),
            headroom,
            budget,
            async move { me.corruption_drill(&drill, &request, leader, node, &load_budget).await },
            |r, out| r.corruption = Some(out),
        );
        Ok(id)
    }

    async fn corruption_drill(
        self: &Arc<Self>,
        id: &str,
        request: &CorruptionDrillRequest,
        leader: NodeId,
        node: NodeId,
        budget: &Arc<Budget>,
    ) -> Result<CorruptionDrillResult, String> {
        let shard = request.shard;
        self.drills.progress(id, "load running");
        let load = Load::start(self, shard, request.clients.max(1), 64, id, budget, Keep::Digests);
        tokio::time::sleep(Duration::from_millis(request.phase_ms)).await;
        // The damaged record: the middle acknowledged one, so its payload is
        // known and records on both sides of it exist.
        let seqno = {
            let acks = load.acks.lock().await;
            let keys: Vec<u64> = acks.keys().copied().collect();
            keys.get(keys.len() / 2).copied()
        };
        let Some(seqno) = seqno else {
            load.stop().await;
            return Err("the load generator got no acknowledgement before the damage".into());
        };
        let outcome = self.damage_and_watch(id, shard, node, seqno).await;
        let acks = load.stop().await;
        let acks = acks.lock().await.clone();
        let (response, detected_after, repaired_after, bytes_refetched) = outcome?;
        let record = self.state().and_then(|s| s.shards.get(&shard).cloned()).ok_or("not active")?;
        let leader_after = record.leader.ok_or("no leader after the drill")?;
        self.drills.progress(id, "verifying acknowledged records on the damaged node and the leader");
        let mut checked = vec![leader_after];
        if node != leader_after {
            checked.push(node);
        }
        let (lost, divergent, _) = self.verify(shard, leader_after, &checked, &acks).await?;
        Ok(CorruptionDrillResult {
            node,
            leader_before: leader,
            leader_after,
            seqno,
            file: response.file,
            offset: response.offset,
            first_bad_seqno: response.first_bad_seqno,
            last_bad_seqno: response.last_bad_seqno,
            detected: detected_after.is_some(),
            detection_ms: detected_after.map_or(0, |d| d.as_millis() as u64),
            repaired: repaired_after.is_some(),
            repair_ms: repaired_after.map_or(0, |d| d.as_millis() as u64),
            bytes_refetched,
            acked: acks.len() as u64,
            // A divergent replica differs from the leader somewhere below
            // the commit point, the damaged record included.
            records_lost: lost + divergent,
        })
    }

    /// Damages `node`'s copy of `seqno` and watches it report and repair
    /// the damage: (what it damaged, damage -> reported, reported ->
    /// repaired, catch-up bytes it received meanwhile).
    async fn damage_and_watch(
        &self,
        id: &str,
        shard: u32,
        node: NodeId,
        seqno: u64,
    ) -> Result<(walship_proto::log::DamageRecordResponse, Option<Duration>, Option<Duration>, u64), String> {
        let mut control = self.peers.control(node).ok_or_else(|| format!("no client for node {node}"))?;
        // The record must be durable there before it can be damaged.
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.position_of(node, shard).await.is_none_or(|p| p.durable_seqno < seqno) {
            if Instant::now() > deadline {
                return Err(format!("node {node} did not hold record {seqno} durably within 20 s"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let admin = self.config.node(node).map(|n| n.admin_addr.to_string()).ok_or("node not in the config")?;
        let received_before = refetched_bytes(&admin).await?;
        self.drills.progress(id, &format!("damaging node {node}'s copy of record {seqno}"));
        let damaged_at = Instant::now();
        let response = control
            .damage_record(DamageRecordRequest { shard_id: shard, seqno })
            .await
            .map_err(|s| format!("node {node} refused to damage record {seqno}: {}: {}", s.code(), s.message()))?
            .into_inner();
        // The node verified the record before answering: a range in the
        // answer is the detection.
        let mut detected = (response.first_bad_seqno != 0).then(|| damaged_at.elapsed());
        self.drills.progress(id, &format!("waiting for node {node} to report and repair the damage"));
        let repaired = loop {
            if damaged_at.elapsed() > Duration::from_secs(60) {
                break None;
            }
            let (Some(p), Some(lead)) =
                (self.position_of(node, shard).await, self.current_leader_position(shard).await)
            else {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            };
            if p.corrupt_from_seqno != 0 && detected.is_none() {
                detected = Some(damaged_at.elapsed());
            }
            if detected.is_some() && p.corrupt_from_seqno == 0 && p.durable_seqno >= lead.commit_seqno {
                break Some(damaged_at.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let repaired = repaired.zip(detected).map(|(r, d)| r.saturating_sub(d));
        let received_after = refetched_bytes(&admin).await?;
        Ok((response, detected, repaired, received_after.saturating_sub(received_before)))
    }

    /// The position of the shard's leader as this coordinator records it.
    async fn current_leader_position(&self, shard: u32) -> Option<walship_proto::log::FenceResponse> {
        let leader = self.state()?.shards.get(&shard)?.leader?;
        self.position_of(leader, shard).await
    }
}

/// `walship_repair_refetched_bytes_total` (bytes applied again after a
/// corrupt tail was dropped, by push or stream) from the node's admin
/// `/metrics` at `admin` (host:port).
async fn refetched_bytes(admin: &str) -> Result<u64, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let mut stream = tokio::net::TcpStream::connect(admin).await?;
        let request = format!("GET /metrics HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut body = Vec::new();
        stream.read_to_end(&mut body).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&body).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .map_err(|_| format!("reading {admin}/metrics timed out"))?
        .map_err(|e| format!("reading {admin}/metrics: {e}"))?;
    // A node that never caught up has no such series yet.
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("walship_repair_refetched_bytes_total"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64))
}
