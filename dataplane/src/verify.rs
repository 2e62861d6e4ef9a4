//! Replica checksums: how the coordinator finds the first seqno at which the
//! replicas of a shard hold different records.
//!
//! # Protocol
//!
//! 1. The coordinator asks every replica for the [`ChunkSum`]s of the same
//!    seqno range with the same `chunk_records` (say 4096).
//! 2. Each worker reads the range page by page (`Wal::read`) and feeds the
//!    frames to a [`Summer`], which never holds more than one chunk's state.
//! 3. [`first_divergence`] compares the lists: all equal, or the first chunk
//!    where they differ and who differs from the majority.
//! 4. The coordinator re-runs step 1 on that chunk's `[first, last]` with
//!    `chunk_records = 1`: every chunk is then one record, and
//!    [`first_divergence`] names the exact first divergent seqno
//!    ([`Divergence::exact_seqno`]).
//!
//! # Chunks
//!
//! Chunk boundaries are aligned to seqno multiples of `chunk_records`: the
//! chunk of seqno `s` is `s / chunk_records`. Replicas therefore cut their
//! records at the same seqnos whatever page sizes they read with and
//! wherever their logs start. A [`ChunkSum`] says which records it saw
//! (`first` and `last` seqno, `records` count) and a digest over them; a
//! chunk that would hold no record is not emitted.
//!
//! # Digest
//!
//! xxHash64 (seed 0, the `twox-hash` crate) over every record's full frame
//! bytes in seqno order: length, crc32, seqno, epoch, timestamp, key and
//! payload, exactly as stored. Frames are length-prefixed, so the
//! concatenation is unambiguous. This finds accidental divergence (a lost or
//! re-written record, a different epoch after a bad failover, a bit flip that
//! slipped past the crc32): a 64-bit digest with xxHash64's dispersion
//! collides for two different chunks with probability about 2^-64, and the
//! per-frame crc32 is hashed too. It is not a security hash: a replica that
//! forges records to collide on purpose is outside what it detects (the
//! cluster's peers are authenticated). xxHash64 runs at memory speed, so
//! summing a range costs about as much as reading it.
//!
//! # Wire encoding
//!
//! [`ChunkSum`] derives serde; for the task stream, [`encode_chunk_sums`]
//! writes the sums as an Arrow IPC stream (like every task's output), one
//! row per chunk, columns `first`, `last`, `records` and `digest`, all
//! non-null `UInt64` ([`sums_schema`]); [`decode_chunk_sums`] refuses a
//! payload that is not such a stream (any other schema, truncated,
//! trailing bytes, nulls) and any list [`first_divergence`] would refuse.

use std::collections::BTreeSet;
use std::hash::Hasher;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use twox_hash::XxHash64;
use walship_wal::Frame;

/// A node's id, as in the cluster config.
pub type NodeId = u32;

/// The Arrow schema of chunk sums on the wire.
pub fn sums_schema() -> arrow_schema::SchemaRef {
    use arrow_schema::{DataType, Field, Schema};
    let column = |name| Field::new(name, DataType::UInt64, false);
    std::sync::Arc::new(Schema::new(vec![column("first"), column("last"), column("records"), column("digest")]))
}

/// The digest of one chunk of a replica's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkSum {
    /// Seqno of the first record in the chunk.
    pub first: u64,
    /// Seqno of the last record in the chunk.
    pub last: u64,
    /// How many records the chunk holds (at least 1).
    pub records: u64,
    /// xxHash64 over the records' frame bytes, in order.
    pub digest: u64,
}

/// Why a request to sum, or a replica's sums, were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("chunk_records must be at least 1")]
    ZeroChunk,
    #[error("records out of order: seqno {seqno} after {previous}")]
    OutOfOrder { previous: u64, seqno: u64 },
    #[error("no replicas to compare")]
    NoReplicas,
    #[error("node {0} appears more than once")]
    DuplicateNode(NodeId),
    #[error("node {node}: chunk {index} is malformed: {reason}")]
    BadChunk { node: NodeId, index: usize, reason: String },
    #[error("chunk {index} is malformed: {reason}")]
    Malformed { index: usize, reason: String },
    #[error("chunk sums: {0}")]
    BadPayload(String),
}

