//! The coordinator's task endpoints: DataPlane tasks listed, shown,
//! started, cancelled; dead letters listed and re-driven.
//!
//! `GET /v1/tasks?state=&kind=&shard=&node=&limit=&offset=` lists tasks
//! newest first; `GET /v1/tasks/{id}` shows one (state, node, attempts,
//! progress and throughput, result rows and bytes, summary, error);
//! `POST /v1/tasks` starts a job (`{"kind": "noop", ...}`);
//! `POST /v1/tasks/{id}/cancel` stops one; `GET /v1/dead-letters` lists the
//! tasks that failed on every attempt, `POST /v1/dead-letters/{id}/redrive`
//! queues one again. Mutations need the bearer token.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use walship_dataplane::bus::DeadLetter;
use walship_dataplane::coordinator::{Cancelled, RedriveError};
use walship_dataplane::task::{Progress, Task, TaskSpec, TaskState};

use crate::body::{ObjectJson, PathId};
use crate::coord::{CoordAdmin, authorize};
use crate::models::ApiError;

/// A task as the API shows it.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TaskView {
    pub task_id: String,
    /// The job it belongs to.
    pub query_id: String,
    pub kind: String,
    /// queued, running, succeeded, failed, cancelled.
    pub state: String,
    pub shard: Option<u32>,
    /// The worker it must run on, if any.
    pub target: Option<String>,
    /// The worker it runs on now, or last ran on.
    pub node: Option<String>,
    pub attempts: u32,
    pub rows: i64,
    pub bytes: i64,
    pub rows_per_s: f64,
    pub bytes_per_s: f64,
    pub result_rows: u64,
    pub result_bytes: u64,
    pub created_unix_ms: u64,
    pub finished_unix_ms: Option<u64>,
    /// Microseconds from its last dispatch to its finish.
    pub took_us: Option<u64>,
    pub error: Option<String>,
    pub dead_letter: bool,
    #[schema(value_type = Option<Object>)]
    pub summary: Option<serde_json::Value>,
}

impl From<Task> for TaskView {
    fn from(t: Task) -> TaskView {
        let Progress { rows, bytes, rows_per_s, bytes_per_s, .. } = t.progress;
        TaskView {
            task_id: t.spec.task_id,
            query_id: t.spec.query_id,
            kind: t.spec.kind,
            state: t.state.name().to_string(),
            shard: t.spec.shard,
            target: t.spec.target,
            node: t.assigned.map(|(w, _)| w).or(t.last_worker),
            attempts: t.attempts,
            rows,
            bytes,
            rows_per_s,
            bytes_per_s,
            result_rows: t.result_rows,
            result_bytes: t.result_bytes,
            created_unix_ms: t.created_unix_ms,
            finished_unix_ms: t.finished_unix_ms,
            took_us: t.took_us,
            error: t.error,
            dead_letter: t.dead_letter,
            summary: t.summary,
        }
    }
}

/// Filters and paging of `GET /v1/tasks`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TaskQuery {
    /// queued, running, succeeded, failed or cancelled.
    state: Option<TaskState>,
    kind: Option<String>,
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4294967295.0)]
    shard: Option<u32>,
    /// A worker id, e.g. node-2.
    node: Option<String>,
    /// The job (`query_id`) the tasks belong to.
    query_id: Option<String>,
    /// At most this many (default 100, at most 1000).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
    /// Skip this many of the newest first.
    #[param(minimum = 0, maximum = 1000000)]
    offset: Option<u32>,
}

/// A page of tasks, newest first.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TaskPage {
    pub tasks: Vec<TaskView>,
    /// Tasks matching the filters in all.
    pub total: usize,
}

fn bad(what: String) -> Response {
    ApiError::new(StatusCode::BAD_REQUEST, "bad_query", what).into_response()
}

#[utoipa::path(get, path = "/v1/tasks", tag = "tasks", params(TaskQuery),
    responses((status = 200, body = TaskPage), (status = 400, description = "bad query", body = crate::models::ErrorBody)))]
