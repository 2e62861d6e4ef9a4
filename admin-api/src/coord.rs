//! The coordinator's admin HTTP API: the cluster (with a per-node panel),
//! its shards (leader, epoch, replicas with positions and their age, lag
//! live or stale), each shard's lag history, failover (with preview and
//! forced modes) and health. Mutating endpoints need the bearer token:
//! 401 without one, 403 with a wrong one; every mutation is logged with the
//! caller's address and what was asked. Serve with
//! `into_make_service_with_connect_info::<SocketAddr>()`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus::{Encoder, Registry, TextEncoder};
use walship_shipping::control::{CoordError, Coordinator};

use crate::body::PathId;
use crate::history::{LagHistory, MAX_SAMPLES, SAMPLE_INTERVAL};
use crate::models::{
    ApiError, ClusterView, CoordinatorView, LagHistoryView, LagSample, LagSeries, NodeView, ReplicaView, ShardView,
};

/// What the coordinator's admin API reads from.
pub struct CoordAdmin {
    pub coordinator: Arc<Coordinator>,
    pub registry: Registry,
    pub token: String,
    /// The DataPlane: connected workers and their tasks.
    pub dataplane: Arc<walship_dataplane::coordinator::Dispatcher>,
    /// Where export jobs write their Arrow files.
    pub exports_dir: std::path::PathBuf,
    pub started: Instant,
    /// Recent lag samples (`/v1/shards/{id}/lag-history`), filled once a
    /// second by a task [`coord_router`] starts.
    pub lag_history: LagHistory,
    /// Scheduled verifies (`walship coord --verify-every`).
    pub verify_schedule: crate::jobs::VerifyScheduleState,
    /// Followers with a catch-up task running.
    pub catchups: crate::catchup::Running,
}

/// The coordinator's admin router; also starts the lag sampler (ends with
/// the coordinator's shutdown token).
pub fn coord_router(admin: Arc<CoordAdmin>) -> Router {
    tokio::spawn(sample_lag(admin.clone()));
    tokio::spawn(crate::catchup::watch(admin.clone()));
    Router::new()
        .route("/", get(dashboard))
        .route("/healthz", get(healthz))
        .route("/openapi.json", get(openapi))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/cluster", get(cluster))
        .route("/v1/shards", get(shards))
        .route("/v1/shards/{id}", get(shard))
        .route("/v1/shards/{id}/failover", post(crate::leadership::failover))
        .route("/v1/rebalance", post(crate::leadership::rebalance))
        .route("/v1/shards/{id}/replicas", post(crate::replicas::start))
        .route("/v1/replica-changes", get(crate::replicas::list))
        .route("/v1/replica-changes/{id}", get(crate::replicas::show))
        .route("/v1/shards/{id}/lag-history", get(lag_history))
        .route("/v1/drills", get(crate::drills::drills))
        .route("/v1/drills/{id}", get(crate::drills::drill))
        .route("/v1/drills/failover", post(crate::drills::failover_drill))
        .route("/v1/drills/catchup", post(crate::drills::catchup_drill))
        .route("/v1/drills/corruption", post(crate::drills::corruption_drill))
        .route("/v1/drills/partition", post(crate::drills::partition_drill))
        .route("/v1/drills/reseed", post(crate::drills::reseed_drill))
        .route("/v1/tasks", get(crate::tasks::list).post(crate::tasks::start))
        .route("/v1/tasks/{id}", get(crate::tasks::show))
        .route("/v1/tasks/{id}/cancel", post(crate::tasks::cancel))
        .route("/v1/jobs/{id}", get(crate::tasks::job))
        .route("/v1/jobs/{id}/export", get(crate::tasks::export_file))
        .route("/v1/dead-letters", get(crate::tasks::dead_letters))
        .route("/v1/dead-letters/{id}/redrive", post(crate::tasks::redrive))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint") })
        .method_not_allowed_fallback(crate::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(crate::MAX_BODY_BYTES))
        .with_state(admin)
}