/// Sums records into [`ChunkSum`]s one frame at a time, so a worker can sum
/// a large range page by page. Frames must come in strictly increasing
/// seqno order.
#[derive(Debug)]
pub struct Summer {
    chunk_records: u64,
    current: Option<Open>,
    done: Vec<ChunkSum>,
}

#[derive(Debug)]
struct Open {
    chunk: u64,
    first: u64,
    last: u64,
    records: u64,
    hasher: XxHash64,
}

impl Summer {
    pub fn new(chunk_records: u64) -> Result<Summer, VerifyError> {
        if chunk_records == 0 {
            return Err(VerifyError::ZeroChunk);
        }
        Ok(Summer { chunk_records, current: None, done: Vec::new() })
    }

    /// Adds the next record. A seqno not above the previous one is refused
    /// and changes nothing.
    pub fn push(&mut self, frame: &Frame) -> Result<(), VerifyError> {
        let seqno = frame.seqno();
        let chunk = seqno / self.chunk_records;
        match &mut self.current {
            Some(open) if seqno <= open.last => {
                return Err(VerifyError::OutOfOrder { previous: open.last, seqno });
            }
            Some(open) if open.chunk == chunk => {
                open.last = seqno;
                open.records += 1;
                open.hasher.write(frame.as_bytes());
                return Ok(());
            }
            _ => {}
        }
        self.close();
        let mut hasher = XxHash64::with_seed(0);
        hasher.write(frame.as_bytes());
        self.current = Some(Open { chunk, first: seqno, last: seqno, records: 1, hasher });
        Ok(())
    }

    /// Adds records in order; stops at the first refused one.
    pub fn extend<'a>(&mut self, frames: impl IntoIterator<Item = &'a Frame>) -> Result<(), VerifyError> {
        frames.into_iter().try_for_each(|f| self.push(f))
    }

    fn close(&mut self) {
        if let Some(open) = self.current.take() {
            self.done.push(ChunkSum {
                first: open.first,
                last: open.last,
                records: open.records,
                digest: open.hasher.finish(),
            });
        }
    }

    /// Chunks already complete (a later record can no longer fall in them):
    /// a worker may ship these while it goes on reading.
    pub fn take_complete(&mut self) -> Vec<ChunkSum> {
        std::mem::take(&mut self.done)
    }

    /// Closes the last chunk and returns every chunk not yet taken.
    pub fn finish(mut self) -> Vec<ChunkSum> {
        self.close();
        self.done
    }
}

/// The chunk sums of `frames` (in strictly increasing seqno order).
pub fn chunk_sums<'a>(
    frames: impl IntoIterator<Item = &'a Frame>,
    chunk_records: u64,
) -> Result<Vec<ChunkSum>, VerifyError> {
    let mut summer = Summer::new(chunk_records)?;
    summer.extend(frames)?;
    Ok(summer.finish())
}

/// Encodes sums for the wire: an Arrow IPC stream of [`sums_schema`].
pub fn encode_chunk_sums(sums: &[ChunkSum]) -> Vec<u8> {
    use arrow_array::{ArrayRef, RecordBatch, UInt64Array};
    let column = |f: fn(&ChunkSum) -> u64| Arc::new(UInt64Array::from_iter_values(sums.iter().map(f))) as ArrayRef;
    let columns = vec![column(|s| s.first), column(|s| s.last), column(|s| s.records), column(|s| s.digest)];
    let batch = RecordBatch::try_new(sums_schema(), columns).expect("four u64 columns of one length");
    let mut out = Vec::with_capacity(sums.len() * 32 + 512);
    let mut writer = arrow_ipc::writer::StreamWriter::try_new(&mut out, &sums_schema()).expect("in memory");
    writer.write(&batch).expect("in memory");
    writer.finish().expect("in memory");
    drop(writer);
    out
}

