//! The archive: sealed runs of committed records kept in an object store as
//! the durable copy of each shard.
//!
//! # Layout
//!
//! ```text
//! {prefix}/shards/{shard}/segments/{first:020}-{last:020}-e{epoch}.wseg
//! {prefix}/shards/{shard}/manifest.json
//! ```
//!
//! A segment object is a `walship_wal::Segment` encoding (the same bytes
//! replication ships: a checksummed header, then the records' frames, each
//! with its crc32) of the committed records `first..=last`; `epoch` is the
//! epoch of its last record. Seqnos are zero-padded so keys sort by seqno.
//!
//! # What the archive holds
//!
//! The listing is the truth: the archived records of a shard are the
//! longest run of segments that chain without a gap from the lowest
//! archived seqno ([`chain`]). Only committed records are archived, and a
//! committed record is the same on every replica whatever the leader, so two
//! leaders racing across a failover can only write segments that agree
//! where they overlap; a reader takes each seqno once (the chain skips what
//! an earlier segment already covered). `manifest.json` is a summary the
//! archiver rewrites after each upload (archived seqno, segment count) for
//! people and tools; nothing depends on it being current.

pub mod restore;

use serde::{Deserialize, Serialize};
use walship_objstore::{ObjectKey, StoreError};

/// Where a shard's objects are.
#[derive(Debug, Clone)]
pub struct ArchiveLayout {
    prefix: Option<ObjectKey>,
}

impl ArchiveLayout {
    /// `prefix`: the key prefix every object of this cluster goes under
    /// (validated as a key), or none.
    pub fn new(prefix: Option<&str>) -> Result<ArchiveLayout, StoreError> {
        let prefix = match prefix.map(|p| p.trim_matches('/')) {
            None | Some("") => None,
            Some(p) => Some(ObjectKey::new(p)?),
        };
        Ok(ArchiveLayout { prefix })
    }

    fn under(&self, rest: String) -> ObjectKey {
        let key = match &self.prefix {
            Some(p) => format!("{p}/{rest}"),
            None => rest,
        };
        ObjectKey::new(key).expect("built from validated parts and digits")
    }

    /// The listing prefix of a shard's segments (ends with `/`).
    pub fn segments_prefix(&self, shard: u32) -> String {
        format!("{}/", self.under(format!("shards/{shard}/segments")))
    }

    pub fn segment_key(&self, shard: u32, first: u64, last: u64, epoch: u64) -> ObjectKey {
        self.under(format!("shards/{shard}/segments/{first:020}-{last:020}-e{epoch}.wseg"))
    }

    pub fn manifest_key(&self, shard: u32) -> ObjectKey {
        self.under(format!("shards/{shard}/manifest.json"))
    }
}

/// One archived segment, as its key names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SegmentRef {
    pub first: u64,
    pub last: u64,
    pub epoch: u64,
    pub key: String,
    pub size: u64,
}

impl SegmentRef {
    /// Parses a listed key; `None` for anything that is not a segment name
    /// (stray or temporary objects are ignored, not trusted).
    pub fn parse(key: &str, size: u64) -> Option<SegmentRef> {
        let name = key.rsplit('/').next()?.strip_suffix(".wseg")?;
        let mut parts = name.splitn(3, '-');
        let first: u64 = parts.next()?.parse().ok()?;
        let last: u64 = parts.next()?.parse().ok()?;
        let epoch: u64 = parts.next()?.strip_prefix('e')?.parse().ok()?;
        (first >= 1 && first <= last).then(|| SegmentRef { first, last, epoch, key: key.to_string(), size })
    }
}