pub async fn list(State(admin): State<Arc<CoordAdmin>>, query: Result<Query<TaskQuery>, QueryRejection>) -> Response {
    let Query(q) = match query {
        Ok(q) => q,
        Err(rejection) => return bad(rejection.body_text()),
    };
    let state = q.state;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return bad(format!("limit {limit} is outside 1..=1000"));
    }
    let offset = q.offset.unwrap_or(0);
    if offset > 1_000_000 {
        return bad(format!("offset {offset} is over 1000000"));
    }
    let matching: Vec<Task> = admin
        .dataplane
        .tasks()
        .into_iter()
        .rev()
        .filter(|t| state.is_none_or(|s| t.state == s))
        .filter(|t| q.kind.as_ref().is_none_or(|k| &t.spec.kind == k))
        .filter(|t| q.query_id.as_ref().is_none_or(|j| &t.spec.query_id == j))
        .filter(|t| q.shard.is_none_or(|s| t.spec.shard == Some(s)))
        .filter(|t| {
            q.node
                .as_ref()
                .is_none_or(|n| t.assigned.as_ref().is_some_and(|(w, _)| w == n) || t.spec.target.as_ref() == Some(n))
        })
        .collect();
    let total = matching.len();
    let tasks = matching.into_iter().skip(offset as usize).take(limit as usize).map(TaskView::from).collect();
    Json(TaskPage { tasks, total }).into_response()
}

#[utoipa::path(get, path = "/v1/tasks/{id}", tag = "tasks", params(("id" = String, Path, description = "task id")),
    responses((status = 200, body = TaskView), (status = 404, description = "unknown task", body = crate::models::ErrorBody)))]
pub async fn show(State(admin): State<Arc<CoordAdmin>>, PathId(id): PathId) -> Response {
    match admin.dataplane.task(&id) {
        Some(task) => Json(TaskView::from(task)).into_response(),
        None => ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no task {id}")).into_response(),
    }
}

/// A job to start, by kind.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum NewTask {
    /// Waits `sleep_ms`, then succeeds (or fails with `fail`): for tests
    /// and the dispatch benchmark.
    Noop {
        /// The worker to run on (`node-N`, 404 when the cluster has no such
        /// node); any worker when absent.
        #[serde(default)]
        #[schema(pattern = "^node-[0-9]+$")]
        node: Option<String>,
        /// Milliseconds to wait (at most an hour).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 0, maximum = 3600000)]
        sleep_ms: Option<u64>,
        /// Whether its counters grow while it waits (default true).
        #[serde(default)]
        advance: Option<bool>,
        /// Fail with this error.
        #[serde(default)]
        fail: Option<String>,
        /// Start this many such tasks at once, as one job (default 1; the
        /// dispatch benchmark uses thousands).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 1, maximum = 10000)]
        count: Option<u32>,
        /// Milliseconds from now after which the task is failed (0 or absent:
        /// no deadline; at most a day).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 0, maximum = 86400000)]
        deadline_ms: Option<u64>,
    },
    /// Writes `shard`'s records `[from, to]`, read on `node` (default: the
    /// leader), into an Arrow IPC file on the coordinator
    /// (`GET /v1/jobs/{query_id}/export`).
    Export {
        #[serde(deserialize_with = "walship_shipping::control::lenient::int")]
        #[schema(value_type = i64, minimum = 0, maximum = 4294967295.0)]
        shard: u32,
        #[serde(default)]
        #[schema(pattern = "^node-[0-9]+$")]
        node: Option<String>,
        /// The first seqno (default 1).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 1)]
        from: Option<u64>,
        /// The last seqno (default: the leader's commit seqno now).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 1)]
        to: Option<u64>,
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 0, maximum = 86400000)]
        deadline_ms: Option<u64>,
    },
    /// Follows `node`'s catch-up of `shard` up to what the leader has
    /// committed now, handing it a fetch token for its peer fetches; the
    /// result gives bytes by source and MiB/s (`GET /v1/jobs/{query_id}`).
    /// The coordinator starts these itself for followers
    /// `catchup_threshold_bytes` or more behind.
    Catchup {
        #[serde(deserialize_with = "walship_shipping::control::lenient::int")]
        #[schema(value_type = i64, minimum = 0, maximum = 4294967295.0)]
        shard: u32,
        /// The follower (`node-N`).
        #[schema(pattern = "^node-[0-9]+$")]
        node: String,
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 0, maximum = 86400000)]
        deadline_ms: Option<u64>,
    },
    /// Compares every replica of `shard` over `[from, to]` and reports the
    /// first seqno where one differs (`GET /v1/jobs/{query_id}`).
    Verify {
        /// The shard (404 when the cluster has no such shard).
        #[serde(deserialize_with = "walship_shipping::control::lenient::int")]
        #[schema(value_type = i64, minimum = 0, maximum = 4294967295.0)]
        shard: u32,
        /// The first seqno (default 1).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 1)]
        from: Option<u64>,
        /// The last seqno (default: the leader's commit seqno now). A range
        /// with `to` below `from` holds nothing (verdict `empty`).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 1)]
        to: Option<u64>,
        /// Records per chunk of the first pass (default 4096).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 1, maximum = 1000000)]
        chunk_records: Option<u64>,
        /// Milliseconds from now after which its tasks are failed (0 or absent:
        /// no deadline; at most a day).
        #[serde(default, deserialize_with = "walship_shipping::control::lenient::opt_int")]
        #[schema(minimum = 0, maximum = 86400000)]
        deadline_ms: Option<u64>,
    },
}