/// Checks the bearer token of a mutating request.
pub fn authorize(headers: &HeaderMap, token: &str) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this endpoint needs Authorization: Bearer <token>",
        ));
    };
    let given = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().split_once(' '))
        .and_then(|(scheme, token)| scheme.eq_ignore_ascii_case("bearer").then_some(token.trim()));
    match given {
        Some(given) if constant_time_eq(given.as_bytes(), token.as_bytes()) => Ok(()),
        _ => Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", "wrong token")),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, description = "the KV is reachable", body = String), (status = 503, description = "the KV is unreachable", body = crate::models::ErrorBody)))]
async fn readyz(State(admin): State<Arc<CoordAdmin>>) -> Response {
    match admin.coordinator.read_state().await {
        Ok(_) => (StatusCode::OK, "ready\n").into_response(),
        Err(e) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "kv_unavailable", e.to_string()).into_response(),
    }
}

#[utoipa::path(get, path = "/metrics", tag = "health",
    responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain")))]
async fn metrics(State(admin): State<Arc<CoordAdmin>>) -> Response {
    let mut body = Vec::new();
    match TextEncoder::new().encode(&admin.registry.gather(), &mut body) {
        Ok(()) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], body).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "metrics", e.to_string()).into_response(),
    }
}

async fn state(admin: &CoordAdmin) -> Result<walship_shipping::control::state::ClusterState, ApiError> {
    if let Some(state) = admin.coordinator.state() {
        return Ok(state);
    }
    match admin.coordinator.read_state().await {
        Ok(Some(state)) => Ok(state),
        Ok(None) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_state",
            "no coordinator has written the cluster state yet",
        )),
        Err(e) => Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "kv_unavailable", e.to_string())),
    }
}

/// A follower's lag as shown (see `ReplicaView`).
#[derive(Default)]
struct ShownLag {
    records: Option<u64>,
    bytes: Option<u64>,
    seconds: Option<f64>,
    stale: bool,
    from_seqno: Option<u64>,
    position_age_ms: Option<u64>,
}

fn now_unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// The recorded leader's newest report of `shard` as its leader, with its
/// age in ms: what a follower's lag is counted from. None just after a
/// failover, while the new leader still reports as a follower.
fn leader_report(
    reports: &walship_shipping::control::coordinator::Reports,
    shard: u32,
    leader: Option<u32>,
) -> Option<(Arc<walship_proto::replication::HeartbeatRequest>, u64)> {
    leader.and_then(|leader| reports.heartbeat_aged(leader, shard)).filter(|(l, _)| l.is_leader)
}

/// The lag of `node` in `shard`, whose leader is `leader` reporting
/// `leader_report` (see [`leader_report`]): the leader's live figures
/// while it hears from `node`; else counted from `node`'s own last
/// reported position (`mine`, asked only then), stale.
fn shown_lag(
    admin: &CoordAdmin,
    shard: u32,
    node: u32,
    leader: Option<u32>,
    leader_report: Option<&(Arc<walship_proto::replication::HeartbeatRequest>, u64)>,
    alive: bool,
    mine: impl FnOnce() -> Option<(Arc<walship_proto::replication::HeartbeatRequest>, u64)>,
) -> ShownLag {
    if leader.is_none_or(|l| l == node) {
        return ShownLag::default();
    }
    // Only the recorded leader's report as leader counts: else the lag is unknown.
    let Some((l, l_age)) = leader_report else { return ShownLag::default() };
    let timeout = admin.coordinator.config.replication.leader_timeout_ms;
    // The leader heard from it in this leadership: its figures, counted from
    // the position the follower last acknowledged.
    if let (Some(&records), Some(&silent)) = (l.replication_lag.get(&node), l.follower_silent_ms.get(&node)) {
        return ShownLag {
            records: Some(records),
            bytes: l.replication_lag_bytes.get(&node).copied(),
            seconds: l.replication_lag_seconds.get(&node).copied(),
            stale: !alive || silent > timeout,
            from_seqno: Some(l.durable_seqno.saturating_sub(records)),
            position_age_ms: Some(silent + l_age),
        };
    }
    // It never answered this leader (down since before the leadership, or
    // just starting): from its own last heartbeat, never the whole log.
    let Some((h, age)) = mine() else { return ShownLag { stale: true, ..ShownLag::default() } };
    let records = l.durable_seqno.saturating_sub(h.durable_seqno);
    let seconds = if records == 0 {
        Some(0.0)
    } else {
        admin.lag_history.written_us(shard, h.durable_seqno + 1).map(|at| now_unix_us().saturating_sub(at) as f64 / 1e6)
    };
    ShownLag {
        records: Some(records),
        bytes: None,
        seconds,
        stale: true,
        from_seqno: Some(h.durable_seqno),
        position_age_ms: Some(age),
    }
}

