//! Catch-up as a DataPlane task (kind `catchup`, run by the follower's
//! node): started by hand (`POST /v1/tasks` with `"kind": "catchup"`) or by
//! the coordinator itself ([`watch`]) for every live follower that falls
//! `replication.catchup_threshold_bytes` or more behind its leader (the
//! point where the leader stops pushing and the follower pulls). The task
//! carries a PeerExchange fetch token the coordinator minted for it; its
//! row in the task table shows records and bytes applied, with rates; its
//! result (the task's summary, and the job's report at `GET /v1/jobs/{id}`)
//! gives bytes by source (`bytes_peer`, `bytes_archive`, `bytes_stream`,
//! `bytes_push`), seconds and MiB/s. The catch-up itself is the node's:
//! it never waits for the task, and it keeps within the node's
//! `replication.catchup_rate_bytes_per_s`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use walship_dataplane::coordinator::JobEvent;
use walship_dataplane::task::TaskSpec;

use crate::coord::CoordAdmin;
use crate::models::ApiError;

pub const KIND: &str = "catchup";

/// How long a catch-up task's fetch token holds.
const TOKEN_TTL: Duration = Duration::from_secs(3600);

/// Automatic catch-up tasks running at once, at most (more lagging
/// followers wait for a later round).
const AUTO_AT_ONCE: usize = 8;

/// Followers with a catch-up task running: `(shard, node)`.
#[derive(Default)]
pub struct Running(std::sync::Mutex<BTreeSet<(u32, u32)>>);

impl Running {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<(u32, u32)>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Starts a `catchup` task of `node`'s replica of `shard`, until what the
/// leader has committed now. Answers (job id, task id).
pub fn launch(admin: &Arc<CoordAdmin>, shard: u32, node: u32, deadline: i64) -> Result<(String, String), ApiError> {
    let c = &admin.coordinator;
    let refuse = |status, code, message: String| Err(ApiError::new(status, code, message));
    let Some(record) = c.state().and_then(|s| s.shards.get(&shard).cloned()) else {
        return refuse(StatusCode::NOT_FOUND, "not_found", format!("no shard {shard}"));
    };
    if !record.members().contains(&node) {
        return refuse(StatusCode::NOT_FOUND, "not_found", format!("node-{node} holds no replica of shard {shard}"));
    }
    let (leader, commit) = crate::tasks::leader_and_commit(admin, shard);
    let (Some(leader), Some(until)) = (leader, commit) else {
        return refuse(StatusCode::CONFLICT, "no_leader", format!("shard {shard} has no leader now"));
    };
    if leader == node {
        return refuse(
            StatusCode::CONFLICT,
            "is_leader",
            format!("node-{node} leads shard {shard}: nothing to catch up"),
        );
    }
    if !admin.catchups.lock().insert((shard, node)) {
        return refuse(
            StatusCode::CONFLICT,
            "catchup_running",
            format!("node-{node} is catching up shard {shard} already"),
        );
    }
    let dispatcher = admin.dataplane.clone();
    let job = dispatcher.new_id("c");
    let task_id = dispatcher.new_id("t");
    let token = c.mint_fetch_token(&task_id, shard, TOKEN_TTL);
    let blob = serde_json::json!({ "shard": shard, "until_seqno": until, "token": token });
    let spec = TaskSpec {
        task_id: task_id.clone(),
        query_id: job.clone(),
        kind: KIND.to_string(),
        target: Some(format!("node-{node}")),
        shard: Some(shard),
        blob: blob.to_string().into_bytes(),
        deadline_unix_nano: deadline,
    };
    dispatcher.set_report(&job, None);
    let mut events = dispatcher.submit(&job, vec![spec]);
    let (admin, j, t) = (admin.clone(), job.clone(), task_id.clone());
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            match event {
                JobEvent::Batch { batch, .. } if batch.terminal && !batch.payload.is_empty() => {
                    if let Ok(report) = serde_json::from_slice::<serde_json::Value>(&batch.payload) {
                        admin.dataplane.set_summary(&t, report.clone());
                        admin.dataplane.set_report(&j, Some(report));
                    }
                }
                JobEvent::Finished { state, error, .. } => {
                    tracing::info!(job = %j, shard, node, ?state, ?error, "catch-up task ended");
                    if admin.dataplane.report(&j).flatten().is_none() {
                        let failed =
                            serde_json::json!({ "state": format!("{state:?}").to_lowercase(), "error": error });
                        admin.dataplane.set_report(&j, Some(failed));
                    }
                    break;
                }
                JobEvent::Batch { .. } => {}
            }
        }
        admin.catchups.lock().remove(&(shard, node));
        admin.dataplane.close_job(&j);
    });
    Ok((job, task_id))
}

/// Once a second, while this coordinator is active: a catch-up task for
/// every live follower at least `catchup_threshold_bytes` behind its
/// leader (the leader's live count) that has none running.
pub async fn watch(admin: Arc<CoordAdmin>) {
    let threshold = admin.coordinator.config.replication.catchup_threshold_bytes;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = admin.coordinator.shutdown.cancelled() => return,
        }
        if !admin.coordinator.is_active() {
            continue;
        }
        // A follower's lag in bytes is its leader's own figure: a shard
        // whose leader reports none past the threshold has no follower to
        // catch up. The nodes' reports are read in place, all under one
        // lock, and a whole view is built only for a shard whose recorded
        // leader reports one (10,000 views a second were a fifth of an idle
        // coordinator, and a copy of every shard's record a tenth).
        let lagging: Vec<(u32, u32)> = {
            let reports = admin.coordinator.reports();
            let c = &admin.coordinator.config;
            c.nodes
                .iter()
                .flat_map(|n| {
                    reports
                        .of_node(n.id)
                        .filter(|hb| {
                            hb.is_leader && hb.replication_lag_bytes.iter().any(|(&f, &b)| f != n.id && b >= threshold)
                        })
                        .map(|hb| (hb.shard_id, n.id))
                })
                .collect()
        };
        if lagging.is_empty() {
            continue;
        }
        let nodes = crate::coord::NodesNow::read(&admin.coordinator);
        for (shard, leader) in lagging {
            let Ok(record) = admin.coordinator.shard_record(shard) else { continue };
            if record.leader != Some(leader) {
                continue;
            }
            let view = crate::coord::shard_view(&admin, &nodes, shard, &record, None);
            for r in &view.replicas {
                let behind = r.alive && !r.lag_stale && r.lag_bytes.is_some_and(|b| b >= threshold);
                let room = admin.catchups.lock().len() < AUTO_AT_ONCE;
                if behind
                    && room
                    && Some(r.node_id) != view.leader
                    && !admin.catchups.lock().contains(&(shard, r.node_id))
                {
                    match launch(&admin, shard, r.node_id, 0) {
                        Ok((job, _)) => {
                            tracing::info!(shard, node = r.node_id, %job, lag_bytes = ?r.lag_bytes, "catch-up task started")
                        }
                        Err(e) => tracing::debug!(shard, node = r.node_id, error = ?e, "no catch-up task"),
                    }
                }
            }
        }
    }
}