/// Decodes [`encode_chunk_sums`]' bytes, refusing what is not an Arrow IPC
/// stream of [`sums_schema`] and a list that is not well formed (see
/// [`first_divergence`]).
pub fn decode_chunk_sums(bytes: &[u8]) -> Result<Vec<ChunkSum>, VerifyError> {
    use arrow_array::{Array, UInt64Array};
    let batches = crate::arrow_export::decode_ipc_stream_of(bytes, &sums_schema())
        .map_err(|e| VerifyError::BadPayload(e.to_string()))?;
    let mut sums = Vec::new();
    for batch in &batches {
        let column = |i: usize| -> Result<&UInt64Array, VerifyError> {
            let array = batch.column(i).as_any().downcast_ref::<UInt64Array>().expect("the schema was checked");
            if array.null_count() > 0 {
                return Err(VerifyError::BadPayload(format!("nulls in column {}", sums_schema().field(i).name())));
            }
            Ok(array)
        };
        let (first, last, records, digest) = (column(0)?, column(1)?, column(2)?, column(3)?);
        for row in 0..batch.num_rows() {
            sums.push(ChunkSum {
                first: first.value(row),
                last: last.value(row),
                records: records.value(row),
                digest: digest.value(row),
            });
        }
    }
    check_list(&sums).map_err(|(index, reason)| VerifyError::Malformed { index, reason })?;
    Ok(sums)
}

/// Refuses a list that no [`Summer`] makes: `first > last`, zero records or
/// more than the span holds, chunks not in increasing, disjoint order.
fn check_list(sums: &[ChunkSum]) -> Result<(), (usize, String)> {
    let bad = |index: usize, reason: String| Err((index, reason));
    for (i, s) in sums.iter().enumerate() {
        if s.first > s.last {
            return bad(i, format!("first {} > last {}", s.first, s.last));
        }
        if s.records == 0 || s.records - 1 > s.last - s.first {
            return bad(i, format!("{} records in seqnos {}..={}", s.records, s.first, s.last));
        }
        if i > 0 && s.first <= sums[i - 1].last {
            return bad(i, format!("starts at {}, not after the previous chunk's {}", s.first, sums[i - 1].last));
        }
    }
    Ok(())
}

/// What [`first_divergence`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No replica holds any record.
    Empty,
    /// Every replica holds the same `records` records, from seqno `first` to
    /// `last`.
    AllEqual { first: u64, last: u64, records: u64 },
    /// The replicas first disagree in `[first, last]`.
    Diverged(Divergence),
}

/// The first place the replicas disagree.
///
/// The first seqno at which any two replicas differ lies in `first..=last`;
/// when `first == last` (always so with 1-record chunks) it is exactly that
/// seqno. Before `first`, every replica holds identical records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    pub first: u64,
    pub last: u64,
    /// The replicas grouped by what they hold there: the replicas of a group
    /// agree with each other and with no other group. Largest group first,
    /// then by lowest node id; node ids ascending within a group.
    pub groups: Vec<Group>,
    /// Index in `groups` of the group that more than half of all replicas
    /// are in; `None` is a tie (no strict majority: two replicas that
    /// disagree, three that all differ, two against two, ...).
    pub majority: Option<usize>,
}

/// Replicas that hold the same thing at a divergence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub nodes: Vec<NodeId>,
    pub holds: Holding,
}

/// What a group of replicas holds at a divergence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holding {
    /// This chunk (records whose digest, span or count differs from the
    /// other groups').
    Chunk(ChunkSum),
    /// No record at the divergence's `first` seqno, while another group
    /// holds one: the replica is missing records from `first` on (its log
    /// is shorter, ends earlier or starts later) — or, when this group is
    /// the majority, the other groups hold records it does not.
    Missing,
}

impl Divergence {
    /// The exact first divergent seqno, once the chunk is a single seqno.
    pub fn exact_seqno(&self) -> Option<u64> {
        (self.first == self.last).then_some(self.first)
    }

    /// The nodes of the strict majority, if there is one.
    pub fn majority_nodes(&self) -> Option<&[NodeId]> {
        self.majority.map(|i| self.groups[i].nodes.as_slice())
    }

    /// Whether no group is a strict majority.
    pub fn is_tie(&self) -> bool {
        self.majority.is_none()
    }

    /// The nodes that disagree with the majority (every node on a tie),
    /// ascending.
    pub fn dissenters(&self) -> Vec<NodeId> {
        let mut nodes: Vec<NodeId> = self
            .groups
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != self.majority)
            .flat_map(|(_, g)| g.nodes.iter().copied())
            .collect();
        nodes.sort_unstable();
        nodes
    }

    /// The nodes holding no record at `first` (missing records from
    /// `first` on), ascending.
    pub fn missing(&self) -> Vec<NodeId> {
        let mut nodes: Vec<NodeId> =
            self.groups.iter().filter(|g| g.holds == Holding::Missing).flat_map(|g| g.nodes.iter().copied()).collect();
        nodes.sort_unstable();
        nodes
    }
}

