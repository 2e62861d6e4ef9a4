//! Producer sessions: exactly-once appends per shard.
//!
//! A client that wants its retries deduplicated appends as a *producer*: a
//! non-zero id it chooses (random, or derived from a stable name), a
//! non-zero epoch, and a sequence number per record, starting at 1 and
//! contiguous within the epoch. Every record written this way carries a
//! [`ProducerStamp`] in its frame, so the table of what each producer has
//! written is a function of the log alone: every replica rebuilds the same
//! table from the same records, and a leader after a failover deduplicates
//! exactly as its predecessor would have.
//!
//! The rules for an append of `count` records by producer `id` in `epoch`,
//! starting at `sequence` (the producer's newest sequence is `last`):
//!
//! | case | answer |
//! | --- | --- |
//! | `id`, `epoch` or `sequence` 0, or the sequences overflow | invalid |
//! | producer unknown (never seen, or expired) and `sequence` = 1 | written |
//! | producer unknown and `sequence` > 1 | [`ProducerRefusal::Unknown`] |
//! | `epoch` < the producer's epoch | [`ProducerRefusal::Fenced`] |
//! | `epoch` > the producer's epoch | as unknown: a new epoch starts at 1 |
//! | `sequence` = `last` + 1 | written |
//! | `sequence` > `last` + 1 | [`ProducerRefusal::Gap`] |
//! | every sequence <= `last`, seqnos remembered | a duplicate: the original seqnos |
//! | every sequence <= `last`, seqnos forgotten | [`ProducerRefusal::Forgotten`] |
//! | some <= `last`, the rest after it | the rest is written (the prefix survived a failover) |
//! | some <= `last` with seqnos forgotten, the rest after it | [`ProducerRefusal::ForgottenPrefix`] |
//!
//! The seqnos of a producer's last [`RUNS_KEPT`] runs (a run: records whose
//! sequences and seqnos both follow each other, such as one batch) are
//! remembered, so a retry of any of its last five in-flight batches answers
//! with the original seqnos. Older retries are still never written twice;
//! they are refused as forgotten.
//!
//! Bounds ([`ProducerLimits`]): a producer that has written nothing for
//! `idle_expiry_us` of *log time* (the leader's record timestamps, so every
//! replica expires it at the same record) is forgotten, and when a shard
//! has `max_producers` producers a new one evicts the one that wrote
//! least recently. Both are deterministic functions of the log, provided
//! every node runs with the same limits (documented as a cluster-wide
//! setting).
//!
//! The table survives restarts and compaction through snapshots kept in the
//! store beside the log (see [`crate::wal`]): [`ProducerTable::encode`] and
//! [`ProducerTable::decode`], versioned and checksummed.

use std::collections::{HashMap, VecDeque};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::record::{Frame, ProducerStamp};

/// Runs remembered per producer (a retry of any of the last five batches
/// gets its seqnos back).
pub const RUNS_KEPT: usize = 5;

/// How many producers a shard remembers and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerLimits {
    /// Most producers remembered per shard; a new one past it evicts the
    /// least recently written.
    pub max_producers: usize,
    /// A producer idle this long (log time, microseconds) is forgotten.
    pub idle_expiry_us: u64,
}

impl Default for ProducerLimits {
    fn default() -> Self {
        ProducerLimits { max_producers: 10_000, idle_expiry_us: 24 * 3600 * 1_000_000 }
    }
}

/// Why a producer append was refused. Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProducerRefusal {
    #[error("invalid producer append: {0}")]
    Invalid(String),
    #[error(
        "producer {id} epoch {epoch} is fenced: the shard has seen epoch {current} of this producer (a newer session took over)"
    )]
    Fenced { id: u64, epoch: u64, current: u64 },
    #[error(
        "producer {id} epoch {epoch} is not known to this shard (never seen, expired or evicted), so its sequence must \
         start at 1, not {sequence}; start a new epoch at sequence 1"
    )]
    Unknown { id: u64, epoch: u64, sequence: u64 },
    #[error("producer {id} epoch {epoch}: sequence {sequence} leaves a gap; the next expected is {expected}")]
    Gap { id: u64, epoch: u64, sequence: u64, expected: u64 },
    #[error(
        "producer {id} epoch {epoch}: sequences {first}..={last} were already written (the producer is at {newest}), \
         but their seqnos are no longer remembered (only the last {RUNS_KEPT} runs are); nothing was written again"
    )]
    Forgotten { id: u64, epoch: u64, first: u64, last: u64, newest: u64 },
    /// A retry that starts before the producer's next sequence and runs
    /// past it, whose written part is too old to be remembered: its answer
    /// could not say where that part is, so nothing is written and the
    /// caller sends the records from `newest + 1` on (a retry grouped
    /// differently from the first attempt; the bundled client never does).
    #[error(
        "producer {id} epoch {epoch}: sequences {first}..={newest} were already written but their seqnos are no \
         longer remembered (only the last {RUNS_KEPT} runs are), and {}..={last} were not; nothing was written: \
         send the records from sequence {}, the next expected",
        newest + 1,
        newest + 1
    )]
    ForgottenPrefix { id: u64, epoch: u64, first: u64, last: u64, newest: u64 },
}

