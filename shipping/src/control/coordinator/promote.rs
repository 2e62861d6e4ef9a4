//! Failover, as the coordinator runs it: raise the epoch, fence the
//! replicas, collect their positions, choose with `control/failover.rs`,
//! record and assign the new leader; and the previews that say what each
//! candidate would lose.

use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use walship_proto::log::{EpochEndRequest, FenceRequest, FenceResponse, PositionRequest};

use super::*;

impl Coordinator {
    pub(super) async fn positions(
        &self,
        shard: u32,
        replicas: &[NodeId],
        fence_epoch: Option<u64>,
    ) -> Vec<FenceResponse> {
        self.positions_or_why(shard, replicas, fence_epoch).await.0
    }

    /// [`Coordinator::positions`], and for each replica that did not
    /// answer, why (what a failover refused for want of a majority says).
    pub(super) async fn positions_or_why(
        &self,
        shard: u32,
        replicas: &[NodeId],
        fence_epoch: Option<u64>,
    ) -> (Vec<FenceResponse>, Vec<String>) {
        let majority = replicas.len() / 2 + 1;
        let mut calls = FuturesUnordered::new();
        for &node in replicas {
            let Some(mut client) = self.peers.control(node) else { continue };
            calls.push(async move {
                let timeout = Duration::from_millis(500);
                let result = match fence_epoch {
                    // Fences go in batches per node (many shards failing
                    // over at once), each bounded by the same deadline.
                    Some(epoch) => {
                        let fence = self.fences.call(&self.peers, node, FenceRequest { shard_id: shard, epoch });
                        match tokio::time::timeout(timeout, fence).await {
                            Ok(Some(result)) => result,
                            Ok(None) => Err(tonic::Status::unavailable("no address for this node")),
                            Err(_) => Err(tonic::Status::deadline_exceeded("no answer within 500 ms")),
                        }
                    }
                    None => {
                        let mut r = tonic::Request::new(PositionRequest { shard_id: shard });
                        r.set_timeout(timeout);
                        client.position(r).await.map(|r| r.into_inner())
                    }
                };
                (node, result)
            });
        }
        // Wait for everyone, but once a majority answered give stragglers
        // only a short grace: a stopped or partitioned replica must not hold
        // the failover for the whole timeout.
        let mut answers = Vec::new();
        let mut silent = Vec::new();
        let mut grace: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        loop {
            let next = async {
                match grace.as_mut() {
                    Some(sleep) => tokio::select! { r = calls.next() => r, _ = sleep => None },
                    None => calls.next().await,
                }
            };
            match next.await {
                Some((node, Ok(answer))) => {
                    debug_assert_eq!(answer.node_id, node);
                    answers.push(answer);
                    if answers.len() >= majority && grace.is_none() {
                        grace = Some(Box::pin(tokio::time::sleep(Duration::from_millis(30))));
                    }
                }
                Some((node, Err(status))) => {
                    tracing::debug!(shard, node, %status, "no position");
                    silent.push((node, status.message().to_string()));
                }
                None => break,
            }
        }
        // Replicas neither answered nor failed: no address, or cut by the grace.
        let why = replicas
            .iter()
            .filter(|&&node| !answers.iter().any(|a: &FenceResponse| a.node_id == node))
            .map(|&node| match silent.iter().find(|(n, _)| *n == node) {
                Some((_, reason)) => format!("node {node}: {reason}"),
                None => format!("node {node}: no answer in time"),
            })
            .collect();
        (answers, why)
    }

    pub(super) async fn epoch_end(&self, node: NodeId, shard: u32, epoch: u64) -> Option<u64> {
        let mut client = self.peers.control(node)?;
        let mut request = tonic::Request::new(EpochEndRequest { shard_id: shard, epoch });
        request.set_timeout(Duration::from_millis(500));
        client.epoch_end(request).await.ok().map(|r| r.into_inner().end_seqno)
    }