/// Unix nanoseconds `ms` from now (0: none), or a refusal past a day.
fn deadline(ms: Option<u64>) -> Result<i64, Box<Response>> {
    match ms {
        Some(ms) if ms > 86_400_000 => Err(Box::new(bad_request("deadline_ms is at most 86400000 (a day)".into()))),
        Some(ms) if ms > 0 => Ok(walship_dataplane::task::unix_nanos() + (ms as i64) * 1_000_000),
        _ => Ok(0),
    }
}

/// A started job.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TaskStarted {
    pub query_id: String,
    pub task_ids: Vec<String>,
}

#[utoipa::path(post, path = "/v1/tasks", tag = "tasks", request_body = NewTask, security(("bearer" = [])),
    responses((status = 202, body = TaskStarted), (status = 400, body = crate::models::ErrorBody),
        (status = 401, body = crate::models::ErrorBody), (status = 403, body = crate::models::ErrorBody),
        (status = 404, description = "no such node, shard, or replica of it", body = crate::models::ErrorBody),
        (status = 409, description = "catchup: the node leads the shard (is_leader), the shard has no leader (no_leader), or one runs already (catchup_running)", body = crate::models::ErrorBody),
        (status = 415, body = crate::models::ErrorBody), (status = 503, description = "not the active coordinator", body = crate::models::ErrorBody)))]