/// What an append by a producer should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Write the records from index `skip` on (`skip` > 0 only when a
    /// prefix survived a failover; `prefix_first_seqno` is then where it
    /// was written).
    Write { skip: usize, prefix_first_seqno: Option<u64> },
    /// Every record was written before, at `[first_seqno, last_seqno]`.
    Duplicate { first_seqno: u64, last_seqno: u64 },
}

/// Records whose sequences and seqnos both follow each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    sequence: u64,
    seqno: u64,
    count: u64,
}

impl Run {
    fn seqno_of(&self, sequence: u64) -> Option<u64> {
        (sequence >= self.sequence && sequence - self.sequence < self.count)
            .then(|| self.seqno + (sequence - self.sequence))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Producer {
    epoch: u64,
    last_sequence: u64,
    last_seqno: u64,
    last_us: u64,
    runs: VecDeque<Run>,
}

impl Producer {
    fn seqno_of(&self, sequence: u64) -> Option<u64> {
        self.runs.iter().rev().find_map(|r| r.seqno_of(sequence))
    }
}

/// Counters of what the table forgot, for metrics (monotonic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForgetCounts {
    /// Producers forgotten after `idle_expiry_us`.
    pub expired: u64,
    /// Producers evicted by a new one past `max_producers`.
    pub evicted: u64,
}

/// One shard's producers, as of its record `applied_through`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProducerTable {
    producers: HashMap<u64, Producer>,
    /// The newest seqno applied.
    applied_through: u64,
    /// Timestamp of the newest stamped record applied.
    last_us: u64,
    forgot: ForgetCounts,
}

/// Why snapshot bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("producer snapshot truncated")]
    Truncated,
    #[error("producer snapshot has magic {0:?}, not WSPT")]
    Magic([u8; 4]),
    #[error("producer snapshot version {0} is not supported (1 is)")]
    Version(u8),
    #[error("producer snapshot checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
    #[error("producer snapshot is malformed: {0}")]
    Malformed(String),
}

const MAGIC: &[u8; 4] = b"WSPT";
const VERSION: u8 = 1;

impl ProducerTable {
    /// An empty table as of `seqno` (the log before it held no stamp).
    pub fn empty_at(seqno: u64) -> ProducerTable {
        ProducerTable { applied_through: seqno, ..ProducerTable::default() }
    }

    pub fn applied_through(&self) -> u64 {
        self.applied_through
    }

    /// Producers remembered (some may be expired and not swept yet).
    pub fn len(&self) -> usize {
        self.producers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.producers.is_empty()
    }

    /// Producers alive at `now_us`.
    pub fn live(&self, limits: &ProducerLimits, now_us: u64) -> usize {
        self.producers.values().filter(|p| alive(p, limits, now_us)).count()
    }

    pub fn forgot(&self) -> ForgetCounts {
        self.forgot
    }

    /// A producer's epoch, newest sequence and the seqno it was written at,
    /// if the table knows it alive at `now_us`.
    pub fn producer(&self, id: u64, limits: &ProducerLimits, now_us: u64) -> Option<(u64, u64, u64)> {
        self.producers.get(&id).filter(|p| alive(p, limits, now_us)).map(|p| (p.epoch, p.last_sequence, p.last_seqno))
    }