/// What a shard's view needs of each node, read once per request rather
/// than twice per replica (a page of 10,000 shards took the coordinator's
/// node map 60,000 times): whether it is alive ([`Coordinator::node_alive`])
/// and how long since it was heard.
pub(crate) struct NodesNow(std::collections::BTreeMap<u32, (bool, Option<u64>)>);

impl NodesNow {
    pub(crate) fn read(c: &Coordinator) -> NodesNow {
        NodesNow(c.config.nodes.iter().map(|n| (n.id, (c.node_alive(n.id), c.last_seen_ms(n.id)))).collect())
    }

    fn alive(&self, node: u32) -> bool {
        self.0.get(&node).is_some_and(|(alive, _)| *alive)
    }

    fn last_seen_ms(&self, node: u32) -> Option<u64> {
        self.0.get(&node).and_then(|(_, seen)| *seen)
    }
}

pub(crate) fn shard_view(
    admin: &CoordAdmin,
    nodes: &NodesNow,
    id: u32,
    record: &walship_shipping::control::state::ShardRecord,
    last_failover: Option<walship_shipping::control::state::FailoverRecord>,
) -> ShardView {
    let c = &admin.coordinator;
    let membership = |node: u32| {
        let (new, old) = (record.replicas.contains(&node), record.joint.contains(&node));
        match (new, old) {
            _ if record.learners.contains(&node) => "learner",
            (true, false) if !record.joint.is_empty() => "joining",
            (false, true) => "leaving",
            _ => "voter",
        }
    };
    let led = leader_report(&c.reports(), id, record.leader);
    let replicas = record
        .members()
        .into_iter()
        .map(|node| {
            let aged = c.heartbeat_aged(node, id);
            let hb = aged.as_ref().map(|(h, _)| h);
            let seen = nodes.last_seen_ms(node);
            let alive = nodes.alive(node);
            let lag = shown_lag(admin, id, node, record.leader, led.as_ref(), alive, || aged.clone());
            ReplicaView {
                node_id: node,
                membership: membership(node).into(),
                role: match &hb {
                    // Its last report is stale: do not show an old role as current.
                    Some(_) if !alive => "down".into(),
                    Some(h) if h.is_leader => "leader".into(),
                    Some(h) if h.leader_node_id != 0 => "follower".into(),
                    Some(_) => "unassigned".into(),
                    None => "unknown".into(),
                },
                alive,
                last_heartbeat_ms_ago: seen,
                position_age_ms: aged.as_ref().map(|(_, age)| *age),
                position_unix_us: hb.map(|h| h.last_heartbeat_ns / 1_000).filter(|&us| us > 0),
                epoch: hb.map_or(0, |h| h.epoch),
                last_epoch: hb.map_or(0, |h| h.last_epoch),
                last_seqno: hb.map_or(0, |h| h.last_seqno),
                durable_seqno: hb.map_or(0, |h| h.durable_seqno),
                commit_seqno: hb.map_or(0, |h| h.commit_seqno),
                lag_records: lag.records,
                lag_bytes: lag.bytes,
                lag_seconds: lag.seconds,
                lag_stale: lag.stale,
                lag_from_seqno: lag.from_seqno,
                lag_position_age_ms: lag.position_age_ms,
                disk_full: hb.is_some_and(|h| h.disk_full),
                corrupt_from_seqno: hb.map(|h| h.corrupt_from_seqno).filter(|&s| s > 0),
                producers: hb.map_or(0, |h| h.producers),
                producer_duplicates: hb.map_or(0, |h| h.producer_duplicates),
            }
        })
        .collect();
    // The archive position: the recorded leader's own report as an
    // archiving leader, else none.
    let archive = led.map(|(h, _)| h).filter(|h| h.archiving);
    ShardView {
        shard_id: id,
        leader: record.leader,
        epoch: record.epoch,
        commit_floor: record.commit_floor,
        archived_seqno: archive.as_ref().map(|h| h.archived_seqno),
        archive_lag_records: archive.as_ref().map(|h| h.commit_seqno.saturating_sub(h.archived_seqno)),
        archive_lag_seconds: archive.as_ref().map(|h| h.archive_lag_seconds),
        replicas,
        learners: record.learners.clone(),
        joint_replicas: record.joint.clone(),
        last_failover,
    }
}

