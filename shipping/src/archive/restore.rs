//! Reading a shard back from the archive alone: `walship restore` and
//! `walship archive ls|verify`.
//!
//! Every segment is decoded with all its checks (header checksum, every
//! record's crc32, contiguous seqnos) and checked against its key (shard
//! and range); a segment that fails is named, never half used.

use walship_objstore::{ObjectStore, StoreError};
use walship_wal::{Frame, Segment};

use super::{ArchiveLayout, SegmentRef, chain};

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("archived segment {key} is damaged: {detail}")]
    Damaged { key: String, detail: String },
    #[error("{0}")]
    Sink(String),
}

/// What the archive holds of a shard.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Listing {
    /// The run a reader uses, in seqno order.
    pub chain: Vec<SegmentRef>,
    /// Its last seqno (0: empty).
    pub archived_seqno: u64,
    /// Segment objects outside the run (past a gap, or covered by others).
    pub unused: Vec<SegmentRef>,
}

/// Lists a shard's segments.
pub async fn list(store: &dyn ObjectStore, layout: &ArchiveLayout, shard: u32) -> Result<Listing, StoreError> {
    let listed = store.list(&layout.segments_prefix(shard)).await?;
    let all: Vec<SegmentRef> = listed.iter().filter_map(|m| SegmentRef::parse(m.key.as_str(), m.size)).collect();
    let (chain, archived_seqno) = chain(all.clone());
    let unused = all.into_iter().filter(|s| !chain.contains(s)).collect();
    Ok(Listing { chain, archived_seqno, unused })
}

/// Reads one listed segment of `shard` and checks it whole: its checksum
/// in the store, its header and every record's crc32, contiguous seqnos,
/// and the shard and range its name says. A segment that fails any check
/// (or is gone) is [`RestoreError::Damaged`]; a store that cannot answer is
/// [`RestoreError::Store`].
pub async fn fetch_segment(store: &dyn ObjectStore, shard: u32, segment: &SegmentRef) -> Result<Segment, RestoreError> {
    let key = walship_objstore::ObjectKey::new(segment.key.clone())?;
    let damaged = |detail: String| RestoreError::Damaged { key: segment.key.clone(), detail };
    let bytes = match store.get(&key).await {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return Err(damaged("listed but gone".into())),
        Err(StoreError::Corrupt { detail, .. }) => return Err(damaged(format!("fails its checksum: {detail}"))),
        Err(e) => return Err(e.into()),
    };
    let decoded = Segment::decode(bytes).map_err(|e| damaged(e.to_string()))?;
    if decoded.shard_id() != shard || decoded.first_seqno() != segment.first || decoded.last_seqno() != segment.last {
        return Err(damaged(format!(
            "holds shard {} seqnos {}..={}, its name says shard {shard} {}..={}",
            decoded.shard_id(),
            decoded.first_seqno(),
            decoded.last_seqno(),
            segment.first,
            segment.last
        )));
    }
    Ok(decoded)
}

/// Where to stop reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// Everything archived.
    End,
    /// Through this seqno.
    Seqno(u64),
    /// Records appended at or before this time (µs since the Unix epoch).
    TimeUs(u64),
}

/// What a read back covered.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReadBack {
    pub segments: usize,
    /// Records handed to the sink (each one's crc checked).
    pub records: u64,
    pub first_seqno: u64,
    pub last_seqno: u64,
    pub bytes: u64,
    /// Seqnos the archive lacks between the run read and later segments
    /// (one deleted or never uploaded): a reader stops at the gap, so what
    /// it read is not the whole archive. None without one.
    pub gap: Option<(u64, u64)>,
}

/// Reads the shard's archived records in seqno order, each once, through
/// `until`, handing them to `sink` a segment at a time.
pub async fn read_back(
    store: &dyn ObjectStore,
    layout: &ArchiveLayout,
    shard: u32,
    until: Until,
    mut sink: impl FnMut(Vec<Frame>) -> Result<(), String>,
) -> Result<ReadBack, RestoreError> {
    let listing = list(store, layout, shard).await?;
    let past_the_run = listing.unused.iter().map(|s| s.first).filter(|&f| f > listing.archived_seqno + 1).min();
    let mut done =
        ReadBack { gap: past_the_run.map(|next| (listing.archived_seqno + 1, next - 1)), ..Default::default() };
    let mut next = 0u64; // the seqno after the last one handed over
    for segment in &listing.chain {
        if let Until::Seqno(to) = until
            && segment.first > to
        {
            break;
        }
        let decoded = fetch_segment(store, shard, segment).await?;
        done.bytes += decoded.encoded().len() as u64;
        let mut stop = false;
        let frames: Vec<Frame> = decoded
            .into_frames()
            .into_iter()
            .filter(|f| f.seqno() >= next)
            .take_while(|f| {
                let keep = match until {
                    Until::End => true,
                    Until::Seqno(to) => f.seqno() <= to,
                    Until::TimeUs(t) => f.timestamp_us() <= t,
                };
                stop |= !keep;
                keep
            })
            .collect();
        done.segments += 1;
        if let (Some(first), Some(last)) = (frames.first(), frames.last()) {
            if done.records == 0 {
                done.first_seqno = first.seqno();
            }
            done.last_seqno = last.seqno();
            done.records += frames.len() as u64;
            next = last.seqno() + 1;
            sink(frames).map_err(RestoreError::Sink)?;
        }
        if stop {
            break;
        }
    }
    Ok(done)
}