    /// Decides an append of `count` records by producer `id` in `epoch`
    /// from `sequence` on, at log time `now_us` (the timestamp the records
    /// would get). Changes nothing.
    pub fn check(
        &self,
        limits: &ProducerLimits,
        id: u64,
        epoch: u64,
        sequence: u64,
        count: usize,
        now_us: u64,
    ) -> Result<Decision, ProducerRefusal> {
        if id == 0 {
            return Err(ProducerRefusal::Invalid("the producer id must not be 0".into()));
        }
        if epoch == 0 {
            return Err(ProducerRefusal::Invalid("the producer epoch must not be 0".into()));
        }
        if sequence == 0 {
            return Err(ProducerRefusal::Invalid("producer sequences start at 1".into()));
        }
        if count == 0 {
            return Err(ProducerRefusal::Invalid("an append must carry at least one record".into()));
        }
        let Some(end) = sequence.checked_add(count as u64 - 1) else {
            return Err(ProducerRefusal::Invalid(format!(
                "sequence {sequence} with {count} records runs past the largest sequence {}",
                u64::MAX
            )));
        };
        let write = Decision::Write { skip: 0, prefix_first_seqno: None };
        let known = self.producers.get(&id).filter(|p| alive(p, limits, now_us));
        let Some(p) = known.filter(|p| p.epoch >= epoch) else {
            return if sequence == 1 { Ok(write) } else { Err(ProducerRefusal::Unknown { id, epoch, sequence }) };
        };
        if epoch < p.epoch {
            return Err(ProducerRefusal::Fenced { id, epoch, current: p.epoch });
        }
        let last = p.last_sequence;
        if sequence == last + 1 {
            return Ok(write);
        }
        if sequence > last + 1 {
            return Err(ProducerRefusal::Gap { id, epoch, sequence, expected: last + 1 });
        }
        if end > last {
            // Some written, the rest not: the rest is written, and the
            // answer names where the written part starts.
            let first_seqno = p.seqno_of(sequence).ok_or(ProducerRefusal::ForgottenPrefix {
                id,
                epoch,
                first: sequence,
                last: end,
                newest: last,
            })?;
            return Ok(Decision::Write { skip: (last - sequence + 1) as usize, prefix_first_seqno: Some(first_seqno) });
        }
        let forgotten = || ProducerRefusal::Forgotten { id, epoch, first: sequence, last: end, newest: last };
        let first_seqno = p.seqno_of(sequence).ok_or_else(forgotten)?;
        let last_seqno = p.seqno_of(end).ok_or_else(forgotten)?;
        Ok(Decision::Duplicate { first_seqno, last_seqno })
    }

    /// Applies the next record of the log. `frame.seqno()` must follow
    /// `applied_through`; the caller keeps that order (see `crate::wal`).
    pub fn apply(&mut self, limits: &ProducerLimits, frame: &Frame) {
        debug_assert_eq!(frame.seqno(), self.applied_through + 1, "producer table applied out of order");
        self.applied_through = frame.seqno();
        let Some(stamp) = frame.producer() else { return };
        self.apply_stamp(limits, stamp, frame.seqno(), frame.timestamp_us());
    }

    fn apply_stamp(&mut self, limits: &ProducerLimits, stamp: ProducerStamp, seqno: u64, at_us: u64) {
        self.last_us = self.last_us.max(at_us);
        let current = self.producers.get(&stamp.id).filter(|p| alive(p, limits, at_us) && p.epoch >= stamp.epoch);
        match current {
            Some(p) if p.epoch > stamp.epoch => {
                // A leader never writes for a fenced epoch; a log that holds
                // one anyway leaves the newer session as it is.
            }
            Some(_) => {
                let p = self.producers.get_mut(&stamp.id).expect("found");
                match p.runs.back_mut() {
                    Some(run) if run.sequence + run.count == stamp.sequence && run.seqno + run.count == seqno => {
                        run.count += 1;
                    }
                    _ => {
                        if p.runs.len() == RUNS_KEPT {
                            p.runs.pop_front();
                        }
                        p.runs.push_back(Run { sequence: stamp.sequence, seqno, count: 1 });
                    }
                }
                p.last_sequence = stamp.sequence;
                p.last_seqno = seqno;
                p.last_us = at_us;
            }
            None => {
                if !self.producers.contains_key(&stamp.id) && self.producers.len() >= limits.max_producers {
                    self.sweep(limits, at_us);
                    if self.producers.len() >= limits.max_producers {
                        self.evict_least_recent();
                    }
                }
                let runs = VecDeque::from([Run { sequence: stamp.sequence, seqno, count: 1 }]);
                let producer = Producer {
                    epoch: stamp.epoch,
                    last_sequence: stamp.sequence,
                    last_seqno: seqno,
                    last_us: at_us,
                    runs,
                };
                if let Some(old) = self.producers.insert(stamp.id, producer)
                    && !alive(&old, limits, at_us)
                {
                    self.forgot.expired += 1;
                }
            }
        }
    }

    /// Forgets every producer idle at `now_us` (no change to what
    /// [`ProducerTable::check`] answers: an idle producer is already
    /// treated as unknown).
    pub fn sweep(&mut self, limits: &ProducerLimits, now_us: u64) {
        let before = self.producers.len();
        self.producers.retain(|_, p| alive(p, limits, now_us));
        self.forgot.expired += (before - self.producers.len()) as u64;
    }

    fn evict_least_recent(&mut self) {
        if let Some(id) = self.producers.iter().min_by_key(|(id, p)| (p.last_seqno, **id)).map(|(id, _)| *id) {
            self.producers.remove(&id);
            self.forgot.evicted += 1;
        }
    }

