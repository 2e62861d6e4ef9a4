//! Failover, as the coordinator runs it: raise the epoch, fence the
//! replicas, collect their positions, choose with `control/failover.rs`,
//! record and assign the new leader; and the previews that say what each
//! candidate would lose.
//!
//! Every failover runs through [`Coordinator::failover_together`], which
//! takes any number of shards: a lone one (the admin API, a drill, a
//! replica change) or every shard a lost node led (a *bulk* failover, from
//! the reconcile loop). A bulk failover raises all its epochs in one KV
//! write, fences through a few FenceMany calls per node, records every new
//! leader in one KV write and assigns through a few AssignMany calls: the
//! cost of losing a node grows with the work its shards need, not with the
//! number of round trips one shard at a time would take. Each shard is
//! still decided alone, from its own fenced majority, by the same rules.

use std::sync::Arc;
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
        self.positions_or_why(shard, replicas, fence_epoch, ANSWER_DEADLINE).await.0
    }

    /// [`Coordinator::positions`], and for each replica that did not
    /// answer, why (what a failover refused for want of a majority says).
    /// A replica that has not answered within `deadline` counts as silent.
    pub(super) async fn positions_or_why(
        &self,
        shard: u32,
        replicas: &[NodeId],
        fence_epoch: Option<u64>,
        deadline: Duration,
    ) -> (Vec<FenceResponse>, Vec<String>) {
        let majority = replicas.len() / 2 + 1;
        let mut calls = FuturesUnordered::new();
        for &node in replicas {
            let Some(mut client) = self.peers.control(node) else { continue };
            calls.push(async move {
                let timeout = deadline;
                let result = match fence_epoch {
                    // Fences go in batches per node (many shards failing
                    // over at once), each bounded by the same deadline.
                    Some(epoch) => {
                        let fence = self.fences.call(&self.peers, node, FenceRequest { shard_id: shard, epoch });
                        match tokio::time::timeout(timeout, fence).await {
                            Ok(Some(result)) => result,
                            Ok(None) => Err(tonic::Status::unavailable("no address for this node")),
                            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                                "no answer within {} ms",
                                timeout.as_millis()
                            ))),
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
            // Committed records no answering replica holds are lost
            // whichever one is promoted; they count for every candidate.
            let lacks = failover::lacks_committed(c, commit);
            out.push(CandidatePreview {
                node: c.node,
                last_epoch: c.last_epoch,
                last_seqno: c.last_seqno,
                would_lose: failover::cover(would_lose, lacks),
                would_lose_acknowledged: failover::cover(
                    failover::acknowledged(would_lose, acknowledged_through),
                    lacks,
                ),
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
        self.failover_replacing(shard, request, reason, None).await
    }

    /// [`Coordinator::failover`], avoiding `replaced` (the leader being
    /// replaced) when another replica holds every acknowledged record.
    pub(super) async fn failover_replacing(
        &self,
        shard: u32,
        request: FailoverRequest,
        reason: &str,
        replaced: Option<NodeId>,
    ) -> Result<FailoverOutcome, CoordError> {
        let lock = self.shard_locks.get(&shard).ok_or(CoordError::UnknownShard(shard))?;
        let guard =
            if request.preview { lock.lock().await } else { lock.try_lock().map_err(|_| CoordError::Busy(shard))? };
        let started = Instant::now();
        let record = self.shard_record(shard)?;
        let voters = record.failover_voters();
        if let Some(target) = request.target
            && !voters.contains(&target)
        {
            return Err(CoordError::NotAReplica { shard, node: target });
        }
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
                    unreachable: unreachable(&record, &answers),
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
        let failing = Failing {
            shard,
            target: request.target,
            prefer: None,
            allow_loss: request.allow_loss,
            reason: reason.to_string(),
            replaced,
            record,
            _guard: guard,
        };
        let (_, outcome) = self.failover_together(vec![failing]).await.pop().expect("one shard in, one out");
        outcome
    }

    /// Fails over every shard of `lost` together (a bulk failover: the
    /// reconcile loop's automatic ones). A shard whose failover is already
    /// running is answered [`CoordError::Busy`].
    pub(super) async fn failover_bulk(&self, lost: Vec<Lost>) -> Vec<(u32, Result<FailoverOutcome, CoordError>)> {
        let mut out = Vec::new();
        let mut batch = Vec::with_capacity(lost.len());
        for l in lost {
            let Some(lock) = self.shard_locks.get(&l.shard) else {
                out.push((l.shard, Err(CoordError::UnknownShard(l.shard))));
                continue;
            };
            let Ok(guard) = lock.try_lock() else {
                out.push((l.shard, Err(CoordError::Busy(l.shard))));
                continue;
            };
            match self.shard_record(l.shard) {
                Ok(record) => batch.push(Failing {
                    shard: l.shard,
                    target: None,
                    prefer: None,
                    allow_loss: false,
                    reason: l.reason.to_string(),
                    replaced: l.replaced,
                    record,
                    _guard: guard,
                }),
                Err(e) => out.push((l.shard, Err(e))),
            }
        }
        if !batch.is_empty() {
            out.extend(self.failover_together(batch).await);
        }
        out
    }

    /// The failover of every shard in `batch`, each decided alone by the
    /// same rules (module docs), its steps done for all of them together:
    /// 1. raise every epoch in one KV write (no leader while choosing);
    /// 2. fence every member of each shard (FenceMany calls per node); a
    ///    majority of each voting set must answer;
    /// 3. choose each shard's new leader from its own answers;
    /// 4. record every new leader in one KV write;
    /// 5. assign leaders and followers (AssignMany calls per node).
    ///
    /// A shard that fails a step is answered with its error and goes no
    /// further; the others go on.
    pub(super) async fn failover_together(
        &self,
        batch: Vec<Failing<'_>>,
    ) -> Vec<(u32, Result<FailoverOutcome, CoordError>)> {
        let started = Instant::now();
        let mut steps = Steps::new();
        let mut out = Vec::with_capacity(batch.len());
        // 1. Raise: past the recorded epoch, and past any newer one a
        // replica reports (a KV restored from an older copy; see
        // `epoch_ahead_of`), which the fence would otherwise find refused
        // one raise at a time.
        let reported: Vec<u64> =
            batch.iter().map(|f| self.epoch_ahead_of(f.shard, &f.record.members(), 0).unwrap_or(0)).collect();
        let raised = self
            .mutate(|s| {
                Ok(batch
                    .iter()
                    .zip(&reported)
                    .map(|(f, &reported)| {
                        let r = s.shard_mut(f.shard).ok_or(CoordError::UnknownShard(f.shard))?;
                        if reported > r.epoch {
                            tracing::warn!(
                                shard = f.shard,
                                recorded = r.epoch,
                                reported,
                                "a replica holds an epoch newer than the KV records (restored from an older copy?): \
                                 raising past it"
                            );
                        }
                        r.epoch = r.epoch.max(reported) + 1;
                        r.leader = None;
                        Ok(r.epoch)
                    })
                    .collect::<Vec<Result<u64, CoordError>>>())
            })
            .await;
        let raised = match raised {
            Ok(raised) => raised,
            Err(e) => return batch.iter().map(|f| (f.shard, Err(e.again()))).collect(),
        };
        steps.done("raise");
        let mut fencing = Vec::with_capacity(batch.len());
        for (f, epoch) in batch.into_iter().zip(raised) {
            match epoch {
                Ok(epoch) => fencing.push((f, epoch)),
                Err(e) => out.push((f.shard, Err(e))),
            }
        }
        // 2. Fence, every shard at once: the calls to each node coalesce.
        let deadline = fence_deadline(fencing.len());
        let members: Vec<Vec<NodeId>> = fencing.iter().map(|(f, _)| f.record.members()).collect();
        let fenced = futures::future::join_all(
            fencing
                .iter()
                .zip(&members)
                .map(|((f, epoch), members)| self.positions_or_why(f.shard, members, Some(*epoch), deadline)),
        )
        .await;
        steps.done("fence");
        // 3. Choose, spreading ties over the nodes by how many shards each
        // leads, counting this batch's choices as they are made.
        let leads = Mutex::new(self.leads_now());
        let chosen = futures::future::join_all(
            fencing.iter().zip(fenced).map(|((f, _), (fenced, silent))| self.choose(f, fenced, silent, &leads)),
        )
        .await;
        steps.done("choose");
        let mut recording = Vec::with_capacity(fencing.len());
        for ((f, epoch), chosen) in fencing.into_iter().zip(chosen) {
            match chosen {
                Ok(chosen) => recording.push((f, epoch, chosen)),
                Err(e) => out.push((f.shard, Err(e))),
            }
        }
        // 4. Record and promote.
        let took_ms = started.elapsed().as_millis() as u64;
        let recorded = self
            .mutate(|s| {
                Ok(recording
                    .iter()
                    .map(|(f, epoch, c)| record_leader(s, f, *epoch, c, took_ms))
                    .collect::<Vec<Result<ShardRecord, CoordError>>>())
            })
            .await;
        steps.done("record");
        let recorded = match recorded {
            Ok(recorded) => recorded,
            Err(e) => {
                out.extend(recording.iter().map(|(f, _, _)| (f.shard, Err(e.again()))));
                return out;
            }
        };
        // 5. Assign the leaders, and the followers to repair and follow,
        // all at once: a follower that asks before its leader took its role
        // is told so and asks again a few ms later.
        let assigning = recording.iter().zip(&recorded).filter_map(|((f, _, c), record)| {
            let record = record.as_ref().ok()?;
            Some(self.assign_leadership(f.shard, record, c.chosen.node))
        });
        futures::future::join_all(assigning).await;
        steps.done("assign");
        for ((f, epoch, c), record) in recording.into_iter().zip(recorded) {
            let outcome = record.map(|_| {
                self.metrics.failovers.with_label_values(&[&f.reason, "ok"]).inc();
                self.metrics.failover_seconds.observe(started.elapsed().as_secs_f64());
                for (step, took) in &steps.took {
                    self.metrics.failover_step_seconds.with_label_values(&[step]).observe(took.as_secs_f64());
                }
                FailoverOutcome {
                    shard: f.shard,
                    preview: false,
                    epoch,
                    from: f.record.leader,
                    to: Some(c.chosen.node),
                    lost: c.chosen.would_lose,
                    took_ms: started.elapsed().as_millis() as u64,
                    unreachable: unreachable(&f.record, &c.answers),
                    candidates: c.candidates,
                    commit_seqno: c.commit,
                }
            });
            out.push((f.shard, outcome));
        }
        out
    }

    /// Step 3 for one shard: its new leader, from the fence answers
    /// (`fenced`; `silent` says why the others did not answer). `leads`
    /// counts the shards each node leads, this choice included once made.
    async fn choose(
        &self,
        f: &Failing<'_>,
        fenced: Vec<FenceResponse>,
        silent: Vec<String>,
        leads: &Mutex<BTreeMap<NodeId, usize>>,
    ) -> Result<Chosen, CoordError> {
        let (shard, record) = (f.shard, &f.record);
        let voters = record.failover_voters();
        let outcome_label = |o: &str| self.metrics.failovers.with_label_values(&[&f.reason, o]).inc();
        let forced_without_majority = f.allow_loss && fenced.iter().any(|a| voters.contains(&a.node_id));
        for set in [&record.replicas, &record.joint].into_iter().filter(|s| !s.is_empty()) {
            let answered = fenced.iter().filter(|a| set.contains(&a.node_id)).count();
            if !failover::is_majority(answered, set.len()) && !forced_without_majority {
                outcome_label("no_majority");
                return Err(CoordError::NoMajority { shard, answered, replicas: set.len(), silent: silent.join("; ") });
            }
        }
        let answers: Vec<FenceResponse> = fenced.into_iter().filter(|a| voters.contains(&a.node_id)).collect();
        let commit = answers.iter().map(|a| a.commit_seqno).fold(record.commit_floor, u64::max);
        let candidates = self.previews(shard, &answers, voters.len(), commit).await;
        let preferred = f.prefer.and_then(|p| {
            let answer = answers.iter().find(|a| a.node_id == p)?;
            let preview = candidates.iter().find(|c| c.node == p)?;
            let takes_over = candidate(answer).healthy()
                && preview.would_lose_acknowledged.is_none()
                && answer.last_seqno >= self.archived_seqno(shard, &record.members());
            takes_over.then_some(preview)
        });
        let chosen = match (f.target, preferred) {
            (Some(target), _) => candidates.iter().find(|c| c.node == target).ok_or(CoordError::Unreachable(target))?,
            (None, Some(preferred)) => {
                *leads.lock().entry(preferred.node).or_default() += 1;
                preferred
            }
            (None, None) => {
                let loses_acknowledged =
                    |c: &Candidate| candidates.iter().any(|p| p.node == c.node && p.would_lose_acknowledged.is_some());
                let ranked: Vec<Candidate> = answers
                    .iter()
                    .map(|a| Candidate { replaced: Some(a.node_id) == f.replaced, ..candidate(a) })
                    .collect();
                // A rebalance whose preferred replica was passed over keeps
                // the shard where it is when the old leader is as good as
                // any: the move it planned does not become another one.
                let keep = f.prefer.and(record.leader);
                let mut leads = leads.lock();
                let ties = failover::ties_keeping(keep, |n| leads.get(&n).copied().unwrap_or(0));
                let node = failover::promote(&ranked, loses_acknowledged, ties).expect("answers are non-empty").node;
                *leads.entry(node).or_default() += 1;
                candidates.iter().find(|c| c.node == node).expect("every answer has a preview")
            }
        }
        .clone();
        if let Some((from, to)) = chosen.would_lose_acknowledged
            && !f.allow_loss
        {
            outcome_label("refused");
            return Err(CoordError::WouldLose { node: chosen.node, from, to });
        }
        // Not even a forced failover may promote a replica whose log ends
        // before the archive does: its new records would reuse seqnos the
        // archive holds with the given-up contents, so its archiver would
        // skip them (it goes on from the store's end) and retention would
        // compact them as archived, losing records acknowledged after the
        // failover. The archive holds what the replica lacks: re-seed it
        // from there first.
        let chosen_last = answers.iter().find(|a| a.node_id == chosen.node).map_or(0, |a| a.last_seqno);
        let archived = self.archived_seqno(shard, &record.members());
        if archived > chosen_last {
            outcome_label("refused");
            return Err(CoordError::Conflict {
                code: "archive_ahead",
                message: format!(
                    "the archive holds shard {shard} through seqno {archived}, past node {}'s log (it ends at \
                     {chosen_last}): promoting it would reuse seqnos the archive holds, and records acknowledged \
                     after the failover would be compacted as archived. Promote a replica holding seqno {archived}, \
                     or re-seed node {} from the archive first",
                    chosen.node, chosen.node
                ),
            });
        }
        Ok(Chosen { chosen, candidates, commit, answers })
    }

    /// The newest seqno of `shard` any of `members` reported archived (as
    /// its archiving leader), in the last heartbeats this coordinator holds:
    /// an archive only grows, so an old report is a floor. 0: none known.
    fn archived_seqno(&self, shard: u32, members: &[NodeId]) -> u64 {
        let reports = self.reports();
        members
            .iter()
            .filter_map(|&n| reports.heartbeat(n, shard))
            .filter(|h| h.archiving)
            .map(|h| h.archived_seqno)
            .max()
            .unwrap_or(0)
    }

    /// Step 5 for one shard: assigns `record` (led by `leader`) to every
    /// member at once.
    async fn assign_leadership(&self, shard: u32, record: &ShardRecord, leader: NodeId) {
        let members = record.members();
        let taken = futures::future::join_all(members.iter().map(|&r| self.assign(shard, record, leader, r))).await;
        if members.iter().zip(taken).any(|(&r, taken)| r == leader && !taken) {
            tracing::warn!(shard, leader, "the new leader did not take the assignment yet; reconciliation retries");
        }
    }
}

/// A shard the reconcile loop found without a working leader.
pub(super) struct Lost {
    pub(super) shard: u32,
    /// Why (recorded with the failover): `automatic`, `leader_unreachable`,
    /// `disk_full`, `corruption`, `kv_behind`.
    pub(super) reason: &'static str,
    /// The recorded leader being replaced, if any.
    pub(super) replaced: Option<NodeId>,
}

/// One shard's part in a failover, its lock held until the failover ends
/// (one failover of a shard at a time).
pub(super) struct Failing<'a> {
    pub(super) shard: u32,
    /// Replica to promote; none: the best one.
    pub(super) target: Option<NodeId>,
    /// Replica to promote when it holds every acknowledged record and is
    /// healthy (a rebalance, `rebalance.rs`); otherwise the best one, as
    /// without it, except that a tie keeps the old leader.
    pub(super) prefer: Option<NodeId>,
    pub(super) allow_loss: bool,
    pub(super) reason: String,
    pub(super) replaced: Option<NodeId>,
    /// The shard's record when its lock was taken.
    pub(super) record: Arc<ShardRecord>,
    pub(super) _guard: tokio::sync::MutexGuard<'a, ()>,
}

/// The replica step 3 chose, and what it was chosen from.
struct Chosen {
    chosen: CandidatePreview,
    candidates: Vec<CandidatePreview>,
    commit: u64,
    /// The voters that answered the fence.
    answers: Vec<FenceResponse>,
}

/// Step 4 for one shard: records `c`'s replica as the leader of `epoch`
/// unless another failover raised the epoch since. Changes nothing when it
/// fails.
fn record_leader(
    s: &mut ClusterState,
    f: &Failing<'_>,
    epoch: u64,
    c: &Chosen,
    took_ms: u64,
) -> Result<ShardRecord, CoordError> {
    let r = s.shard_mut(f.shard).ok_or(CoordError::UnknownShard(f.shard))?;
    if r.epoch != epoch {
        return Err(CoordError::Busy(f.shard));
    }
    r.leader = Some(c.chosen.node);
    // Never past the new leader's log: a forced failover that lost
    // committed records starts the shard's commit again from its end.
    r.commit_floor = r.commit_floor.max(c.commit).min(c.chosen.last_seqno);
    if !r.joint.is_empty() {
        tracing::warn!(shard = f.shard, epoch, from = ?r.replicas, back_to = ?r.joint, "a failover during a replica change: back to the replica set before it");
        r.replicas = std::mem::take(&mut r.joint);
        r.members_version += 1;
    }
    let updated = r.clone();
    let reason = if f.allow_loss && c.chosen.would_lose.is_some() { "forced" } else { &f.reason };
    s.record_failover(FailoverRecord {
        shard: f.shard,
        epoch,
        from: f.record.leader,
        to: c.chosen.node,
        reason: reason.to_string(),
        at_unix_ms: now_ms(),
        took_ms,
        lost: c.chosen.would_lose,
    });
    Ok(updated)
}

/// The voters of `record` that are not among `answers`.
fn unreachable(record: &ShardRecord, answers: &[FenceResponse]) -> Vec<NodeId> {
    record.voters().into_iter().filter(|r| !answers.iter().any(|a| a.node_id == *r)).collect()
}

/// How long a replica's position or a lone fence may take.
const ANSWER_DEADLINE: Duration = Duration::from_millis(500);

/// How long the fences of a failover of `shards` shards may take: a lone
/// one [`ANSWER_DEADLINE`], a bulk one 2 ms more per shard, at most
/// [`MAX_FENCE_DEADLINE`]. A node fences a shard in 0.3-0.5 ms of a
/// FenceMany here while failing over thousands, and the calls of two bulks
/// share its lanes; a fence that misses its deadline counts as no answer,
/// and a shard without a majority backs off a second, so the deadline errs
/// long.
fn fence_deadline(shards: usize) -> Duration {
    (ANSWER_DEADLINE + Duration::from_millis(2 * shards as u64)).min(MAX_FENCE_DEADLINE)
}

/// The longest a bulk failover's fences may take (a batch call's own
/// deadline, `batch.rs`, is not shorter).
pub(super) const MAX_FENCE_DEADLINE: Duration = Duration::from_secs(5);

impl CoordError {
    /// A batch-wide failure (a KV write carrying every shard's change) as
    /// one more shard's own error.
    fn again(&self) -> CoordError {
        match self {
            CoordError::NotActive => CoordError::NotActive,
            CoordError::Kv(KvError::Unavailable(e)) => CoordError::Kv(KvError::Unavailable(e.clone())),
            other => CoordError::Kv(KvError::Unavailable(other.to_string())),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bulk_failover_waits_longer_for_its_fences_up_to_a_bound() {
        assert_eq!(fence_deadline(1), ANSWER_DEADLINE + Duration::from_millis(2));
        assert!(fence_deadline(2_000) > fence_deadline(100));
        assert_eq!(fence_deadline(100_000), MAX_FENCE_DEADLINE);
    }

    #[test]
    fn a_batch_failure_is_each_shards_own() {
        assert!(matches!(CoordError::NotActive.again(), CoordError::NotActive));
        let kv = CoordError::Kv(KvError::Unavailable("disk gone".into()));
        assert_eq!(kv.again().to_string(), kv.to_string());
    }
}
