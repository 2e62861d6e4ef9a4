//! An acknowledged-record history on a sample of shards, checked against
//! every replica: what `walship-history` runs beside a failover
//! (`ops/bench/scale.sh --kill --load N`).
//!
//! One client per sampled shard appends QUORUM records one at a time
//! through a [`Producer`] (exactly once: a retried batch is never written
//! twice), each payload unique to the run, shard and sequence, and keeps
//! every acknowledgement (seqno and payload). Outcomes that stay unknown
//! and refusals are counted, never taken for acknowledged. Once told to
//! stop, the clients finish the record they are on, and every node is
//! asked for each shard's records up to its newest acknowledged one,
//! waiting until the node has committed that far (`min_seqno`). A node
//! that answers must hold every acknowledged record at its seqno with its
//! payload: one it misses or holds differently is *lost* on that node. A
//! node that cannot answer (down, or still catching up when the wait runs
//! out) is counted as unchecked for that shard, not as losing anything,
//! and is not asked again for the other shards; every shard must be
//! checked on at least one node. A node that answers `DATA_LOSS` for a
//! shard (a record it holds is damaged, found by that read or before) is
//! asked again until it has repaired the shard from another replica, within
//! the same wait; if it has not by then, that pair alone is unchecked and
//! the node is still asked for the other shards.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use serde::Serialize;
use tonic::transport::Channel;
use walship_client::{Acked, ProduceError, Producer};
use walship_proto::log::ReadRequest;
use walship_proto::log::log_client::LogClient;

/// What one sampled shard's client saw.
#[derive(Debug, Default)]
pub struct ShardHistory {
    pub shard: u32,
    /// Acknowledged records: seqno (0 when the ack could not name it, see
    /// [`Acked::seqno`]) and payload.
    pub acked: Vec<(u64, Bytes)>,
    /// Records whose outcome stayed unknown (written or not).
    pub unknown: u64,
    /// Records refused or not written.
    pub refused: u64,
}

/// The check's figures, one JSON object.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Verdict {
    pub shards: usize,
    pub acked: u64,
    /// Acknowledged before the stop was asked for at `marked` (the load was
    /// running when the failover began).
    pub acked_before_mark: u64,
    pub unknown: u64,
    pub refused: u64,
    /// Acknowledged records some node that answered does not hold at their
    /// seqno with their payload (must be 0).
    pub lost: u64,
    /// (shard, node) pairs read and compared.
    pub checked: u64,
    /// (shard, node) pairs that could not be read (a node down, or not
    /// caught up in time).
    pub unchecked: u64,
    /// Shards no node could be read for (must be 0).
    pub shards_unread: u64,
    /// Why each node that could not be read could not: "ADDR: why" (the
    /// connection, or the first refused read).
    pub unreadable: Vec<String>,
    /// (shard, node) pairs that first answered `DATA_LOSS` (a damaged
    /// record), then were read once the node had repaired them (and counted
    /// in `checked`).
    pub repaired: u64,
    /// The first few losses, for the report: "shard S seqno Q on node ADDR: why".
    pub examples: Vec<String>,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.lost == 0 && self.shards_unread == 0 && self.acked > 0
    }
}

/// A record payload unique to the run, the shard and its sequence.
pub fn payload(run: u64, shard: u32, i: u64, size: usize) -> Bytes {
    let mut p = format!("history-{run:016x}-{shard}-{i}-").into_bytes();
    p.resize(size.max(p.len()), b'.');
    Bytes::from(p)
}