/// Once a second (less often when a pass is costly, see
/// [`crate::history::sample_interval`]): samples every follower's lag into
/// the history, and fetches from each shard's leader when it accepted the
/// oldest record each stale follower lacks (its lag in seconds). A pass
/// computes only the lag, not the shard's whole view: one look-up of the
/// leader's report per shard, a follower's own report only when the
/// leader has not heard from it.
async fn sample_lag(admin: Arc<CoordAdmin>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(admin.lag_history.interval()) => {}
            _ = admin.coordinator.shutdown.cancelled() => return,
        }
        let pass = std::time::Instant::now();
        let Ok(state) = state(&admin).await else { continue };
        let (samples, needed) = lag_pass(&admin, &state);
        admin.lag_history.record_pass(samples);
        drop(state);
        admin.lag_history.set_interval(crate::history::sample_interval(pass.elapsed()));
        let mut times = std::collections::BTreeMap::new();
        for ((shard, seqno), leader) in needed {
            let at = match admin.lag_history.written_us(shard, seqno) {
                Some(at) => Some(at),
                None => written_us(&admin.coordinator, leader, shard, seqno).await,
            };
            if let Some(at) = at {
                times.insert((shard, seqno), at);
            }
        }
        admin.lag_history.set_written(times);
    }
}

/// The nodes alive to the coordinator ([`Coordinator::node_alive`]). Taken before
/// [`Coordinator::reports`]: the look-up locks what that guard holds.
fn alive_nodes(c: &Coordinator) -> std::collections::BTreeSet<u32> {
    c.config.nodes.iter().map(|n| n.id).filter(|&n| c.node_alive(n)).collect()
}

/// What a lag pass found: see [`lag_pass`].
type LagPass = (Vec<((u32, u32), LagSample)>, std::collections::BTreeMap<(u32, u64), u32>);

/// Every follower's lag now, keyed `(shard, node)`, and for each stale
/// follower missing records, the first record it lacks (`(shard, seqno)`)
/// with the leader to ask when that record was written.
fn lag_pass(admin: &CoordAdmin, state: &walship_shipping::control::state::ClusterState) -> LagPass {
    let c = &admin.coordinator;
    let now = walship_shipping::control::coordinator::now_ms();
    let alive = alive_nodes(c);
    let mut samples = Vec::new();
    let mut needed = std::collections::BTreeMap::new();
    let reports = c.reports();
    for (&id, record) in &state.shards {
        let led = leader_report(&reports, id, record.leader);
        for node in record.members().into_iter().filter(|&n| Some(n) != record.leader) {
            let alive = alive.contains(&node);
            let mine = || reports.heartbeat_aged(node, id);
            let lag = shown_lag(admin, id, node, record.leader, led.as_ref(), alive, mine);
            if let (true, Some(from), Some(leader)) = (lag.stale, lag.from_seqno, record.leader)
                && lag.records.unwrap_or(0) > 0
            {
                needed.insert((id, from + 1), leader);
            }
            let sample = LagSample {
                at_unix_ms: now,
                lag_records: lag.records,
                lag_bytes: lag.bytes,
                lag_seconds: lag.seconds,
                stale: lag.stale,
            };
            samples.push(((id, node), sample));
        }
    }
    (samples, needed)
}