    /// The table as snapshot bytes: magic, version, then the table, then a
    /// crc32 of everything before it. Producers idle at the newest record
    /// applied are left out.
    pub fn encode(&self, limits: &ProducerLimits) -> Bytes {
        let mut ids: Vec<_> =
            self.producers.iter().filter(|(_, p)| alive(p, limits, self.last_us)).map(|(id, _)| *id).collect();
        ids.sort_unstable();
        let mut buf = BytesMut::with_capacity(32 + ids.len() * (48 + RUNS_KEPT * 24));
        buf.put_slice(MAGIC);
        buf.put_u8(VERSION);
        buf.put_u64_le(self.applied_through);
        buf.put_u64_le(self.last_us);
        buf.put_u32_le(ids.len() as u32);
        for id in ids {
            let p = &self.producers[&id];
            buf.put_u64_le(id);
            buf.put_u64_le(p.epoch);
            buf.put_u64_le(p.last_sequence);
            buf.put_u64_le(p.last_seqno);
            buf.put_u64_le(p.last_us);
            buf.put_u8(p.runs.len() as u8);
            for r in &p.runs {
                buf.put_u64_le(r.sequence);
                buf.put_u64_le(r.seqno);
                buf.put_u64_le(r.count);
            }
        }
        let crc = crc32fast::hash(&buf);
        buf.put_u32_le(crc);
        buf.freeze()
    }

    /// Parses snapshot bytes; anything malformed is refused whole.
    pub fn decode(bytes: &[u8]) -> Result<ProducerTable, SnapshotError> {
        const HEADER: usize = 4 + 1 + 8 + 8 + 4;
        if bytes.len() < HEADER + 4 {
            return Err(SnapshotError::Truncated);
        }
        let magic: [u8; 4] = bytes[..4].try_into().expect("4 bytes");
        if &magic != MAGIC {
            return Err(SnapshotError::Magic(magic));
        }
        if bytes[4] != VERSION {
            return Err(SnapshotError::Version(bytes[4]));
        }
        let (body, tail) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes(tail.try_into().expect("4 bytes"));
        let computed = crc32fast::hash(body);
        if stored != computed {
            return Err(SnapshotError::Checksum { stored, computed });
        }
        let mut b = &body[5..];
        let applied_through = b.get_u64_le();
        let last_us = b.get_u64_le();
        let count = b.get_u32_le() as usize;
        // Each producer takes at least 41 bytes: refuse a count the bytes
        // cannot hold before reserving for it.
        if count > b.remaining() / 41 {
            return Err(SnapshotError::Malformed(format!("{count} producers in {} bytes", b.remaining())));
        }
        let mut producers = HashMap::with_capacity(count);
        for _ in 0..count {
            if b.remaining() < 41 {
                return Err(SnapshotError::Truncated);
            }
            let id = b.get_u64_le();
            let epoch = b.get_u64_le();
            let last_sequence = b.get_u64_le();
            let last_seqno = b.get_u64_le();
            let p_last_us = b.get_u64_le();
            let runs_len = b.get_u8() as usize;
            if runs_len == 0 || runs_len > RUNS_KEPT {
                return Err(SnapshotError::Malformed(format!("producer {id} has {runs_len} runs (1..={RUNS_KEPT})")));
            }
            if b.remaining() < runs_len * 24 {
                return Err(SnapshotError::Truncated);
            }
            let mut runs = VecDeque::with_capacity(runs_len);
            for _ in 0..runs_len {
                let run = Run { sequence: b.get_u64_le(), seqno: b.get_u64_le(), count: b.get_u64_le() };
                if run.count == 0
                    || run.seqno == 0
                    || run.seqno.checked_add(run.count - 1).is_none_or(|e| e > applied_through)
                {
                    return Err(SnapshotError::Malformed(format!(
                        "producer {id} has a run past seqno {applied_through}"
                    )));
                }
                runs.push_back(run);
            }
            if id == 0 || epoch == 0 || producers.contains_key(&id) {
                return Err(SnapshotError::Malformed(format!("producer id {id} epoch {epoch} (zero or repeated)")));
            }
            producers.insert(id, Producer { epoch, last_sequence, last_seqno, last_us: p_last_us, runs });
        }
        if b.has_remaining() {
            return Err(SnapshotError::Malformed(format!("{} trailing bytes", b.remaining())));
        }
        Ok(ProducerTable { producers, applied_through, last_us, forgot: ForgetCounts::default() })
    }
}

fn alive(p: &Producer, limits: &ProducerLimits, now_us: u64) -> bool {
    now_us.saturating_sub(p.last_us) <= limits.idle_expiry_us
}

#[cfg(test)]
#[path = "producers_test.rs"]
mod tests;