    /// Candidates and what each would lose, from live positions of the
    /// `voters` that answered (`answers`); `commit` is the highest commit
    /// known. A loss counts as acknowledged up to
    /// [`failover::maybe_acknowledged_through`], not only up to `commit`.
    async fn previews(
        &self,
        shard: u32,
        answers: &[FenceResponse],
        voters: usize,
        commit: u64,
    ) -> Vec<CandidatePreview> {
        let candidates: Vec<Candidate> = answers.iter().map(candidate).collect();
        let answered_last: Vec<u64> = answers.iter().map(|a| a.last_seqno).collect();
        let acknowledged_through = failover::maybe_acknowledged_through(&answered_last, voters, commit);
        let Some(best) = failover::best(&candidates) else { return Vec::new() };
        let mut out = Vec::new();
        for c in &candidates {
            let would_lose = if c.node == best.node {
                None
            } else {
                // Two logs of the same log epoch are prefixes of that
                // epoch's leader's log, so they agree as far as the shorter
                // goes: no need to ask where the epoch ends.
                let end = if c.last_epoch == best.last_epoch {
                    best.last_seqno
                } else {
                    self.epoch_end(best.node, shard, c.last_epoch).await.unwrap_or(0)
                };
                failover::loss(c, &best, end)
            };
            out.push(CandidatePreview {
                node: c.node,
                last_epoch: c.last_epoch,
                last_seqno: c.last_seqno,
                would_lose,
                would_lose_acknowledged: failover::acknowledged(would_lose, acknowledged_through),
                is_best: c.node == best.node,
            });
        }
        out.sort_by_key(|p| p.node);
        out
    }

    /// Runs (or previews) a failover of `shard`. `reason` is recorded.
    pub async fn failover(
        &self,
        shard: u32,
        request: FailoverRequest,
        reason: &str,
    ) -> Result<FailoverOutcome, CoordError> {
        self.failover_replacing(shard, request, reason, None, None).await
    }