/// Appends to `shard` one record at a time until `stop`, counting the
/// acknowledgements made before `marked` was set.
pub async fn append_until(
    producer: Arc<Producer>,
    run: u64,
    shard: u32,
    size: usize,
    stop: Arc<AtomicBool>,
    marked: Arc<AtomicBool>,
    acked_before_mark: Arc<AtomicU64>,
) -> ShardHistory {
    let mut history = ShardHistory { shard, ..Default::default() };
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let body = payload(run, shard, i, size);
        match producer.send(shard, Bytes::new(), body.clone()).await.await {
            Ok(Acked { seqno, .. }) => {
                if !marked.load(Ordering::Relaxed) {
                    acked_before_mark.fetch_add(1, Ordering::Relaxed);
                }
                history.acked.push((seqno, body));
            }
            Err(ProduceError::OutcomeUnknown { .. } | ProduceError::WrittenSeqnoUnknown(_)) => history.unknown += 1,
            Err(_) => {
                history.refused += 1;
                // Nothing was written: a moment before the next, so a shard
                // with no leader yet is not asked thousands of times.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    history
}

/// Payload bytes a check's read asks for at most: well within the client's
/// 4 MiB message limit (a node answers up to 32 MiB by default, which the
/// client would refuse to decode once a shard holds that much).
pub const READ_BYTES: u64 = 1 << 20;

/// A `Log` client of `node` (`host:port`), connected within `wait`; why
/// not when it cannot be reached.
async fn connect(node: &str, wait: Duration) -> Result<LogClient<Channel>, String> {
    let addr = node.parse().map_err(|e| format!("{e}"))?;
    match tokio::time::timeout(wait, crate::walship::connect(addr)).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(format!("connecting: {e:#}")),
        Err(_) => Err(format!("no connection within {wait:?}")),
    }
}

/// Why a node's records of a shard could not be read.
#[derive(Debug)]
pub struct Unread {
    pub why: String,
    /// The node answered `DATA_LOSS`: a record of this shard is damaged
    /// there (it repairs itself from another replica).
    pub damaged: bool,
}

/// What the node behind `client` holds of `shard` from seqno 1 up to
/// `through`, once it has committed that far (waiting up to `wait`): seqno
/// -> payload. A node that says there is no acknowledged record that far
/// (`OUT_OF_RANGE`: a leader whose log ends before it) holds what it
/// returned until then. `Err` (the refusal) when it cannot be read (down,
/// damaged, or not caught up in time). With `beyond`, the read goes on past `through` to the
/// newest committed record. Each answer carries at most [`READ_BYTES`].
pub async fn read_node(
    client: &mut LogClient<Channel>,
    shard: u32,
    through: u64,
    beyond: bool,
    wait: Duration,
) -> Result<HashMap<u64, Bytes>, Unread> {
    let mut held = HashMap::new();
    let mut from = 1;
    while beyond || from <= through {
        let mut request = tonic::Request::new(ReadRequest {
            shard_id: shard,
            from_seqno: from,
            to_seqno: if beyond { 0 } else { through },
            min_seqno: through,
            max_bytes: READ_BYTES,
            ..Default::default()
        });
        request.set_timeout(wait);
        let answer = match client.read(request).await {
            Ok(answer) => answer.into_inner(),
            Err(status) if status.code() == tonic::Code::OutOfRange => break,
            Err(status) => {
                let damaged = status.code() == tonic::Code::DataLoss;
                return Err(Unread { why: format!("reading shard {shard} from {from}: {status}"), damaged });
            }
        };
        if answer.records.is_empty() || answer.next_seqno <= from {
            break;
        }
        for record in answer.records {
            held.insert(record.seqno, record.payload);
        }
        from = answer.next_seqno;
    }
    Ok(held)
}

/// Compares `histories` with what each of `nodes` holds (see the module
/// docs).
pub async fn check(histories: &[ShardHistory], nodes: &[String], wait: Duration, acked_before_mark: u64) -> Verdict {
    let mut verdict = Verdict { shards: histories.len(), acked_before_mark, ..Default::default() };
    // One client per node, connected once. A node that could not be read
    // once (down, or not caught up within `wait`) is dropped and not asked
    // again: the check stays within about `wait` per node, however many
    // shards.
    let mut clients = Vec::with_capacity(nodes.len());
    for node in nodes {
        let client = connect(node, wait).await;
        if let Err(why) = &client {
            verdict.unreadable.push(format!("{node}: {why}"));
        }
        clients.push((node, client.ok()));
    }
    for history in histories {
        verdict.acked += history.acked.len() as u64;
        verdict.unknown += history.unknown;
        verdict.refused += history.refused;
        let through = history.acked.iter().map(|(seqno, _)| *seqno).max().unwrap_or(0);
        let unnamed = history.acked.iter().any(|(seqno, _)| *seqno == 0);
        if history.acked.is_empty() {
            continue;
        }
        let mut read_any = false;
        for (node, client) in &mut clients {
            let Some(c) = client.as_mut() else {
                verdict.unchecked += 1;
                continue;
            };
            let held = match read_repaired(c, history.shard, through, unnamed, wait).await {
                Ok((held, repaired)) => {
                    verdict.repaired += u64::from(repaired);
                    held
                }
                Err(unread) => {
                    verdict.unreadable.push(format!("{node}: {}", unread.why));
                    if !unread.damaged {
                        *client = None;
                    }
                    verdict.unchecked += 1;
                    continue;
                }
            };
            read_any = true;
            verdict.checked += 1;
            for (seqno, why) in losses(&history.acked, &held) {
                verdict.lost += 1;
                if verdict.examples.len() < 5 {
                    verdict.examples.push(format!("shard {} seqno {seqno} on node {node}: {why}", history.shard));
                }
            }
        }
        if !read_any {
            verdict.shards_unread += 1;
        }
    }
    verdict
}

/// [`read_node`], asked again every half second while the node answers
/// `DATA_LOSS` (it truncates the damaged record and refetches from another
/// replica; the read then waits for it to commit that far again), for up
/// to `wait` in all; with whether it first answered `DATA_LOSS`.
async fn read_repaired(
    client: &mut LogClient<Channel>,
    shard: u32,
    through: u64,
    beyond: bool,
    wait: Duration,
) -> Result<(HashMap<u64, Bytes>, bool), Unread> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut damaged = false;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match read_node(client, shard, through, beyond, left.max(Duration::from_millis(100))).await {
            Ok(held) => return Ok((held, damaged)),
            Err(unread) if unread.damaged && left > Duration::from_millis(500) => {
                damaged = true;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(unread) => return Err(unread),
        }
    }
}

