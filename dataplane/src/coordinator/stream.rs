//! One worker's stream: its Hello checked, its messages (progress,
//! results) applied, its disconnect handled; and the gRPC service.

use super::*;

impl Dispatcher {
    /// Checks a Hello; answers the worker's capacity.
    pub(super) fn admit(&self, hello: &Hello) -> Result<(usize, bool), Status> {
        let id = &hello.worker_id;
        if id.is_empty() || id.len() > MAX_WORKER_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Status::invalid_argument(format!(
                "Hello.worker_id must be 1 to {MAX_WORKER_ID} printable characters without spaces"
            )));
        }
        if hello.build_sha.len() > MAX_BUILD_SHA || hello.build_sha.chars().any(char::is_control) {
            return Err(Status::invalid_argument(format!(
                "Hello.build_sha must be at most {MAX_BUILD_SHA} bytes without control characters"
            )));
        }
        if hello.num_cpus < 0 || hello.gomemlimit < 0 {
            return Err(Status::invalid_argument("Hello.num_cpus and Hello.gomemlimit must not be negative"));
        }
        let matches = hello.build_sha == self.settings.build_sha;
        if !matches {
            match self.settings.build_policy {
                BuildPolicy::Refuse => {
                    return Err(Status::failed_precondition(format!(
                        "worker {id} runs build {:?}, this coordinator {:?} (build_policy = refuse)",
                        hello.build_sha, self.settings.build_sha
                    )));
                }
                BuildPolicy::Warn => tracing::warn!(
                    worker = %id,
                    worker_build = %hello.build_sha,
                    coordinator_build = %self.settings.build_sha,
                    "a worker runs another build"
                ),
            }
        }
        Ok((capacity(hello.num_cpus, hello.gomemlimit), matches))
    }

    /// A worker's stream ended: its running tasks are requeued.
    pub(super) fn disconnected(&self, worker: &str, conn: u64) {
        let mut state = self.state.lock();
        if state.workers.get(worker).is_none_or(|w| w.conn != conn) {
            return;
        }
        state.workers.remove(worker);
        let max = self.settings.max_attempts;
        let mut lost = 0;
        let mut finished = Vec::new();
        let State { tasks, queue, .. } = &mut *state;
        for task in tasks.values_mut() {
            if task.state == TaskState::Running
                && task.assigned.as_ref().is_some_and(|(w, c)| w == worker && *c == conn)
            {
                task.lost(&format!("worker {worker} disconnected"), max);
                lost += 1;
                if task.state == TaskState::Queued {
                    queue.push_back(task.spec.task_id.clone());
                }
                if task.state.finished() {
                    finished.push((task.spec.query_id.clone(), task.spec.task_id.clone(), task.error.clone()));
                }
                if task.dead_letter {
                    let _ = self.dead_letters.send(DeadLetter::of(task));
                }
            }
        }
        for (job, task_id, error) in finished {
            if let Some(job) = state.jobs.get(&job) {
                let _ = job.results.send(JobEvent::Finished { task_id, state: TaskState::Failed, error });
            }
        }
        drop(state);
        self.counters.redispatched.fetch_add(lost, Ordering::Relaxed);
        tracing::info!(worker, requeued = lost, "worker disconnected");
        self.wake.notify_one();
    }

    /// One message from `worker` (connection `conn`). A result batch
    /// waits for room in its job's queue first ([`Dispatcher::room_for`]):
    /// the stream is not read meanwhile.
    pub(super) async fn on_message(&self, worker: &str, conn: u64, msg: Up) -> Result<(), Status> {
        match msg {
            Up::Hello(_) => Err(Status::invalid_argument("a second Hello on one stream; reconnect to introduce again")),
            Up::TaskProgress(p) => {
                self.on_progress(worker, conn, p);
                Ok(())
            }
            Up::ResultBatch(batch) => {
                let room = self.room_for(&batch).await;
                self.on_batch(worker, conn, batch, room);
                Ok(())
            }
        }
    }

    pub(super) fn on_progress(&self, worker: &str, conn: u64, p: TaskProgress) {
        let mut state = self.state.lock();
        let Some(task) = state.tasks.get_mut(&p.task_id) else {
            // Running on a worker, unknown here: dispatched by an earlier
            // coordinator (a failover), whose job is gone. Nobody waits
            // for its result, so it only costs the node: stop it.
            if let Some(w) = state.workers.get(worker) {
                let reason = "no coordinator tracks this task (dispatched before a coordinator change)".to_string();
                let cancel = TaskCancel { task_id: p.task_id.clone(), reason };
                let _ = w.outbox.try_send(Ok(CoordEnvelope { msg: Some(Down::TaskCancel(cancel)) }));
                self.counters.orphans_cancelled.fetch_add(1, Ordering::Relaxed);
                tracing::info!(worker, task_id = %p.task_id, "an orphaned task: cancelled");
            }
            return;
        };
        if task.state != TaskState::Running
            || task.assigned.as_ref().is_none_or(|(w, c)| w != worker || *c != conn)
            || (p.attempt != 0 && p.attempt != task.attempts)
        {
            return;
        }
        task.report(p.rows_processed, p.bytes_processed, (p.timestamp_unix_nano / 1_000_000).max(0) as u64);
    }

    /// Room for `batch` in the queue of the job it belongs to, waited for
    /// (see [`JOB_QUEUE_BYTES`]); `None` at once when no job listens, or
    /// when the batch carries an error (its output is discarded).
    pub(super) async fn room_for(&self, batch: &ResultBatch) -> Option<OwnedSemaphorePermit> {
        if !batch.err.is_empty() {
            return None;
        }
        let room = {
            let state = self.state.lock();
            let job = state.jobs.get(&batch.query_id).filter(|job| !job.results.is_closed())?;
            job.room.clone()
        };
        let bytes = batch.payload.len().clamp(1, JOB_QUEUE_BYTES) as u32;
        if room.available_permits() < bytes as usize {
            tracing::debug!(query_id = %batch.query_id, bytes, "a job's result queue is full: its worker waits");
        }
        // Closed: the job ended while this waited; the batch is dropped.
        room.acquire_many_owned(bytes).await.ok()
    }

    pub(super) fn on_batch(&self, worker: &str, conn: u64, batch: ResultBatch, room: Option<OwnedSemaphorePermit>) {
        let mut state = self.state.lock();
        let state = &mut *state;
        // No job listens to a task re-driven from the dead letters (its job
        // ended when it died): its results go nowhere, but it still
        // finishes, instead of running until the stall watchdog kills it.
        let job = state.jobs.get(&batch.query_id);
        let task_id = if batch.task_id.is_empty() {
            // A seed worker: the job's task on this worker.
            state
                .tasks
                .values()
                .find(|t| t.spec.query_id == batch.query_id && t.assigned.as_ref().is_some_and(|(w, _)| w == worker))
                .map(|t| t.spec.task_id.clone())
                .unwrap_or_default()
        } else {
            batch.task_id.clone()
        };
        let Some(task) = state.tasks.get_mut(&task_id) else {
            self.counters.dropped_results.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if task.state != TaskState::Running
            || task.assigned.as_ref().is_none_or(|(w, c)| w != worker || *c != conn)
            || (batch.attempt != 0 && batch.attempt != task.attempts)
        {
            // Finished already, cancelled, redispatched elsewhere, or the
            // late answer of an earlier dispatch.
            self.counters.duplicate_completions.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // An error ends the task as failed whatever the batch's terminal
        // flag says, and its output is discarded: the contract sets `err`
        // only on a failed task's terminal batch, whose partial output the
        // receiver drops.
        let failed = !batch.err.is_empty();
        let terminal = batch.terminal || failed;
        let error = failed.then(|| batch.err.clone());
        if !failed {
            task.result_rows += batch.row_count.max(0) as u64;
            task.result_bytes += batch.payload.len() as u64;
        }
        match job {
            _ if failed => {}
            Some(job) => {
                let _ = job.results.send(JobEvent::Batch {
                    task_id: task_id.clone(),
                    worker: worker.to_string(),
                    batch,
                    room,
                });
            }
            None => {
                self.counters.dropped_results.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(worker, query_id = %batch.query_id, "a result no job listens to: dropped");
            }
        }
        if terminal {
            let state_now = if failed { TaskState::Failed } else { TaskState::Succeeded };
            task.finish(state_now, error.clone());
            task.assigned = None;
            if let Some(job) = job {
                let _ = job.results.send(JobEvent::Finished { task_id, state: state_now, error });
            }
            if let Some(w) = state.workers.get_mut(worker) {
                w.in_flight = w.in_flight.saturating_sub(1);
            }
            self.wake.notify_one();
        }
    }
}

type Outbound = Pin<Box<dyn Stream<Item = Result<CoordEnvelope, Status>> + Send>>;

/// The gRPC service over a [`Dispatcher`].
#[derive(Clone)]
pub struct DataPlaneService(pub Arc<Dispatcher>);

#[tonic::async_trait]
impl DataPlane for DataPlaneService {
    type ConnectStream = Outbound;

    async fn connect(&self, request: Request<Streaming<WorkerEnvelope>>) -> Result<Response<Outbound>, Status> {
        let dispatcher = self.0.clone();
        let refuse = |status: Status| {
            dispatcher.counters.refused_streams.fetch_add(1, Ordering::Relaxed);
            Err(status)
        };
        if let Err(active) = (dispatcher.active)() {
            let mut status = Status::failed_precondition(format!(
                "this coordinator is a standby; connect to the active one{}",
                active.as_deref().map(|a| format!(" at {a}")).unwrap_or_default()
            ));
            if let Some(active) = active.and_then(|a| a.parse().ok()) {
                status.metadata_mut().insert(ACTIVE_METADATA_KEY, active);
            }
            return refuse(status);
        }
        let mut inbound = request.into_inner();
        let first = match tokio::time::timeout(HELLO_TIMEOUT, inbound.message()).await {
            Err(_) => return refuse(Status::deadline_exceeded(format!("no Hello within {HELLO_TIMEOUT:?}"))),
            Ok(Err(status)) => return refuse(status),
            Ok(Ok(None)) => return refuse(Status::invalid_argument("the stream ended before its Hello")),
            Ok(Ok(Some(first))) => first,
        };
        let hello = match first.msg {
            Some(Up::Hello(hello)) => hello,
            Some(_) => {
                return refuse(Status::invalid_argument("the first message of a DataPlane stream must be Hello"));
            }
            None => {
                return refuse(Status::invalid_argument("an empty WorkerEnvelope: the first message must be Hello"));
            }
        };
        let (capacity, build_matches) = match dispatcher.admit(&hello) {
            Ok(admitted) => admitted,
            Err(status) => return refuse(status),
        };
        let worker = hello.worker_id.clone();
        let (tx, rx) = mpsc::channel(OUTBOX);
        // Welcome is the first message down: queued on the fresh outbox
        // before the worker is listed, where the dispatch loop (another
        // task) could otherwise queue a TaskDispatch ahead of it.
        let welcome = Welcome { cluster_id: dispatcher.settings.cluster_id.clone(), server_time: unix_nanos() };
        tx.try_send(Ok(CoordEnvelope { msg: Some(Down::Welcome(welcome)) }))
            .map_err(|_| ())
            .expect("a fresh outbox has room for the Welcome");
        let conn = dispatcher.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let mut state = dispatcher.state.lock();
            if let Some(existing) = state.workers.get(&worker)
                && !existing.outbox.is_closed()
            {
                drop(state);
                return refuse(Status::already_exists(format!(
                    "worker {worker} is already connected; a second stream with its id is refused"
                )));
            }
            state.workers.insert(
                worker.clone(),
                Worker {
                    conn,
                    hello: hello.clone(),
                    capacity,
                    in_flight: 0,
                    outbox: tx.clone(),
                    connected_unix_ms: unix_ms(),
                    build_matches,
                    drain_watched: Arc::default(),
                },
            );
        }
        tracing::info!(worker, capacity, build = %hello.build_sha, "worker connected");
        dispatcher.wake.notify_one();
        // Read until the worker goes away or breaks the protocol.
        let reader = dispatcher.clone();
        tokio::spawn(async move {
            let ended = loop {
                match inbound.next().await {
                    None => break None,
                    // A message it cannot take (over the size limit,
                    // undecodable): tell the worker why before closing.
                    Some(Err(status)) => {
                        let _ = tx.send(Err(status.clone())).await;
                        break Some(status.to_string());
                    }
                    Some(Ok(WorkerEnvelope { msg: None })) => {
                        let status = Status::invalid_argument("an empty WorkerEnvelope");
                        let _ = tx.send(Err(status.clone())).await;
                        break Some(status.to_string());
                    }
                    Some(Ok(WorkerEnvelope { msg: Some(msg) })) => {
                        if let Err(status) = reader.on_message(&worker, conn, msg).await {
                            let _ = tx.send(Err(status.clone())).await;
                            break Some(status.to_string());
                        }
                    }
                }
            };
            if let Some(error) = ended {
                tracing::info!(worker, error, "worker stream ended");
            }
            reader.disconnected(&worker, conn);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx)) as Outbound))
    }
}