pub async fn start(
    State(admin): State<Arc<CoordAdmin>>,
    headers: HeaderMap,
    body: Result<ObjectJson<NewTask>, ApiError>,
) -> Response {
    if let Err(e) = authorize(&headers, &admin.token) {
        return e.into_response();
    }
    let ObjectJson(new) = match body {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    if !admin.coordinator.is_active() {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_active", "this coordinator is a standby")
            .into_response();
    }
    let (node, sleep_ms, advance, fail, deadline_ms, count) = match new {
        NewTask::Verify { shard, from, to, chunk_records, deadline_ms } => {
            return start_verify(&admin, shard, from, to, chunk_records, deadline_ms);
        }
        NewTask::Export { shard, node, from, to, deadline_ms } => {
            return start_export(&admin, shard, node, from, to, deadline_ms);
        }
        NewTask::Catchup { shard, node, deadline_ms } => {
            let deadline = match deadline(deadline_ms) {
                Ok(d) => d,
                Err(response) => return *response,
            };
            let Some(id) = node.strip_prefix("node-").and_then(|n| n.parse::<u32>().ok()) else {
                return ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("{node} is not a node of this cluster"),
                )
                .into_response();
            };
            return match crate::catchup::launch(&admin, shard, id, deadline) {
                Ok((query_id, task_id)) => {
                    (StatusCode::ACCEPTED, Json(TaskStarted { query_id, task_ids: vec![task_id] })).into_response()
                }
                Err(e) => e.into_response(),
            };
        }
        NewTask::Noop { node, sleep_ms, advance, fail, deadline_ms, count } => {
            (node, sleep_ms, advance, fail, deadline_ms, count)
        }
    };
    if let Some(node) = &node
        && !admin.coordinator.config.nodes.iter().any(|n| format!("node-{}", n.id) == *node)
    {
        return ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("{node} is not a node of this cluster"))
            .into_response();
    }
    if sleep_ms.is_some_and(|ms| ms > 3_600_000) {
        return bad_request("sleep_ms is at most 3600000 (an hour)".into());
    }
    let deadline = match deadline(deadline_ms) {
        Ok(d) => d,
        Err(response) => return *response,
    };
    let blob = serde_json::json!({
        "sleep_ms": sleep_ms.unwrap_or(0),
        "advance": advance.unwrap_or(true),
        "fail": fail,
    });
    let count = count.unwrap_or(1);
    // At most as many as the coordinator keeps listed once finished, so
    // every task a POST answers with can still be looked up right after.
    if !(1..=10_000).contains(&count) {
        return bad_request(format!("count {count} is outside 1..=10000"));
    }
    let dispatcher = &admin.dataplane;
    let query_id = dispatcher.new_id("q");
    let blob = blob.to_string().into_bytes();
    let specs: Vec<TaskSpec> = (0..count)
        .map(|_| TaskSpec {
            task_id: dispatcher.new_id("t"),
            query_id: query_id.clone(),
            kind: walship_dataplane::kinds::noop::KIND.to_string(),
            target: node.clone(),
            shard: None,
            blob: blob.clone(),
            deadline_unix_nano: deadline,
        })
        .collect();
    let task_ids: Vec<String> = specs.iter().map(|t| t.task_id.clone()).collect();
    let mut events = dispatcher.submit(&query_id, specs);
    // Nothing to collect from a noop: drain its events until all ended.
    let (d, q, mut left) = (dispatcher.clone(), query_id.clone(), task_ids.len());
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            if matches!(event, walship_dataplane::coordinator::JobEvent::Finished { .. }) {
                left -= 1;
                if left == 0 {
                    break;
                }
            }
        }
        d.close_job(&q);
    });
    (StatusCode::ACCEPTED, Json(TaskStarted { query_id, task_ids })).into_response()
}

/// A cancel for a task another coordinator may run, sent on.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CancelBroadcast {
    pub task_id: String,
    pub broadcast: bool,
    pub message: String,
}

#[utoipa::path(post, path = "/v1/tasks/{id}/cancel", tag = "tasks", params(("id" = String, Path, description = "task id")),
    security(("bearer" = [])),
    responses((status = 200, description = "cancelled here (a finished task is shown as it was); the cancel is also broadcast so the task stops on every worker", body = TaskView),
        (status = 202, description = "not a task of this coordinator, but coordinators share a NATS bus: broadcast to them and every worker", body = CancelBroadcast),
        (status = 409, description = "a running drill (not_cancellable)", body = crate::models::ErrorBody), (status = 401, body = crate::models::ErrorBody), (status = 403, body = crate::models::ErrorBody),
        (status = 404, description = "unknown task", body = crate::models::ErrorBody)))]
pub async fn cancel(State(admin): State<Arc<CoordAdmin>>, headers: HeaderMap, PathId(id): PathId) -> Response {
    if let Err(e) = authorize(&headers, &admin.token) {
        return e.into_response();
    }
    match admin.dataplane.cancel(&id, "cancelled by an operator").await {
        Cancelled::Unknown => {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no task {id}")).into_response()
        }
        Cancelled::NotCancellable => ApiError::new(
            StatusCode::CONFLICT,
            "not_cancellable",
            format!("task {id} is a drill the coordinator runs; it runs to its end, which restores the cluster"),
        )
        .into_response(),
        Cancelled::Here(_) => match admin.dataplane.task(&id) {
            Some(task) => Json(TaskView::from(task)).into_response(),
            None => ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no task {id}")).into_response(),
        },
        Cancelled::Broadcast => (
            StatusCode::ACCEPTED,
            Json(CancelBroadcast {
                task_id: id,
                broadcast: true,
                message: "not a task of this coordinator: the cancel was broadcast to the other coordinators and \
                          every worker"
                    .into(),
            }),
        )
            .into_response(),
    }
}