/// The acknowledged records (seqno, payload) of `acked` that `held`
/// (seqno -> payload, what a node answered) does not hold at their seqno
/// with their payload, with why. An acknowledgement that could not name
/// its seqno (0) must find its payload at some seqno.
pub fn losses(acked: &[(u64, Bytes)], held: &HashMap<u64, Bytes>) -> Vec<(u64, &'static str)> {
    let unnamed = acked.iter().any(|(seqno, _)| *seqno == 0);
    let by_payload: std::collections::HashSet<&Bytes> =
        if unnamed { held.values().collect() } else { Default::default() };
    acked
        .iter()
        .filter_map(|(seqno, body)| {
            let why = match (*seqno, held.get(seqno)) {
                (0, _) if by_payload.contains(body) => return None,
                (0, _) => "an acknowledged record whose seqno was not named is not held",
                (_, Some(p)) if p == body => return None,
                (_, Some(_)) => "another payload at its seqno",
                (_, None) => "not held",
            };
            Some((*seqno, why))
        })
        .collect()
}

/// The sampled shards, from `--shards`: comma-separated ids.
pub fn parse_shards(list: &str) -> Result<Vec<u32>> {
    let shards: Vec<u32> = list
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<u32>().with_context(|| format!("shard id {s:?}")))
        .collect::<Result<_>>()?;
    anyhow::ensure!(!shards.is_empty(), "--shards names no shard");
    anyhow::ensure!(shards.iter().all(|s| *s > 0), "shard ids start at 1");
    Ok(shards)
}

#[cfg(test)]
#[path = "history_test.rs"]
mod check_test;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_unique_and_sized() {
        let a = payload(7, 1, 1, 100);
        assert_eq!(a.len(), 100);
        assert_ne!(a, payload(7, 1, 2, 100));
        assert_ne!(a, payload(7, 2, 1, 100));
        assert_ne!(a, payload(8, 1, 1, 100));
        // Never cut below what makes it unique.
        assert!(payload(7, 1, 1, 1).starts_with(b"history-"));
    }

    #[test]
    fn a_record_missing_or_different_is_lost_and_an_unnamed_one_is_found_by_payload() {
        let acked = vec![(1, payload(1, 1, 1, 10)), (2, payload(1, 1, 2, 10)), (3, payload(1, 1, 3, 10))];
        let all: HashMap<u64, Bytes> = acked.iter().cloned().collect();
        assert!(losses(&acked, &all).is_empty());
        // More held than acknowledged (an unknown outcome that was written): fine.
        let mut more = all.clone();
        more.insert(4, payload(1, 1, 9, 10));
        assert!(losses(&acked, &more).is_empty());
        let mut missing = all.clone();
        missing.remove(&2);
        assert_eq!(losses(&acked, &missing), vec![(2, "not held")]);
        let mut other = all.clone();
        other.insert(3, payload(1, 1, 7, 10));
        assert_eq!(losses(&acked, &other), vec![(3, "another payload at its seqno")]);
        assert_eq!(losses(&acked, &HashMap::new()).len(), 3, "a node holding nothing lost all");
        // Seqno not named: found anywhere by its payload, else lost.
        let unnamed = vec![(0, payload(1, 1, 2, 10))];
        assert!(losses(&unnamed, &all).is_empty());
        assert_eq!(losses(&unnamed, &missing).len(), 1);
    }

    #[test]
    fn shard_lists_are_checked() {
        assert_eq!(parse_shards("3, 5,9").unwrap(), vec![3, 5, 9]);
        assert!(parse_shards("").is_err());
        assert!(parse_shards("0").is_err());
        assert!(parse_shards("1,x").is_err());
    }

    #[test]
    fn only_a_check_that_read_every_shard_and_lost_nothing_passes() {
        let ok = Verdict { shards: 1, acked: 3, checked: 2, ..Default::default() };
        assert!(ok.passed());
        assert!(!Verdict { lost: 1, ..ok.clone() }.passed());
        assert!(!Verdict { shards_unread: 1, ..ok.clone() }.passed());
        assert!(!Verdict { acked: 0, ..ok }.passed(), "no load: nothing shown");
    }
}