/// When `leader` accepted record `seqno` of `shard` (its timestamp), read
/// from the leader; none if it cannot say within half a second.
async fn written_us(c: &Coordinator, leader: u32, shard: u32, seqno: u64) -> Option<u64> {
    let mut client = c.peers.log(leader)?;
    let mut request = tonic::Request::new(walship_proto::log::ReadRequest {
        shard_id: shard,
        from_seqno: seqno,
        to_seqno: seqno,
        max_bytes: 1,
        ..Default::default()
    });
    request.set_timeout(std::time::Duration::from_millis(500));
    let records = client.read(request).await.ok()?.into_inner().records;
    records.into_iter().find(|r| r.seqno == seqno).map(|r| r.timestamp_us)
}

/// `?seconds=` on the lag history.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Window {
    seconds: Option<u64>,
}

/// A shard's lag history: one sample a second per follower, the last
/// `seconds` (default and at most 900), oldest first.
#[utoipa::path(get, path = "/v1/shards/{id}/lag-history", tag = "shards",
    params(("id" = u32, Path, description = "shard id"),
        ("seconds" = Option<u32>, Query, minimum = 1, maximum = 900, description = "the last N seconds (default 900)")),
    responses((status = 200, body = LagHistoryView), (status = 400, description = "not a shard id, or a bad query", body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard", body = crate::models::ErrorBody), (status = 503, body = crate::models::ErrorBody)))]
async fn lag_history(
    State(admin): State<Arc<CoordAdmin>>,
    PathId(id): PathId,
    window: Result<Query<Window>, QueryRejection>,
) -> Response {
    let id = match parse_shard(&id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let Query(window) = match window {
        Ok(window) => window,
        Err(rejection) => {
            return ApiError::new(StatusCode::BAD_REQUEST, "bad_query", rejection.body_text()).into_response();
        }
    };
    let max = MAX_SAMPLES as u64 * SAMPLE_INTERVAL.as_secs();
    let seconds = match window.seconds {
        None => max,
        Some(n) if (1..=max).contains(&n) => n,
        Some(n) => {
            return ApiError::new(StatusCode::BAD_REQUEST, "bad_query", format!("seconds {n} is outside 1..={max}"))
                .into_response();
        }
    };
    let state = match state(&admin).await {
        Ok(state) => state,
        Err(e) => return e.into_response(),
    };
    if !state.shards.contains_key(&id) {
        return ApiError::new(StatusCode::NOT_FOUND, "unknown_shard", format!("shard {id} does not exist"))
            .into_response();
    }
    let now = walship_shipping::control::coordinator::now_ms();
    let series = admin
        .lag_history
        .of_shard(id, now.saturating_sub(seconds * 1_000))
        .into_iter()
        .map(|(node, samples)| LagSeries { node_id: node, name: node_name(&admin.coordinator, node), samples })
        .collect();
    Json(LagHistoryView {
        shard_id: id,
        interval_ms: admin.lag_history.interval().as_millis() as u64,
        now_unix_ms: now,
        series,
    })
    .into_response()
}

/// What the cluster view shows of one node's reports, from one pass.
struct NodeReports<'a> {
    /// The report sent last: node-wide figures (uptime, disk) come from it.
    newest: Option<&'a walship_proto::replication::HeartbeatRequest>,
    disk_full: bool,
    corrupt_shards: Vec<u32>,
}

impl<'a> NodeReports<'a> {
    fn of(reports: impl Iterator<Item = &'a walship_proto::replication::HeartbeatRequest>) -> NodeReports<'a> {
        let mut summary = NodeReports { newest: None, disk_full: false, corrupt_shards: Vec::new() };
        for h in reports {
            if summary.newest.is_none_or(|n| h.last_heartbeat_ns > n.last_heartbeat_ns) {
                summary.newest = Some(h);
            }
            summary.disk_full |= h.disk_full;
            if h.corrupt_from_seqno > 0 {
                summary.corrupt_shards.push(h.shard_id);
            }
        }
        summary
    }
}

/// Shards whose recorded leader reports leading them in the recorded
/// epoch, its node alive, or not alive while its followers vouch for it
/// (a leader unheard past its bound still works while its followers hear
/// it, and the coordinator fails nothing over then: a surviving node's
/// heartbeat late on a saturated machine). Counted under one lock with no
/// copy of a report: polled every 20 ms through a 10,000-shard failover
/// (`ops/bench/scale.sh`), the view counting with a copy of every leader's
/// report and two lists of the shards took 40 % of the coordinator's CPU.
fn shards_leading(c: &Coordinator, state: &walship_shipping::control::state::ClusterState) -> usize {
    let alive = alive_nodes(c);
    let mut heard = 0;
    let mut unheard = Vec::new();
    {
        let reports = c.reports();
        for (&id, r) in &state.shards {
            let Some(leader) = r.leader else { continue };
            if !reports.leads(leader, id, r.epoch) {
                continue;
            }
            if alive.contains(&leader) {
                heard += 1;
            } else {
                unheard.push(id);
            }
        }
    }
    heard + unheard.into_iter().filter(|id| c.followers_vouch(*id, &state.shards[id])).count()
}

fn node_name(c: &Coordinator, node: u32) -> String {
    match c.config.node(node) {
        Some(n) => format!("node {node} ({})", n.grpc_addr),
        None => format!("node {node}"),
    }
}

#[utoipa::path(get, path = "/v1/cluster", tag = "cluster",
    responses((status = 200, body = ClusterView), (status = 503, description = "no state yet or KV unreachable", body = crate::models::ErrorBody)))]
async fn cluster(State(admin): State<Arc<CoordAdmin>>) -> Response {
    let state = match state(&admin).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let c = &admin.coordinator;
    let timeout = std::time::Duration::from_millis(c.config.replication.leader_timeout_ms);
    let leads = walship_shipping::control::state::leads(&state.shards);
    let view = ClusterView {
        cluster_id: c.config.cluster_id.clone(),
        coordinator: CoordinatorView {
            id: c.id.clone(),
            active: c.is_active(),
            lease_holder: state.lease.holder.clone(),
            lease_term: state.lease.term,
            kv: c.kv_description(),
            uptime_seconds: admin.started.elapsed().as_secs(),
        },
        nodes: c
            .config
            .nodes
            .iter()
            .map(|n| {
                let seen = c.last_seen_ms(n.id);
                // One pass over the node's reports, read in place under one
                // lock: at 10,000 shards a copy of every report cost the
                // coordinator 12 ms per request, and three passes a node
                // still most of the 7 ms a request cost.
                let reports = c.reports();
                let summary = NodeReports::of(reports.of_node(n.id));
                NodeView {
                    node_id: n.id,
                    grpc_addr: n.grpc_addr.to_string(),
                    admin_addr: n.admin_addr.to_string(),
                    region: n.region,
                    last_heartbeat_ms_ago: seen,
                    alive: reports.alive(n.id, timeout),
                    uptime_seconds: summary
                        .newest
                        .filter(|h| h.uptime_ms > 0)
                        .map(|h| (h.uptime_ms + seen.unwrap_or(0)) / 1_000),
                    wal_disk_bytes: summary.newest.map(|h| h.disk_bytes),
                    disk_free_bytes: summary.newest.map(|h| h.disk_free_bytes),
                    disk_full: summary.disk_full,
                    corrupt_shards: summary.corrupt_shards,
                    leads: leads.get(&n.id).copied().unwrap_or(0) as u64,
                }
            })
            .collect(),
        shards: state.shards.len(),
        shards_without_leader: state.shards.values().filter(|r| r.leader.is_none()).count(),
        shards_leading: shards_leading(c, &state),
        recent_failovers: state.failovers.iter().rev().take(20).cloned().collect(),
        workers: admin.dataplane.workers(),
        dataplane: {
            let c = &admin.dataplane.counters;
            let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            crate::models::DataPlaneView {
                dispatched: n(&c.dispatched),
                redispatched: n(&c.redispatched),
                dropped_results: n(&c.dropped_results),
                duplicate_completions: n(&c.duplicate_completions),
                refused_streams: n(&c.refused_streams),
                orphans_cancelled: n(&c.orphans_cancelled),
                task_bus: admin.dataplane.bus_description(),
                verify_schedule: admin.verify_schedule.view(),
            }
        },
    };
    Json(view).into_response()
}

/// Filters and a page of `GET /v1/shards` (all optional: every shard).
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ShardQuery {
    /// Only shards needing attention: no leader, or a member down, lagging
    /// on a stale position, with a full disk or a known corrupt record.
    unhealthy: Option<bool>,
    /// Only shards this node holds (as voter, learner or leaving member);
    /// a node the cluster does not have is answered 404.
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4294967295.0)]
    node: Option<u32>,
    /// Only shards with a follower at least this many records behind.
    #[param(minimum = 0)]
    min_lag_records: Option<i64>,
    /// At most this many (1..=10000), in shard order, after `offset`; the
    /// number matching before paging is in the `x-total-count` header.
    #[param(minimum = 1, maximum = 10000)]
    limit: Option<i64>,
    #[param(minimum = 0)]
    offset: Option<i64>,
}

