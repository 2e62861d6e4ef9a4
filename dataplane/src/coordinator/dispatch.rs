//! Dispatch (queued tasks to workers with room) and the watchdog (stalls,
//! deadlines, forgetting old finished tasks).

use super::*;

impl Dispatcher {
    /// Picks queued tasks and sends them, until `stop`.
    pub(super) async fn run_dispatch(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        loop {
            // A worker with room whose outbox is full wakes dispatch as soon
            // as it drains, not at the next tick.
            for (outbox, watched) in self.full_outboxes() {
                let me = self.clone();
                tokio::spawn(async move {
                    if let Ok(permit) = outbox.reserve().await {
                        drop(permit);
                    }
                    watched.store(false, Ordering::Release);
                    me.wake.notify_one();
                });
            }
            let sends = self.pick();
            if sends.is_empty() {
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = stop.cancelled() => return,
                    // Deadlines and reconnects also change what can go.
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
                continue;
            }
            for (permit, dispatch) in sends {
                tracing::debug!(task_id = %dispatch.task_id, "dispatched");
                permit.send(Ok(CoordEnvelope { msg: Some(Down::TaskDispatch(dispatch)) }));
                self.counters.dispatched.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Outboxes of workers with room that are full and nobody watches yet.
    #[allow(clippy::type_complexity)]
    pub(super) fn full_outboxes(
        &self,
    ) -> Vec<(mpsc::Sender<Result<CoordEnvelope, Status>>, Arc<std::sync::atomic::AtomicBool>)> {
        let state = self.state.lock();
        state
            .workers
            .values()
            .filter(|w| w.in_flight < w.capacity && w.outbox.capacity() == 0)
            .filter(|w| !w.drain_watched.swap(true, Ordering::AcqRel))
            .map(|w| (w.outbox.clone(), w.drain_watched.clone()))
            .collect()
    }

    /// Assigns what can go now: queued tasks to workers with room, each
    /// with a slot already reserved in its worker's outbox. A worker whose
    /// outbox is full (it stopped reading: HTTP/2 flow control holds the
    /// messages back) has no room until it drains, so a stuck worker never
    /// holds up dispatch to the others.
    pub(super) fn pick(&self) -> Vec<(Permit, TaskDispatch)> {
        let mut state = self.state.lock();
        let state = &mut *state;
        let mut sends = Vec::new();
        let has_room = |w: &Worker| w.in_flight < w.capacity && w.outbox.capacity() > 0;
        // Stop scanning once no worker has room: a busy cluster with a long
        // queue costs one pass per freed slot, not one per queued task.
        let mut room: usize = state
            .workers
            .values()
            .filter(|w| has_room(w))
            .map(|w| (w.capacity - w.in_flight).min(w.outbox.capacity()))
            .sum();
        let mut kept = std::collections::VecDeque::with_capacity(state.queue.len());
        while let Some(id) = state.queue.pop_front() {
            if room == 0 {
                kept.push_back(id);
                kept.extend(state.queue.drain(..));
                break;
            }
            let Some(task) = state.tasks.get_mut(&id) else { continue };
            if task.state != TaskState::Queued {
                continue;
            }
            let worker = match &task.spec.target {
                Some(target) => state.workers.get(target).filter(|w| has_room(w)).map(|_| target.clone()),
                None => state
                    .workers
                    .iter()
                    .filter(|(_, w)| has_room(w))
                    .max_by_key(|(id, w)| (w.capacity - w.in_flight, std::cmp::Reverse((*id).clone())))
                    .map(|(id, _)| id.clone()),
            };
            let w = worker.and_then(|worker| state.workers.get_mut(&worker).map(|w| (worker, w)));
            let Some((worker, w)) = w else {
                kept.push_back(id);
                continue;
            };
            // Another sender (a cancel) may have taken the last slot.
            let Ok(permit) = w.outbox.clone().try_reserve_owned() else {
                kept.push_back(id);
                continue;
            };
            w.in_flight += 1;
            room -= 1;
            task.dispatched(&worker, w.conn);
            let dispatch = TaskDispatch {
                task_id: task.spec.task_id.clone(),
                query_id: task.spec.query_id.clone(),
                stage_id: task.spec.kind.clone(),
                task_blob: task.spec.blob.clone().into(),
                deadline_unix_nano: task.spec.deadline_unix_nano,
                attempt: task.attempts,
            };
            sends.push((permit, dispatch));
        }
        state.queue = kept;
        sends
    }

    /// Every second: stalled tasks are cancelled and requeued, expired
    /// ones cancelled and failed; old finished tasks are forgotten.
    pub(super) async fn run_watchdog(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            let now = unix_nanos();
            let (mut cancels, mut events) = (Vec::new(), Vec::new());
            {
                let mut state = self.state.lock();
                let state = &mut *state;
                for task in state.tasks.values_mut() {
                    let reason = if task.expired(now) {
                        Some(("deadline exceeded".to_string(), true))
                    } else if task.stalled(self.settings.stall) {
                        Some((format!("no progress for {:?}", self.settings.stall), false))
                    } else {
                        None
                    };
                    let Some((reason, fail)) = reason else { continue };
                    let assigned = task.assigned.clone();
                    if fail {
                        task.assigned = None;
                        task.finish(TaskState::Failed, Some(reason.clone()));
                    } else {
                        task.lost(&reason, self.settings.max_attempts);
                        if task.state == TaskState::Queued {
                            state.queue.push_back(task.spec.task_id.clone());
                        }
                    }
                    if task.state.finished() {
                        events.push((task.spec.query_id.clone(), task.spec.task_id.clone(), task.error.clone()));
                    }
                    if task.dead_letter {
                        let _ = self.dead_letters.send(DeadLetter::of(task));
                    }
                    if let Some((worker, _)) = assigned
                        && let Some(w) = state.workers.get_mut(&worker)
                    {
                        w.in_flight = w.in_flight.saturating_sub(1);
                        cancels.push((w.outbox.clone(), TaskCancel { task_id: task.spec.task_id.clone(), reason }));
                    }
                }
                for (job, task_id, error) in events.drain(..) {
                    if let Some(job) = state.jobs.get(&job) {
                        let _ = job.results.send(JobEvent::Finished { task_id, state: TaskState::Failed, error });
                    }
                }
                forget_old(state);
            }
            for (outbox, cancel) in cancels {
                let _ = outbox.try_send(Ok(CoordEnvelope { msg: Some(Down::TaskCancel(cancel)) }));
                self.wake.notify_one();
            }
        }
    }
}

/// Keeps at most [`KEEP_FINISHED`] finished tasks (dead letters are kept).
pub(super) fn forget_old(state: &mut State) {
    let finished = state.order.iter().filter(|id| state.tasks.get(*id).is_some_and(|t| t.state.finished())).count();
    if finished <= KEEP_FINISHED {
        return;
    }
    let mut excess = finished - KEEP_FINISHED;
    let tasks = &mut state.tasks;
    state.order.retain(|id| {
        let drop = excess > 0 && tasks.get(id).is_some_and(|t| t.state.finished() && !t.dead_letter);
        if drop {
            excess -= 1;
            tasks.remove(id);
        }
        !drop
    });
}