#[utoipa::path(get, path = "/v1/dead-letters", tag = "tasks",
    responses((status = 200, description = "tasks that failed on every attempt, oldest failure first; kept by the task bus (a file in the coordinator's data dir, or a JetStream stream with NATS), so those of earlier coordinators are listed too", body = Vec<DeadLetter>),
        (status = 503, description = "the task bus is unavailable", body = crate::models::ErrorBody)))]
pub async fn dead_letters(State(admin): State<Arc<CoordAdmin>>) -> Response {
    match admin.dataplane.dead_letters().await {
        Ok(letters) => Json(letters).into_response(),
        Err(e) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "task_bus_unavailable", e.to_string()).into_response(),
    }
}

#[utoipa::path(post, path = "/v1/dead-letters/{id}/redrive", tag = "tasks", params(("id" = String, Path, description = "task id")),
    security(("bearer" = [])),
    responses((status = 200, description = "queued again with fresh attempts", body = TaskView), (status = 401, body = crate::models::ErrorBody), (status = 403, body = crate::models::ErrorBody),
        (status = 404, description = "no such task and no dead letter of it", body = crate::models::ErrorBody), (status = 409, description = "not a dead letter", body = crate::models::ErrorBody),
        (status = 503, description = "the task bus is unavailable", body = crate::models::ErrorBody)))]
pub async fn redrive(State(admin): State<Arc<CoordAdmin>>, headers: HeaderMap, PathId(id): PathId) -> Response {
    if let Err(e) = authorize(&headers, &admin.token) {
        return e.into_response();
    }
    match admin.dataplane.redrive(&id).await {
        Ok(task) => {
            tracing::info!(task_id = %id, "admin: dead letter re-driven");
            Json(TaskView::from(task)).into_response()
        }
        Err(e @ RedriveError::NotFound(_)) => {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", e.to_string()).into_response()
        }
        Err(e @ RedriveError::NotDeadLetter(..)) => {
            ApiError::new(StatusCode::CONFLICT, "not_dead_letter", e.to_string()).into_response()
        }
        Err(e @ RedriveError::Bus(_)) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "task_bus_unavailable", e.to_string()).into_response()
        }
    }
}

fn bad_request(what: String) -> Response {
    ApiError::new(StatusCode::BAD_REQUEST, "bad_request", what).into_response()
}

/// Starts a verify job: its tasks are planned by the coordinator (one per
/// replica, then a narrower second pass if needed).
fn start_verify(
    admin: &Arc<CoordAdmin>,
    shard: u32,
    from: Option<u64>,
    to: Option<u64>,
    chunk_records: Option<u64>,
    deadline_ms: Option<u64>,
) -> Response {
    let deadline = match deadline(deadline_ms) {
        Ok(d) => d,
        Err(response) => return *response,
    };
    match crate::jobs::launch_verify(admin, shard, from, to, chunk_records, deadline) {
        Ok((job, _)) => {
            (StatusCode::ACCEPTED, Json(TaskStarted { query_id: job, task_ids: Vec::new() })).into_response()
        }
        Err(crate::jobs::VerifyRefused::NoShard) => {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no shard {shard}")).into_response()
        }
        Err(crate::jobs::VerifyRefused::Bad(why)) => bad_request(why),
    }
}

/// A planned job (verify) and its report.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobView {
    pub job_id: String,
    /// `running` or `done`.
    pub state: String,
    /// The job's report once done (a verify: `VerifyReport`).
    #[schema(value_type = Option<Object>)]
    pub report: Option<serde_json::Value>,
}