fn unhealthy(view: &ShardView) -> bool {
    view.leader.is_none()
        || view.replicas.iter().any(|r| !r.alive || r.lag_stale || r.disk_full || r.corrupt_from_seqno.is_some())
}

#[utoipa::path(get, path = "/v1/shards", tag = "shards", params(ShardQuery),
    responses((status = 200, body = Vec<ShardView>, headers(("x-total-count" = u64, description = "shards matching the filters, before limit and offset"))),
        (status = 400, description = "bad query", body = crate::models::ErrorBody),
        (status = 404, description = "`node` names a node the cluster does not have", body = crate::models::ErrorBody),
        (status = 503, body = crate::models::ErrorBody)))]
async fn shards(State(admin): State<Arc<CoordAdmin>>, query: Result<Query<ShardQuery>, QueryRejection>) -> Response {
    let Query(query) = match query {
        Ok(query) => query,
        Err(rejection) => {
            return ApiError::new(StatusCode::BAD_REQUEST, "bad_query", rejection.body_text()).into_response();
        }
    };
    if query.limit.is_some_and(|l| !(1..=10_000).contains(&l)) {
        return ApiError::new(StatusCode::BAD_REQUEST, "bad_query", "limit is 1..=10000").into_response();
    }
    if query.offset.is_some_and(|o| o < 0) || query.min_lag_records.is_some_and(|m| m < 0) {
        return ApiError::new(StatusCode::BAD_REQUEST, "bad_query", "offset and min_lag_records are at least 0")
            .into_response();
    }
    // A node the cluster does not have is a typo, not an empty filter: 404,
    // as the task API answers for one.
    if let Some(node) = query.node.filter(|&n| admin.coordinator.config.node(n).is_none()) {
        let known: Vec<String> = admin.coordinator.config.nodes.iter().map(|n| n.id.to_string()).collect();
        let why = format!("node {node} is not in the cluster (its nodes: {})", known.join(", "));
        return ApiError::new(StatusCode::NOT_FOUND, "not_found", why).into_response();
    }
    match state(&admin).await {
        Ok(state) => {
            // Each shard's newest failover, found in one pass over the history.
            let last_failover: std::collections::BTreeMap<u32, &walship_shipping::control::state::FailoverRecord> =
                state.failovers.iter().map(|f| (f.shard, f)).collect();
            let records = state.shards.iter().filter(|(_, r)| query.node.is_none_or(|n| r.members().contains(&n)));
            let nodes = NodesNow::read(&admin.coordinator);
            let view = |(&id, r): (&u32, &Arc<walship_shipping::control::state::ShardRecord>)| {
                shard_view(&admin, &nodes, id, r, last_failover.get(&id).map(|&f| f.clone()))
            };
            let offset = query.offset.unwrap_or(0) as usize;
            let limit = query.limit.map_or(usize::MAX, |l| l as usize);
            let (total, page): (usize, Vec<ShardView>) = if query.unhealthy.is_none() && query.min_lag_records.is_none()
            {
                // Nothing to filter by in the views: only the page's are built.
                let total = records.clone().count();
                (total, records.skip(offset).take(limit).map(view).collect())
            } else {
                let views: Vec<ShardView> = records
                    .map(view)
                    .filter(|v| query.unhealthy.is_none_or(|want| unhealthy(v) == want))
                    .filter(|v| {
                        query
                            .min_lag_records
                            .is_none_or(|min| v.replicas.iter().any(|r| r.lag_records.unwrap_or(0) >= min as u64))
                    })
                    .collect();
                (views.len(), views.into_iter().skip(offset).take(limit).collect())
            };
            ([("x-total-count", total.to_string())], Json(page)).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// A shard id: decimal digits only (no sign, no spaces), within u32.
pub(crate) fn parse_shard(id: &str) -> Result<u32, ApiError> {
    let digits = !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit());
    match id.parse() {
        Ok(shard) if digits => Ok(shard),
        _ if digits => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_shard_id",
            format!("shard id {id} is past the largest, {}", u32::MAX),
        )),
        _ => Err(ApiError::new(StatusCode::BAD_REQUEST, "bad_shard_id", format!("shard id {id:?} is not a number"))),
    }
}