/// Compares the replicas' chunk sums (all computed over the same range with
/// the same `chunk_records`) and returns where they first disagree.
///
/// Walks the lists in seqno order. At each step it looks at every replica's
/// next chunk: the lowest `first` among them is the next seqno `lo` some
/// replica holds. If every replica's next chunk is identical, all agree up
/// to its `last` and the walk goes on. Otherwise this is the first
/// divergence: a replica whose next chunk starts after `lo` (or that has no
/// more chunks) is [`Holding::Missing`], the others are grouped by their
/// chunk, and the divergence spans `lo` to the highest `last` of the chunks
/// starting at `lo` — the first seqno where any two of them differ lies
/// there.
///
/// Refuses (never panics on) no replicas, a node listed twice and a list no
/// [`Summer`] makes.
pub fn first_divergence(replicas: &[(NodeId, Vec<ChunkSum>)]) -> Result<Verdict, VerifyError> {
    if replicas.is_empty() {
        return Err(VerifyError::NoReplicas);
    }
    let mut seen = BTreeSet::new();
    for (node, sums) in replicas {
        if !seen.insert(*node) {
            return Err(VerifyError::DuplicateNode(*node));
        }
        check_list(sums).map_err(|(index, reason)| VerifyError::BadChunk { node: *node, index, reason })?;
    }
    let mut at = vec![0usize; replicas.len()];
    let mut covered: Option<(u64, u64)> = None;
    let mut records = 0u64;
    loop {
        let heads: Vec<Option<&ChunkSum>> = replicas.iter().zip(&at).map(|((_, sums), &i)| sums.get(i)).collect();
        let Some(lo) = heads.iter().flatten().map(|c| c.first).min() else {
            return Ok(match covered {
                None => Verdict::Empty,
                Some((first, last)) => Verdict::AllEqual { first, last, records },
            });
        };
        let reference = heads[0];
        if heads.iter().all(|h| *h == reference) {
            let chunk = reference.expect("lo exists, so some head, so all heads");
            covered = Some((covered.map_or(chunk.first, |(f, _)| f), chunk.last));
            records += chunk.records;
            at.iter_mut().for_each(|i| *i += 1);
            continue;
        }
        return Ok(Verdict::Diverged(divergence(replicas, &heads, lo)));
    }
}