/// The run of segments a reader uses: from the lowest archived seqno,
/// each next segment the one that reaches furthest among those starting
/// at or before the seqno after the run's end. Answers the run and its
/// last seqno (0: nothing archived). Segments past a gap are left out.
pub fn chain(mut segments: Vec<SegmentRef>) -> (Vec<SegmentRef>, u64) {
    segments.sort_by_key(|s| (s.first, std::cmp::Reverse(s.last)));
    let Some(start) = segments.first() else { return (Vec::new(), 0) };
    let (mut run, mut end, mut i) = (vec![start.clone()], start.last, 1);
    loop {
        // Every segment starting within reach of the run; none of them
        // reaches further than the one picked (so none is needed later).
        let mut best: Option<usize> = None;
        while i < segments.len() && segments[i].first <= end.saturating_add(1) {
            if segments[i].last > end && best.is_none_or(|b| segments[i].last > segments[b].last) {
                best = Some(i);
            }
            i += 1;
        }
        let Some(b) = best else { return (run, end) };
        end = segments[b].last;
        run.push(segments[b].clone());
    }
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub shard: u32,
    pub first_seqno: u64,
    pub archived_seqno: u64,
    pub segments: usize,
    pub bytes: u64,
    /// The node that wrote it and when (unix ms).
    pub written_by: u32,
    pub written_unix_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(first: u64, last: u64) -> SegmentRef {
        SegmentRef { first, last, epoch: 1, key: format!("{first}-{last}"), size: 1 }
    }

    fn ranges(run: &[SegmentRef]) -> Vec<(u64, u64)> {
        run.iter().map(|s| (s.first, s.last)).collect()
    }

    #[test]
    fn keys_sort_by_seqno_and_parse_back() {
        let layout = ArchiveLayout::new(Some("/prod/eu/")).unwrap();
        let key = layout.segment_key(3, 1, 4096, 7);
        assert_eq!(key.as_str(), "prod/eu/shards/3/segments/00000000000000000001-00000000000000004096-e7.wseg");
        assert!(key.as_str().starts_with(&layout.segments_prefix(3)));
        assert_eq!(
            SegmentRef::parse(key.as_str(), 10),
            Some(SegmentRef { first: 1, last: 4096, epoch: 7, key: key.to_string(), size: 10 })
        );
        assert!(layout.segment_key(3, 9, 10, 1) < layout.segment_key(3, 10, 11, 1));
        assert_eq!(ArchiveLayout::new(None).unwrap().manifest_key(2).as_str(), "shards/2/manifest.json");
        for bad in ["x.wseg", "1-2.wseg", "2-1-e1.wseg", "0-1-e1.wseg", "1-2-1.wseg", "1-2-e1.tmp", "a-2-e1.wseg"] {
            assert_eq!(SegmentRef::parse(bad, 1), None, "{bad}");
        }
        assert!(ArchiveLayout::new(Some("../up")).is_err());
        assert!(ArchiveLayout::new(Some("a//b")).is_err());
    }

    #[test]
    fn the_chain_runs_from_the_lowest_seqno_to_the_first_gap() {
        assert_eq!(chain(vec![]).1, 0);
        let (run, end) = chain(vec![seg(11, 20), seg(1, 10), seg(21, 30)]);
        assert_eq!((ranges(&run), end), (vec![(1, 10), (11, 20), (21, 30)], 30));
        let (run, end) = chain(vec![seg(1, 10), seg(12, 20)]);
        assert_eq!((ranges(&run), end), (vec![(1, 10)], 10), "stops at the gap");
        // Two leaders across a failover: overlapping segments; the run
        // takes the one reaching furthest, and each seqno once.
        let (run, end) = chain(vec![seg(1, 10), seg(5, 15), seg(11, 12), seg(16, 30), seg(13, 20)]);
        assert_eq!((ranges(&run), end), (vec![(1, 10), (5, 15), (16, 30)], 30));
        // Duplicates of one segment count once.
        let (run, end) = chain(vec![seg(1, 10), seg(1, 10), seg(11, 11)]);
        assert_eq!((ranges(&run), end), (vec![(1, 10), (11, 11)], 11));
        // An archive that starts later (the shard's log started later).
        let (run, end) = chain(vec![seg(100, 200), seg(201, 300)]);
        assert_eq!((ranges(&run), end), (vec![(100, 200), (201, 300)], 300));
        // A segment covered by another adds nothing.
        let (run, end) = chain(vec![seg(1, 30), seg(5, 10)]);
        assert_eq!((ranges(&run), end), (vec![(1, 30)], 30));
    }
}