#[utoipa::path(get, path = "/v1/shards/{id}", tag = "shards",
    params(("id" = u32, Path, description = "shard id")),
    responses((status = 200, body = ShardView), (status = 400, description = "not a shard id", body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard", body = crate::models::ErrorBody), (status = 503, body = crate::models::ErrorBody)))]
async fn shard(State(admin): State<Arc<CoordAdmin>>, PathId(id): PathId) -> Response {
    let id = match parse_shard(&id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    match state(&admin).await {
        Ok(state) => match state.shards.get(&id) {
            Some(r) => {
                let last_failover = state.failovers.iter().rev().find(|f| f.shard == id).cloned();
                Json(shard_view(&admin, &NodesNow::read(&admin.coordinator), id, r, last_failover)).into_response()
            }
            None => ApiError::new(StatusCode::NOT_FOUND, "unknown_shard", format!("shard {id} does not exist"))
                .into_response(),
        },
        Err(e) => e.into_response(),
    }
}

pub fn coord_error(e: CoordError) -> ApiError {
    let status = match &e {
        CoordError::NotActive | CoordError::NoMajority { .. } | CoordError::Kv(_) | CoordError::Unreachable(_) => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        // The named replica does not exist in this shard.
        CoordError::UnknownShard(_) | CoordError::NotAReplica { .. } => StatusCode::NOT_FOUND,
        CoordError::BadRequest(_) => StatusCode::BAD_REQUEST,
        CoordError::WouldLose { .. }
        | CoordError::Busy(_)
        | CoordError::DrillWouldEvict { .. }
        | CoordError::Conflict { .. } => StatusCode::CONFLICT,
    };
    let code = match &e {
        CoordError::NotActive => "not_active",
        CoordError::UnknownShard(_) => "unknown_shard",
        CoordError::NotAReplica { .. } => "not_a_replica",
        CoordError::NoMajority { .. } => "no_majority",
        CoordError::WouldLose { .. } => "would_lose_acknowledged_records",
        CoordError::Unreachable(_) => "unreachable",
        CoordError::Busy(_) => "failover_in_progress",
        CoordError::Kv(_) => "kv_unavailable",
        CoordError::BadRequest(_) => "bad_request",
        CoordError::DrillWouldEvict { .. } => "drill_would_evict",
        CoordError::Conflict { code, .. } => code,
    };
    ApiError::new(status, code, e.to_string())
}

#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "the process is up", body = String)))]
async fn healthz() -> &'static str {
    "ok\n"
}

#[utoipa::path(get, path = "/openapi.json", tag = "health", responses((status = 200, description = "this document")))]
async fn openapi() -> Response {
    Json(crate::openapi::coordinator()).into_response()
}

/// The dashboard: one self-contained page (no build step) that polls the
/// API every second; mutating buttons ask for the token once per tab.
async fn dashboard() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], include_str!("dashboard.html")).into_response()
}