fn divergence(replicas: &[(NodeId, Vec<ChunkSum>)], heads: &[Option<&ChunkSum>], lo: u64) -> Divergence {
    let mut groups: Vec<Group> = Vec::new();
    let mut last = lo;
    for ((node, _), head) in replicas.iter().zip(heads) {
        let holds = match head {
            Some(c) if c.first == lo => {
                last = last.max(c.last);
                Holding::Chunk(**c)
            }
            _ => Holding::Missing,
        };
        match groups.iter_mut().find(|g| g.holds == holds) {
            Some(g) => g.nodes.push(*node),
            None => groups.push(Group { nodes: vec![*node], holds }),
        }
    }
    for g in &mut groups {
        g.nodes.sort_unstable();
    }
    groups.sort_by(|a, b| b.nodes.len().cmp(&a.nodes.len()).then(a.nodes[0].cmp(&b.nodes[0])));
    let majority = (groups[0].nodes.len() * 2 > replicas.len()).then_some(0);
    Divergence { first: lo, last, groups, majority }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use walship_wal::RecordFields;

    fn record(seqno: u64, epoch: u64, payload: &[u8]) -> Frame {
        Frame::encode(RecordFields {
            seqno,
            epoch,
            timestamp_us: 1_700_000_000_000_000 + seqno,
            key: format!("key-{}", seqno % 7).as_bytes(),
            payload,
        })
    }

    /// Records `first..=last` of a healthy replica.
    fn log(first: u64, last: u64) -> Vec<Frame> {
        (first..=last).map(|s| record(s, 1, format!("payload {s}\0with a zero").as_bytes())).collect()
    }

    /// `frames` with one payload byte of record `seqno` flipped (a valid
    /// frame: its crc32 is recomputed, as a replica that wrote other bytes
    /// would have it).
    fn flipped(frames: &[Frame], seqno: u64) -> Vec<Frame> {
        frames
            .iter()
            .map(|f| {
                if f.seqno() != seqno {
                    return f.clone();
                }
                let mut payload = f.payload().to_vec();
                payload[0] ^= 0x01;
                Frame::encode(RecordFields {
                    seqno,
                    epoch: f.epoch(),
                    timestamp_us: f.timestamp_us(),
                    key: &f.key(),
                    payload: &payload,
                })
            })
            .collect()
    }

    fn sums(frames: &[Frame], chunk: u64) -> Vec<ChunkSum> {
        chunk_sums(frames, chunk).unwrap()
    }

    fn verdict(replicas: &[(NodeId, &[Frame])], chunk: u64) -> Verdict {
        let lists: Vec<(NodeId, Vec<ChunkSum>)> = replicas.iter().map(|(n, f)| (*n, sums(f, chunk))).collect();
        first_divergence(&lists).unwrap()
    }

    fn diverged(v: Verdict) -> Divergence {
        match v {
            Verdict::Diverged(d) => d,
            other => panic!("expected a divergence, got {other:?}"),
        }
    }

    /// The coordinator's second pass: the records of `[d.first, d.last]`
    /// summed one per chunk.
    fn refine(replicas: &[(NodeId, &[Frame])], d: &Divergence) -> Divergence {
        let within: Vec<(NodeId, Vec<Frame>)> = replicas
            .iter()
            .map(|(n, f)| (*n, f.iter().filter(|r| (d.first..=d.last).contains(&r.seqno())).cloned().collect()))
            .collect();
        let borrowed: Vec<(NodeId, &[Frame])> = within.iter().map(|(n, f)| (*n, f.as_slice())).collect();
        diverged(verdict(&borrowed, 1))
    }

    #[test]
    fn equal_replicas_are_all_equal() {
        let a = log(1, 1000);
        let replicas: [(NodeId, &[Frame]); 3] = [(1, &a), (2, &a), (3, &a)];
        for chunk in [1, 7, 100, 4096, u64::MAX] {
            assert_eq!(
                verdict(&replicas, chunk),
                Verdict::AllEqual { first: 1, last: 1000, records: 1000 },
                "chunk {chunk}"
            );
        }
    }

    #[test]
    fn chunks_are_aligned_to_seqno_multiples() {
        let s = sums(&log(5, 250), 100);
        let spans: Vec<_> = s.iter().map(|c| (c.first, c.last, c.records)).collect();
        assert_eq!(spans, vec![(5, 99, 95), (100, 199, 100), (200, 250, 51)]);
        let one = sums(&log(5, 7), 1);
        assert_eq!(
            one.iter().map(|c| (c.first, c.last, c.records)).collect::<Vec<_>>(),
            [(5, 5, 1), (6, 6, 1), (7, 7, 1)]
        );
    }

    #[test]
    fn flipped_byte_is_found_by_chunk_then_exactly() {
        let good = log(1, 1000);
        let bad = flipped(&good, 537);
        let replicas: [(NodeId, &[Frame]); 3] = [(1, &good), (2, &bad), (3, &good)];
        let coarse = diverged(verdict(&replicas, 100));
        assert_eq!((coarse.first, coarse.last), (500, 599));
        assert_eq!(coarse.exact_seqno(), None);
        assert_eq!(coarse.majority_nodes(), Some(&[1, 3][..]));
        assert_eq!(coarse.dissenters(), vec![2]);
        assert!(coarse.missing().is_empty());
        assert!(!coarse.is_tie());

        let exact = refine(&replicas, &coarse);
        assert_eq!(exact.exact_seqno(), Some(537));
        assert_eq!(exact.majority_nodes(), Some(&[1, 3][..]));
        assert_eq!(exact.dissenters(), vec![2]);
        let Holding::Chunk(c) = exact.groups[1].holds else { panic!("{exact:?}") };
        assert_eq!((c.first, c.last, c.records), (537, 537, 1));
    }

    #[test]
    fn a_different_epoch_alone_is_a_divergence() {
        let good = log(1, 50);
        let mut other = good.clone();
        other[19] = record(20, 2, &good[19].payload());
        let replicas: [(NodeId, &[Frame]); 3] = [(1, &good), (2, &good), (3, &other)];
        let d = diverged(verdict(&replicas, 1));
        assert_eq!(d.exact_seqno(), Some(20));
        assert_eq!(d.dissenters(), vec![3]);
    }

    #[test]
    fn shorter_replica_is_missing_records_from_the_exact_seqno() {
        let full = log(1, 1000);
        let short = log(1, 750);
        let replicas: [(NodeId, &[Frame]); 3] = [(1, &full), (2, &full), (3, &short)];
        let coarse = diverged(verdict(&replicas, 100));
        assert_eq!((coarse.first, coarse.last), (700, 799));
        assert_eq!(coarse.dissenters(), vec![3]);
        let exact = refine(&replicas, &coarse);
        assert_eq!(exact.exact_seqno(), Some(751));
        assert_eq!(exact.missing(), vec![3]);
        assert_eq!(exact.majority_nodes(), Some(&[1, 2][..]));
        // One chunk granularity says it at once.
        let d = diverged(verdict(&replicas, 1));
        assert_eq!((d.exact_seqno(), d.missing()), (Some(751), vec![3]));
    }

    #[test]
    fn replica_ending_on_a_chunk_boundary_is_missing_the_next_chunk() {
        let full = log(1, 1000);
        let short = log(1, 699);
        let replicas: [(NodeId, &[Frame]); 3] = [(1, &full), (2, &short), (3, &full)];
        let d = diverged(verdict(&replicas, 100));
        assert_eq!((d.first, d.last), (700, 799));
        assert_eq!(d.missing(), vec![2]);
        assert_eq!(d.groups[1].holds, Holding::Missing);
        assert_eq!(refine(&replicas, &d).exact_seqno(), Some(700));
    }

    #[test]
    fn replica_starting_later_is_missing_from_the_first_seqno() {
        let full = log(1, 300);
        let late = log(41, 300);
        let replicas: [(NodeId, &[Frame]); 3] = [(1, &full), (2, &full), (3, &late)];
        let coarse = diverged(verdict(&replicas, 100));
        assert_eq!((coarse.first, coarse.last), (1, 99));
        let exact = refine(&replicas, &coarse);
        assert_eq!((exact.exact_seqno(), exact.missing()), (Some(1), vec![3]));
    }

    #[test]
    fn a_gap_inside_a_chunk_is_found_exactly() {
        let full = log(1, 300);
        let gap: Vec<Frame> = full.iter().filter(|f| f.seqno() != 150).cloned().collect();
        let replicas: [(NodeId, &[Frame]); 3] = [(1, &gap), (2, &full), (3, &full)];
        let coarse = diverged(verdict(&replicas, 100));
        assert_eq!((coarse.first, coarse.last), (100, 199));
        let exact = refine(&replicas, &coarse);
        assert_eq!((exact.exact_seqno(), exact.missing()), (Some(150), vec![1]));
    }

    #[test]
    fn two_of_three_differing_the_same_way_are_the_majority() {
        let good = log(1, 500);
        let bad = flipped(&good, 321);
        let replicas: [(NodeId, &[Frame]); 3] = [(1, &good), (2, &bad), (3, &bad)];
        let coarse = diverged(verdict(&replicas, 64));
        assert_eq!((coarse.first, coarse.last), (320, 383));
        // The original is now the odd one out: named as the dissenter.
        assert_eq!(coarse.majority_nodes(), Some(&[2, 3][..]));
        assert_eq!(coarse.dissenters(), vec![1]);
        let exact = refine(&replicas, &coarse);
        assert_eq!(exact.exact_seqno(), Some(321));
        assert_eq!(exact.majority_nodes(), Some(&[2, 3][..]));
        assert_eq!(exact.dissenters(), vec![1]);
    }

    #[test]
    fn ties_are_named_as_such() {
        let good = log(1, 100);
        let bad = flipped(&good, 10);
        let worse = flipped(&good, 20);
        // Two replicas that disagree.
        let d = diverged(verdict(&[(1, &good), (2, &bad)], 1));
        assert!(d.is_tie());
        assert_eq!(d.majority_nodes(), None);
        assert_eq!(d.dissenters(), vec![1, 2]);
        assert_eq!(d.exact_seqno(), Some(10));
        // Three that all differ in the same chunk.
        let bad20 = flipped(&bad, 20);
        let d = diverged(verdict(&[(1, &good), (2, &bad), (3, &bad20)], 100));
        assert!(d.is_tie());
        assert_eq!(d.groups.len(), 3);
        // Two against two.
        let d = diverged(verdict(&[(4, &good), (3, &worse), (2, &good), (1, &worse)], 1));
        assert!(d.is_tie());
        assert_eq!(d.exact_seqno(), Some(20));
        assert_eq!(d.groups.iter().map(|g| g.nodes.clone()).collect::<Vec<_>>(), vec![vec![1, 3], vec![2, 4]]);
    }

    #[test]
    fn empty_ranges() {
        assert!(sums(&[], 10).is_empty());
        let none: [(NodeId, &[Frame]); 3] = [(1, &[]), (2, &[]), (3, &[])];
        assert_eq!(verdict(&none, 10), Verdict::Empty);
        assert_eq!(verdict(&none[..1], 1), Verdict::Empty);
        // One replica holds nothing of a range the others hold.
        let some = log(10, 20);
        let d = diverged(verdict(&[(1, &some), (2, &[]), (3, &some)], 1));
        assert_eq!((d.exact_seqno(), d.missing(), d.dissenters()), (Some(10), vec![2], vec![2]));
        // Only one replica holds a record: the majority holds nothing.
        let one = log(10, 10);
        let d = diverged(verdict(&[(1, &[]), (2, &[]), (3, &one)], 1));
        assert_eq!(d.exact_seqno(), Some(10));
        assert_eq!(d.majority_nodes(), Some(&[1, 2][..]));
        assert_eq!(d.groups[0].holds, Holding::Missing);
        assert_eq!(d.dissenters(), vec![3]);
    }

    #[test]
    fn a_single_replica_agrees_with_itself() {
        let a = log(1, 10);
        assert_eq!(verdict(&[(9, &a)], 3), Verdict::AllEqual { first: 1, last: 10, records: 10 });
    }

    #[test]
    fn summing_page_by_page_equals_summing_at_once() {
        let frames = log(1, 1000);
        let mut summer = Summer::new(64).unwrap();
        let mut shipped = Vec::new();
        for page in frames.chunks(37) {
            summer.extend(page).unwrap();
            // Only chunks no later record can fall into are complete.
            let complete = summer.take_complete();
            if let Some(c) = complete.last() {
                assert!(c.last < page.last().unwrap().seqno() / 64 * 64);
            }
            shipped.extend(complete);
        }
        shipped.extend(summer.finish());
        assert_eq!(shipped, sums(&frames, 64));
        assert_eq!(shipped.iter().map(|c| c.records).sum::<u64>(), 1000);
    }

    #[test]
    fn bad_input_is_refused() {
        assert_eq!(Summer::new(0).unwrap_err(), VerifyError::ZeroChunk);
        assert_eq!(chunk_sums(&log(1, 3), 0).unwrap_err(), VerifyError::ZeroChunk);
        let mut backwards = log(5, 6);
        backwards.extend(log(5, 5));
        assert_eq!(chunk_sums(&backwards, 10).unwrap_err(), VerifyError::OutOfOrder { previous: 6, seqno: 5 });
        let mut summer = Summer::new(10).unwrap();
        summer.extend(&log(1, 3)).unwrap();
        assert!(summer.push(&log(3, 3)[0]).is_err(), "a repeated seqno");
        assert_eq!(summer.finish(), sums(&log(1, 3), 10), "a refused record changes nothing");

        assert_eq!(first_divergence(&[]).unwrap_err(), VerifyError::NoReplicas);
        let s = sums(&log(1, 3), 1);
        assert_eq!(first_divergence(&[(1, s.clone()), (1, s.clone())]).unwrap_err(), VerifyError::DuplicateNode(1));
        let c = |first, last, records| ChunkSum { first, last, records, digest: 0 };
        for bad in [
            vec![c(5, 4, 1)],
            vec![c(1, 1, 0)],
            vec![c(1, 2, 3)],
            vec![c(1, 5, 5), c(5, 9, 5)],
            vec![c(6, 9, 4), c(1, 5, 5)],
            vec![c(2, u64::MAX, u64::MAX)],
        ] {
            let err = first_divergence(&[(1, s.clone()), (7, bad.clone())]).unwrap_err();
            assert!(matches!(err, VerifyError::BadChunk { node: 7, .. }), "{bad:?}: {err}");
            assert!(matches!(decode_chunk_sums(&encode_chunk_sums(&bad)), Err(VerifyError::Malformed { .. })));
        }
        // The whole seqno space in one chunk is well formed.
        assert!(first_divergence(&[(1, vec![c(0, u64::MAX, 3)])]).is_ok());
    }

    #[test]
    fn wire_encodings_round_trip() {
        let s = sums(&log(1, 500), 100);
        assert_eq!(s.len(), 6, "1..=99, 100..=199, ..., 500..=500");
        let bytes = encode_chunk_sums(&s);
        assert_eq!(decode_chunk_sums(&bytes).unwrap(), s);
        assert_eq!(decode_chunk_sums(&encode_chunk_sums(&[])).unwrap(), vec![]);
        // What is not a whole stream of the sums' schema is refused, named.
        for bad in [&[][..], &bytes[..40], &bytes[..bytes.len() - 1], b"0123456789abcdef0123456789abcdef"] {
            assert!(matches!(decode_chunk_sums(bad), Err(VerifyError::BadPayload(_))), "{} bytes", bad.len());
        }
        let mut trailing = bytes.clone();
        trailing.extend_from_slice(&bytes);
        assert!(matches!(decode_chunk_sums(&trailing), Err(VerifyError::BadPayload(_))));
        // An export stream (records, not sums) is another schema.
        let records = crate::arrow_export::ipc_stream(&log(1, 3)).unwrap();
        let err = decode_chunk_sums(&records).unwrap_err();
        assert!(err.to_string().contains("expected [first: UInt64"), "{err}");
        // Self-describing: any Arrow reader sees the columns.
        let batches = crate::arrow_export::decode_ipc_stream_of(&bytes, &sums_schema()).unwrap();
        assert_eq!(batches[0].schema().field(3).name(), "digest");
        let json = serde_json::to_string(&s[0]).unwrap();
        assert!(json.contains("\"first\":1") && json.contains("\"records\":99"), "{json}");
        assert_eq!(serde_json::from_str::<ChunkSum>(&json).unwrap(), s[0]);
    }

    proptest! {
        /// Any one divergent record in any replica is found at chunk
        /// granularity, then exactly with one-record chunks.
        #[test]
        fn any_single_divergence_is_found_exactly(
            len in 1u64..400, at in any::<prop::sample::Index>(), chunk in 1u64..80,
            who in 0usize..3, truncate in any::<bool>()) {
            let good = log(1, len);
            let k = at.index(len as usize) as u64 + 1;
            let bad = if truncate { log(1, k - 1) } else { flipped(&good, k) };
            let mut replicas: Vec<(NodeId, &[Frame])> = vec![(1, &good), (2, &good), (3, &good)];
            replicas[who].1 = &bad;
            let coarse = diverged(verdict(&replicas, chunk));
            prop_assert!(coarse.first <= k && k <= coarse.last, "{k} outside {coarse:?}");
            prop_assert_eq!(coarse.dissenters(), vec![who as NodeId + 1]);
            let exact = refine(&replicas, &coarse);
            prop_assert_eq!(exact.exact_seqno(), Some(k));
            prop_assert_eq!(exact.dissenters(), vec![who as NodeId + 1]);
            prop_assert_eq!(exact.missing().is_empty(), !truncate);
        }

        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(list) = decode_chunk_sums(&bytes) {
                let _ = first_divergence(&[(1, list.clone()), (2, list)]);
            }
        }

        #[test]
        fn random_lists_never_panic(lists in proptest::collection::vec(
            proptest::collection::vec((any::<u64>(), 0u64..4, 0u64..4, 0u64..3), 0..6), 1..4)) {
            let replicas: Vec<(NodeId, Vec<ChunkSum>)> = lists.iter().enumerate().map(|(i, l)| {
                (i as NodeId, l.iter().map(|&(first, span, records, digest)| ChunkSum {
                    first: first % 20, last: (first % 20).saturating_add(span), records, digest }).collect())
            }).collect();
            let _ = first_divergence(&replicas);
        }
    }
}