#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "tasks", params(("id" = String, Path, description = "job id (POST /v1/tasks's query_id)")),
    responses((status = 200, body = JobView), (status = 404, description = "unknown job", body = crate::models::ErrorBody)))]
pub async fn job(State(admin): State<Arc<CoordAdmin>>, PathId(id): PathId) -> Response {
    match admin.dataplane.report(&id) {
        None => ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id}")).into_response(),
        Some(report) => {
            Json(JobView { job_id: id, state: if report.is_some() { "done" } else { "running" }.into(), report })
                .into_response()
        }
    }
}

/// The leader of `shard` and its commit seqno now, as the coordinator knows.
pub(crate) fn leader_and_commit(admin: &CoordAdmin, shard: u32) -> (Option<u32>, Option<u64>) {
    let c = &admin.coordinator;
    let leader = c.state().and_then(|s| s.shards.get(&shard).and_then(|r| r.leader));
    (leader, leader.and_then(|l| c.heartbeat(l, shard)).map(|h| h.commit_seqno))
}

/// Starts an export job: one task on `node` (default the leader), its
/// batches written into an Arrow IPC file here.
fn start_export(
    admin: &Arc<CoordAdmin>,
    shard: u32,
    node: Option<String>,
    from: Option<u64>,
    to: Option<u64>,
    deadline_ms: Option<u64>,
) -> Response {
    use walship_dataplane::kinds::export;
    let Some(spec) = admin.coordinator.config.shards.iter().find(|s| s.id == shard) else {
        return ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no shard {shard}")).into_response();
    };
    let deadline = match deadline(deadline_ms) {
        Ok(d) => d,
        Err(response) => return *response,
    };
    let (leader, commit) = leader_and_commit(admin, shard);
    let node = match node {
        Some(node) => match node.strip_prefix("node-").and_then(|n| n.parse::<u32>().ok()) {
            Some(n) if spec.replicas.contains(&n) => n,
            _ => {
                return ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("{node} holds no replica of shard {shard}"),
                )
                .into_response();
            }
        },
        None => match leader {
            Some(leader) => leader,
            None => {
                return ApiError::new(StatusCode::CONFLICT, "no_leader", format!("shard {shard} has no leader now"))
                    .into_response();
            }
        },
    };
    let from = from.unwrap_or(1).max(1);
    let to = to.or(commit).unwrap_or(0);
    let dispatcher = admin.dataplane.clone();
    let job = dispatcher.new_id("x");
    dispatcher.set_report(&job, None);
    let (d, j, dir) = (dispatcher.clone(), job.clone(), admin.exports_dir.clone());
    tokio::spawn(async move {
        let report = export::run(d.clone(), dir, j.clone(), shard, node, from, to, deadline).await;
        tracing::info!(job = %j, state = %report.state, rows = report.rows, "export finished");
        d.set_report(&j, Some(serde_json::to_value(report).expect("plain data")));
    });
    (StatusCode::ACCEPTED, Json(TaskStarted { query_id: job, task_ids: Vec::new() })).into_response()
}

#[utoipa::path(get, path = "/v1/jobs/{id}/export", tag = "tasks", params(("id" = String, Path, description = "an export job's id")),
    responses((status = 200, description = "the Arrow IPC file", content_type = "application/vnd.apache.arrow.file"),
        (status = 404, description = "no such export, or not finished", body = crate::models::ErrorBody)))]
pub async fn export_file(State(admin): State<Arc<CoordAdmin>>, PathId(id): PathId) -> Response {
    let done = admin.dataplane.report(&id).flatten().is_some_and(|r| r["state"] == "done" && r["file"].is_string());
    if !done || !id.starts_with("x-") || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no finished export {id}")).into_response();
    }
    match tokio::fs::read(walship_dataplane::kinds::export::file_of(&admin.exports_dir, &id)).await {
        Ok(bytes) => ([(axum::http::header::CONTENT_TYPE, "application/vnd.apache.arrow.file")], bytes).into_response(),
        Err(e) => ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("export {id}: {e}")).into_response(),
    }
}