    /// [`Coordinator::failover`], avoiding `replaced` (the leader an
    /// automatic failover replaces) when another replica holds every
    /// acknowledged record. `slot` (an automatic failover's place among
    /// those running at once) is given back once the new leader is
    /// recorded: the assignments that follow go through the per-node
    /// batches, which bound them by themselves, and need not hold up the
    /// next failover.
    pub(super) async fn failover_replacing(
        &self,
        shard: u32,
        request: FailoverRequest,
        reason: &str,
        replaced: Option<NodeId>,
        slot: Option<tokio::sync::SemaphorePermit<'_>>,
    ) -> Result<FailoverOutcome, CoordError> {
        let lock = self.shard_locks.get(&shard).ok_or(CoordError::UnknownShard(shard))?;
        let _guard =
            if request.preview { lock.lock().await } else { lock.try_lock().map_err(|_| CoordError::Busy(shard))? };
        let started = Instant::now();
        let record = self.shard_record(shard)?;
        // While the replica set changes, a failover goes back to the set
        // before the change (everything acknowledged is on a majority of it)
        // and promotes only one of its members.
        let voters = if record.joint.is_empty() { record.replicas.clone() } else { record.joint.clone() };
        if let Some(target) = request.target
            && !voters.contains(&target)
        {
            return Err(CoordError::NotAReplica { shard, node: target });
        }
        let unreachable = |answers: &[FenceResponse]| -> Vec<NodeId> {
            record.voters().into_iter().filter(|r| !answers.iter().any(|a| a.node_id == *r)).collect()
        };
        if request.preview || (request.target.is_some() && !request.allow_loss) {
            let answers = self.positions(shard, &record.voters(), None).await;
            let answers: Vec<FenceResponse> = answers.into_iter().filter(|a| voters.contains(&a.node_id)).collect();
            let commit = answers.iter().map(|a| a.commit_seqno).fold(record.commit_floor, u64::max);
            let candidates = self.previews(shard, &answers, voters.len(), commit).await;
            if request.preview {
                return Ok(FailoverOutcome {
                    shard,
                    preview: true,
                    epoch: record.epoch,
                    from: record.leader,
                    to: candidates
                        .iter()
                        .find(|c| Some(c.node) == request.target || (request.target.is_none() && c.is_best))
                        .map(|c| c.node),
                    lost: None,
                    took_ms: started.elapsed().as_millis() as u64,
                    unreachable: unreachable(&answers),
                    candidates,
                    commit_seqno: commit,
                });
            }
            let target = request.target.expect("checked");
            match candidates.iter().find(|c| c.node == target) {
                None => return Err(CoordError::Unreachable(target)),
                Some(c) => {
                    if let Some((from, to)) = c.would_lose_acknowledged {
                        return Err(CoordError::WouldLose { node: target, from, to });
                    }
                }
            }
        }

        let previous_leader = record.leader;
        let mut steps = Steps::new();
        // 1. Raise the epoch (no leader while choosing).
        let epoch = self
            .mutate(|s| {
                let r = s.shard_mut(shard).ok_or(CoordError::UnknownShard(shard))?;
                r.epoch += 1;
                r.leader = None;
                Ok(r.epoch)
            })
            .await?;
        steps.done("raise");
        // 2. Fence every member (learners too: they follow no older epoch
        // from now on). A majority of each voting set must answer.
        let (fenced, silent) = self.positions_or_why(shard, &record.members(), Some(epoch)).await;
        let outcome_label = |o: &str| self.metrics.failovers.with_label_values(&[reason, o]).inc();
        let forced_without_majority = request.allow_loss && fenced.iter().any(|a| voters.contains(&a.node_id));
        for set in [&record.replicas, &record.joint].into_iter().filter(|s| !s.is_empty()) {
            let answered = fenced.iter().filter(|a| set.contains(&a.node_id)).count();
            if !failover::is_majority(answered, set.len()) && !forced_without_majority {
                outcome_label("no_majority");
                return Err(CoordError::NoMajority { shard, answered, replicas: set.len(), silent: silent.join("; ") });
            }
        }
        steps.done("fence");
        let answers: Vec<FenceResponse> = fenced.into_iter().filter(|a| voters.contains(&a.node_id)).collect();
        // 3. Choose.
        let commit = answers.iter().map(|a| a.commit_seqno).fold(record.commit_floor, u64::max);
        let candidates = self.previews(shard, &answers, voters.len(), commit).await;
        let chosen = match request.target {
            Some(target) => candidates.iter().find(|c| c.node == target).ok_or(CoordError::Unreachable(target))?,
            None => {
                let loses_acknowledged =
                    |c: &Candidate| candidates.iter().any(|p| p.node == c.node && p.would_lose_acknowledged.is_some());
                let ranked: Vec<Candidate> = answers
                    .iter()
                    .map(|a| Candidate { replaced: Some(a.node_id) == replaced, ..candidate(a) })
                    .collect();
                let node = failover::promote(&ranked, loses_acknowledged).expect("answers are non-empty").node;
                candidates.iter().find(|c| c.node == node).expect("every answer has a preview")
            }
        }
        .clone();
        if let Some((from, to)) = chosen.would_lose_acknowledged
            && !request.allow_loss
        {
            outcome_label("refused");
            return Err(CoordError::WouldLose { node: chosen.node, from, to });
        }
        steps.done("choose");
        // 4. Record and promote.
        let took_ms = started.elapsed().as_millis() as u64;
        let reason_recorded = if request.allow_loss && chosen.would_lose.is_some() { "forced" } else { reason };
        let record = self
            .mutate(|s| {
                let r = s.shard_mut(shard).ok_or(CoordError::UnknownShard(shard))?;
                if r.epoch != epoch {
                    return Err(CoordError::Busy(shard));
                }
                r.leader = Some(chosen.node);
                r.commit_floor = r.commit_floor.max(commit);
                if !r.joint.is_empty() {
                    tracing::warn!(shard, epoch, from = ?r.replicas, back_to = ?r.joint, "a failover during a replica change: back to the replica set before it");
                    r.replicas = std::mem::take(&mut r.joint);
                    r.members_version += 1;
                }
                let updated = r.clone();
                s.record_failover(FailoverRecord {
                    shard,
                    epoch,
                    from: previous_leader,
                    to: chosen.node,
                    reason: reason_recorded.to_string(),
                    at_unix_ms: now_ms(),
                    took_ms,
                    lost: chosen.would_lose,
                });
                Ok(updated)
            })
            .await?;
        steps.done("record");
        drop(slot);
        // 5. Assign the leader, and the followers to repair and follow, all
        // at once: a follower that asks before the leader took its role is
        // told so and asks again a few ms later.
        let members = record.members();
        let taken =
            futures::future::join_all(members.iter().map(|&r| self.assign(shard, &record, chosen.node, r))).await;
        if members.iter().zip(taken).any(|(&r, taken)| r == chosen.node && !taken) {
            tracing::warn!(
                shard,
                leader = chosen.node,
                "the new leader did not take the assignment yet; reconciliation retries"
            );
        }
        steps.done("assign");
        outcome_label("ok");
        self.metrics.failover_seconds.observe(started.elapsed().as_secs_f64());
        for (step, took) in steps.took {
            self.metrics.failover_step_seconds.with_label_values(&[step]).observe(took.as_secs_f64());
        }
        Ok(FailoverOutcome {
            shard,
            preview: false,
            epoch,
            from: previous_leader,
            to: Some(chosen.node),
            lost: chosen.would_lose,
            took_ms: started.elapsed().as_millis() as u64,
            unreachable: unreachable(&answers),
            candidates,
            commit_seqno: commit,
        })
    }
}

/// How long each step of one failover took.
struct Steps {
    last: Instant,
    took: Vec<(&'static str, Duration)>,
}

impl Steps {
    fn new() -> Steps {
        Steps { last: Instant::now(), took: Vec::with_capacity(5) }
    }

    /// The step `name` ended now.
    fn done(&mut self, name: &'static str) {
        let now = Instant::now();
        self.took.push((name, now - self.last));
        self.last = now;
    }
}
