//! Cancels (here, to every worker, and through the bus to every other
//! coordinator), dead letters and their re-drive, and a job refusing a
//! task's output.

use super::*;

impl Dispatcher {
    /// Cancels a task: marked cancelled here, and a cancel broadcast to
    /// every coordinator (the bus) and from there to every worker, so it
    /// stops wherever it runs, also on a worker an earlier coordinator
    /// dispatched it to. A task unknown here is broadcast only when other
    /// coordinators hear the bus (one of them may know it).
    pub async fn cancel(&self, task_id: &str, reason: &str) -> Cancelled {
        if self.task(task_id).is_some_and(|t| t.on_coordinator && !t.state.finished()) {
            return Cancelled::NotCancellable;
        }
        let outcome = match self.cancel_here(task_id, reason) {
            Some(before) => Cancelled::Here(before),
            None if self.bus.shared() => Cancelled::Broadcast,
            None => return Cancelled::Unknown,
        };
        if !matches!(outcome, Cancelled::Here(before) if before.finished()) {
            let notice = CancelNotice {
                task_id: task_id.to_string(),
                reason: reason.to_string(),
                origin: self.settings.coordinator_id.clone(),
            };
            if let Err(e) = self.bus.publish_cancel(&notice).await {
                tracing::warn!(task_id, error = %e, "the cancel reached this coordinator's workers only");
            }
        }
        outcome
    }

    /// Marks a task cancelled (if known and running or queued) and tells
    /// every connected worker to stop it (a worker that does not run it
    /// ignores that). Answers its state before, or `None` if unknown.
    pub(super) fn cancel_here(&self, task_id: &str, reason: &str) -> Option<TaskState> {
        let mut state = self.state.lock();
        let known = match state.tasks.get_mut(task_id) {
            None => None,
            Some(task) if task.on_coordinator => Some(task.state),
            Some(task) => {
                let before = task.state;
                if !before.finished() {
                    let assigned = task.assigned.take();
                    task.finish(TaskState::Cancelled, Some(reason.to_string()));
                    let job = task.spec.query_id.clone();
                    if let Some((worker, _)) = assigned
                        && let Some(w) = state.workers.get_mut(&worker)
                    {
                        w.in_flight = w.in_flight.saturating_sub(1);
                    }
                    if let Some(job) = state.jobs.get(&job) {
                        let _ = job.results.send(JobEvent::Finished {
                            task_id: task_id.to_string(),
                            state: TaskState::Cancelled,
                            error: Some(reason.to_string()),
                        });
                    }
                }
                Some(before)
            }
        };
        if known.is_none_or(|before| !before.finished()) {
            let cancel = TaskCancel { task_id: task_id.to_string(), reason: reason.to_string() };
            for w in state.workers.values() {
                // A worker whose outbox is full has stopped reading; its
                // stream ends by keepalive and the task with it.
                let _ = w.outbox.try_send(Ok(CoordEnvelope { msg: Some(Down::TaskCancel(cancel.clone())) }));
            }
        }
        drop(state);
        self.wake.notify_one();
        known
    }

    /// Applies the cancels the bus brings (this coordinator's own too:
    /// they are idempotent), until `stop`.
    pub(super) async fn run_cancels(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let mut backoff = Duration::from_millis(200);
        loop {
            let mut cancels = tokio::select! {
                subscribed = self.bus.cancels() => match subscribed {
                    Ok(cancels) => cancels,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot hear task cancels; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = stop.cancelled() => return,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                },
                _ = stop.cancelled() => return,
            };
            backoff = Duration::from_millis(200);
            loop {
                let notice = tokio::select! {
                    notice = cancels.next() => notice,
                    _ = stop.cancelled() => return,
                };
                let Some(notice) = notice else { break };
                if notice.origin != self.settings.coordinator_id {
                    tracing::info!(task_id = %notice.task_id, origin = %notice.origin, "task cancel from another coordinator");
                }
                self.cancel_here(&notice.task_id, &notice.reason);
            }
        }
    }

    /// Writes dead letters to the bus in order, retrying while it is
    /// down (they are also in the task table meanwhile).
    pub(super) async fn write_dead_letters(
        self: Arc<Self>,
        mut letters: mpsc::UnboundedReceiver<DeadLetter>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        while let Some(letter) = tokio::select! { l = letters.recv() => l, _ = stop.cancelled() => None } {
            loop {
                match self.bus.put_dead_letter(&letter).await {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::warn!(task_id = %letter.task_id, error = %e, "keeping a dead letter failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                            _ = stop.cancelled() => return,
                        }
                    }
                }
            }
        }
    }

    /// What carries cancels and keeps dead letters.
    pub fn bus_description(&self) -> String {
        self.bus.describe()
    }

    /// The dead letters (from the bus: those of earlier coordinators too).
    pub async fn dead_letters(&self) -> Result<Vec<DeadLetter>, BusError> {
        self.bus.dead_letters().await
    }

    /// Queues a dead letter again with fresh attempts: one in this
    /// coordinator's table, or one only the bus knows (failed under an
    /// earlier coordinator: its spec comes from the letter).
    pub async fn redrive(&self, task_id: &str) -> Result<Task, RedriveError> {
        if let Some(task) = self.task(task_id)
            && !task.dead_letter
        {
            return Err(RedriveError::NotDeadLetter(task_id.to_string(), task.state.name()));
        }
        let letter = self.bus.take_dead_letter(task_id).await?;
        let mut state = self.state.lock();
        let state = &mut *state;
        match (state.tasks.get_mut(task_id), letter) {
            (Some(task), _) if task.dead_letter => {
                task.dead_letter = false;
                // Its attempts go on numbering from where they were:
                // answers of the dead ones may still arrive.
                task.redriven_after = task.attempts;
                task.state = TaskState::Queued;
                task.finished_unix_ms = None;
            }
            (Some(task), _) => return Err(RedriveError::NotDeadLetter(task_id.to_string(), task.state.name())),
            (None, Some(letter)) => {
                state.order.push(task_id.to_string());
                state.tasks.insert(task_id.to_string(), Task::new(letter.spec()?));
            }
            (None, None) => return Err(RedriveError::NotFound(task_id.to_string())),
        }
        state.queue.push_back(task_id.to_string());
        let task = state.tasks[task_id].clone();
        self.wake.notify_one();
        Ok(task)
    }

    /// A job refused a task's output (a batch it cannot read): a running
    /// task is cancelled everywhere; one that already finished with that
    /// batch is marked failed with `error`.
    pub async fn reject_output(&self, task_id: &str, error: &str) {
        {
            let mut state = self.state.lock();
            if let Some(task) = state.tasks.get_mut(task_id)
                && task.state == TaskState::Succeeded
            {
                task.state = TaskState::Failed;
                task.error = Some(error.to_string());
                return;
            }
        }
        self.cancel(task_id, error).await;
    }
}
