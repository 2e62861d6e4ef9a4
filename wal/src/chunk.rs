//! The chunk directory of the raft-engine store: which stored chunk holds
//! which seqnos, and what it costs in memory.
//!
//! The store keeps one raft-engine entry per *chunk*: a run of one shard's
//! consecutive records, encoded as a [`crate::Segment`] (header with the
//! first seqno and the count, then the frames byte-identical to what was
//! shipped). Chunk entries take consecutive raft-engine indexes per shard;
//! a chunk's seqnos are not derivable from its index, so the store keeps a
//! sparse map from index to first seqno, in memory ([`Chunks`]) and durably
//! (one raft-engine key per chunk, [`key`] / [`ChunkMeta::encode`], written
//! in the same atomic batch as the entry it describes).
//!
//! Memory per chunk: raft-engine's own index entry for it, its directory
//! key, and this map's 16 bytes ([`CHUNK_INDEX_BYTES`]). A chunk holds up to
//! `chunk_bytes` of frames (64 KiB by default), so the index grows with the
//! log's bytes over that, not with its records.

use std::collections::VecDeque;

/// raft-engine keeps, per entry, its position in the log files (file id,
/// offset, length, compression, offset and length within the batch): 48
/// bytes (`memtable::ThinEntryIndex`, private to raft-engine, so counted
/// here by hand).
const ENGINE_ENTRY_BYTES: u64 = 48;
/// raft-engine keeps every key-value pair in a `BTreeMap<Vec<u8>, (Vec<u8>,
/// FileId)>`: two vector headers and a file id per slot, two heap blocks
/// (a directory key and value each round up to 32 bytes), and the B-tree's
/// unused slot space (nodes are about two thirds full).
const ENGINE_KV_BYTES: u64 = 24 + 24 + 16 + 32 + 32 + 32;
/// Bytes of memory one chunk costs the node: raft-engine's entry index, its
/// directory key in raft-engine, and [`Chunk`] in this map. An estimate from
/// the structures' sizes; `walship-memory` (ops/bench) measures the real
/// growth of the process.
pub const CHUNK_INDEX_BYTES: u64 = ENGINE_ENTRY_BYTES + ENGINE_KV_BYTES + std::mem::size_of::<Chunk>() as u64;

/// Prefix of the directory keys, followed by the chunk's raft-engine index
/// (8 bytes, big-endian, so keys sort by index).
const KEY_PREFIX: &[u8] = b"walship/c/";

/// The directory key of the chunk at raft-engine index `index`.
pub fn key(index: u64) -> Vec<u8> {
    let mut key = KEY_PREFIX.to_vec();
    key.extend_from_slice(&index.to_be_bytes());
    key
}

/// The chunk index a directory key names, if it is one.
pub fn index_of_key(key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(KEY_PREFIX)?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

/// The range of keys holding the directory (for a scan).
pub fn key_range() -> (Vec<u8>, Vec<u8>) {
    (key(0), [KEY_PREFIX, &[0xff; 9]].concat())
}

/// One chunk, as the directory keeps it in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub first_seqno: u64,
    /// Bytes of frames it holds.
    pub bytes: u32,
    /// A sealed chunk is never merged with later appends; the unsealed
    /// chunks at the end of a shard (its *tail*) are, once they add up to
    /// `chunk_bytes` or number [`MAX_TAIL_CHUNKS`].
    pub sealed: bool,
}

/// Most unsealed chunks a shard keeps before merging them into one, whatever
/// their size: bounds the index of a shard appended to one small record at
/// a time (to 128 entries, 28 KiB; a node holds this for every such shard).
/// The merged chunk stays unsealed, merged again with the next ones, until
/// it holds `chunk_bytes`: sealed chunks stay full (the index of a long log
/// stays near 0.3 % of it), and a one-record-at-a-time shard's records are
/// written about 3.6 times at 100 B (2.6 at 250 B, more for smaller ones;
/// 512 entries wrote them twice but held 112 KiB of index per shard).
pub const MAX_TAIL_CHUNKS: usize = 128;

/// A chunk's directory value: its seqno range, size and seal, 21 bytes
/// little-endian (`first_seqno`, `last_seqno`, `bytes`, `sealed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkMeta {
    pub chunk: Chunk,
    pub last_seqno: u64,
}

const META_LEN: usize = 21;

impl ChunkMeta {
    /// A *tombstone*: no records, starting at `first_seqno`. A truncation
    /// whose cut falls between chunks writes one at the first chunk it
    /// removes (raft-engine drops entries only by replacing them, and this
    /// replaces them without reading any record), and the next append
    /// overwrites it. Only ever the newest chunk.
    pub fn tombstone(first_seqno: u64) -> ChunkMeta {
        ChunkMeta { chunk: Chunk { first_seqno, bytes: 0, sealed: false }, last_seqno: first_seqno - 1 }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut value = Vec::with_capacity(META_LEN);
        value.extend_from_slice(&self.chunk.first_seqno.to_le_bytes());
        value.extend_from_slice(&self.last_seqno.to_le_bytes());
        value.extend_from_slice(&self.chunk.bytes.to_le_bytes());
        value.push(u8::from(self.chunk.sealed));
        value
    }

    pub fn decode(value: &[u8]) -> Option<ChunkMeta> {
        if value.len() != META_LEN || value[20] > 1 {
            return None;
        }
        let first_seqno = u64::from_le_bytes(value[0..8].try_into().ok()?);
        let last_seqno = u64::from_le_bytes(value[8..16].try_into().ok()?);
        let bytes = u32::from_le_bytes(value[16..20].try_into().ok()?);
        let tombstone = bytes == 0 && last_seqno.checked_add(1) == Some(first_seqno);
        if last_seqno < first_seqno && !tombstone {
            return None;
        }
        Some(ChunkMeta { chunk: Chunk { first_seqno, bytes, sealed: value[20] == 1 }, last_seqno })
    }
}

/// One shard's chunks in raft-engine index order: `list[i]` is at index
/// `base + i`; seqnos run on without gaps from chunk to chunk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chunks {
    base: u64,
    list: VecDeque<Chunk>,
    /// The newest chunk's last seqno.
    last_seqno: u64,
    /// The index the next chunk takes when there is none (raft-engine
    /// accepts any index for an empty region; indexes stay increasing).
    next_index: u64,
    /// The unsealed chunks with records at the end ([`Chunks::tail`]):
    /// how many, their bytes and records, kept as chunks come and go.
    tail_count: usize,
    tail_bytes: u64,
    tail_records: u64,
}

impl Chunks {
    /// No chunks; the first one written takes index `next_index`.
    pub fn empty(next_index: u64) -> Chunks {
        Chunks {
            base: next_index,
            list: VecDeque::new(),
            last_seqno: 0,
            next_index,
            tail_count: 0,
            tail_bytes: 0,
            tail_records: 0,
        }
    }

    /// Rebuilds the map from the directory's entries, in index order.
    /// Refuses entries whose indexes or seqnos do not run on.
    pub fn from_directory(entries: &[(u64, ChunkMeta)]) -> Result<Chunks, String> {
        let Some(&(base, _)) = entries.first() else { return Ok(Chunks::empty(1)) };
        let mut chunks = Chunks::empty(base);
        for &(index, meta) in entries {
            if index != chunks.next_index() {
                return Err(format!("chunk index {index} follows {}", chunks.next_index() - 1));
            }
            if !chunks.list.is_empty() && meta.chunk.first_seqno != chunks.last_seqno + 1 {
                return Err(format!(
                    "chunk {index} starts at seqno {} after a chunk ending at {}",
                    meta.chunk.first_seqno, chunks.last_seqno
                ));
            }
            chunks.push(meta);
        }
        Ok(chunks)
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Index of the oldest chunk (meaningless when empty).
    pub fn first_index(&self) -> u64 {
        self.base
    }

    /// The index the next chunk appended takes.
    pub fn next_index(&self) -> u64 {
        if self.list.is_empty() { self.next_index } else { self.base + self.list.len() as u64 }
    }

    /// The newest chunk's last seqno, if there is a chunk.
    pub fn last_seqno(&self) -> Option<u64> {
        (!self.list.is_empty()).then_some(self.last_seqno)
    }

    pub fn get(&self, index: u64) -> Option<Chunk> {
        let at = usize::try_from(index.checked_sub(self.base)?).ok()?;
        self.list.get(at).copied()
    }

    /// `(first_seqno, last_seqno)` of the chunk at `index`.
    pub fn span(&self, index: u64) -> Option<(u64, u64)> {
        let chunk = self.get(index)?;
        let last = match self.get(index + 1) {
            Some(next) => next.first_seqno - 1,
            None => self.last_seqno,
        };
        Some((chunk.first_seqno, last))
    }

    /// The index of the chunk holding `seqno`, if one does.
    pub fn find(&self, seqno: u64) -> Option<u64> {
        if self.list.is_empty() || seqno > self.last_seqno {
            return None;
        }
        let after = self.list.partition_point(|c| c.first_seqno <= seqno);
        (after > 0).then(|| self.base + after as u64 - 1)
    }

    /// Whether the newest chunk is a tombstone ([`ChunkMeta::tombstone`]).
    fn ends_in_tombstone(&self) -> bool {
        self.list.back().is_some_and(|c| c.bytes == 0)
    }

    /// The index the next records go to: after the newest chunk, or over a
    /// tombstone.
    pub fn end_index(&self) -> u64 {
        self.next_index() - u64::from(self.ends_in_tombstone())
    }

    /// The unsealed chunks with records at the end (before a tombstone):
    /// `(first index, count, bytes)`.
    pub fn tail(&self) -> (u64, usize, u64) {
        (self.end_index() - self.tail_count as u64, self.tail_count, self.tail_bytes)
    }

    /// Records the unsealed chunks at the end hold.
    pub fn tail_records(&self) -> u64 {
        self.tail_records
    }

    /// Counts the tail again from the chunks (after chunks were removed).
    fn recount_tail(&mut self) {
        let with_records = self.list.len() - usize::from(self.ends_in_tombstone());
        self.tail_count = self.list.iter().take(with_records).rev().take_while(|c| !c.sealed).count();
        self.tail_bytes = 0;
        self.tail_records = 0;
        for at in with_records - self.tail_count..with_records {
            let index = self.base + at as u64;
            let (first, last) = self.span(index).expect("in range");
            self.tail_bytes += u64::from(self.list[at].bytes);
            self.tail_records += last + 1 - first;
        }
    }

    /// Whether the chunk at `index` is a tombstone.
    pub fn is_tombstone(&self, index: u64) -> bool {
        self.get(index).is_some_and(|c| c.bytes == 0)
    }

    /// Appends a chunk after the newest one.
    pub fn push(&mut self, meta: ChunkMeta) {
        if self.list.is_empty() {
            self.base = self.next_index;
        }
        self.list.push_back(meta.chunk);
        self.last_seqno = meta.last_seqno;
        if meta.chunk.bytes == 0 {
            // A tombstone: the tail is the chunks before it.
        } else if meta.chunk.sealed {
            (self.tail_count, self.tail_bytes, self.tail_records) = (0, 0, 0);
        } else {
            self.tail_count += 1;
            self.tail_bytes += u64::from(meta.chunk.bytes);
            self.tail_records += meta.last_seqno + 1 - meta.chunk.first_seqno;
        }
    }

    /// Removes the chunks at `index` and after (the caller then writes
    /// their replacements, or compacts the region when none is left; the
    /// next chunk still takes a higher index than any removed).
    pub fn truncate_from(&mut self, index: u64) {
        let keep = index.saturating_sub(self.base).min(self.list.len() as u64) as usize;
        if keep == self.list.len() {
            return;
        }
        self.next_index = self.next_index();
        if keep > 0 {
            self.last_seqno = self.list[keep].first_seqno - 1;
        }
        self.list.truncate(keep);
        self.recount_tail();
    }

    /// Replaces the chunks from `index` on with `written` (which start at
    /// `index`; none removes them).
    pub fn replace_from(&mut self, index: u64, written: impl IntoIterator<Item = ChunkMeta>) {
        self.truncate_from(index);
        let mut written = written.into_iter().peekable();
        if self.list.is_empty() && written.peek().is_some() {
            self.next_index = index;
        }
        for meta in written {
            self.push(meta);
        }
    }

    /// Removes the chunks before `index`.
    pub fn compact_to(&mut self, index: u64) {
        let drop = index.saturating_sub(self.base).min(self.list.len() as u64) as usize;
        let next = self.next_index();
        self.list.drain(..drop);
        self.base += drop as u64;
        if self.list.is_empty() {
            self.next_index = next;
            self.base = next;
        }
        self.recount_tail();
    }

    /// Marks every chunk sealed (after a tail that could not be read back
    /// for a merge: it is left as it is).
    pub fn seal_all(&mut self) {
        for chunk in &mut self.list {
            chunk.sealed = true;
        }
        self.recount_tail();
    }

    /// Memory the index of these chunks costs ([`CHUNK_INDEX_BYTES`] each).
    pub fn index_bytes(&self) -> u64 {
        self.list.len() as u64 * CHUNK_INDEX_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(first: u64, last: u64) -> ChunkMeta {
        ChunkMeta {
            chunk: Chunk { first_seqno: first, bytes: (last - first + 1) as u32 * 10, sealed: false },
            last_seqno: last,
        }
    }

    #[test]
    fn find_maps_every_seqno_to_its_chunk() {
        let mut chunks = Chunks::empty(7);
        chunks.push(meta(10, 14));
        chunks.push(meta(15, 15));
        chunks.push(meta(16, 30));
        assert_eq!(chunks.first_index(), 7);
        assert_eq!(chunks.find(9), None);
        assert_eq!(chunks.find(10), Some(7));
        assert_eq!(chunks.find(14), Some(7));
        assert_eq!(chunks.find(15), Some(8));
        assert_eq!(chunks.find(16), Some(9));
        assert_eq!(chunks.find(30), Some(9));
        assert_eq!(chunks.find(31), None);
        assert_eq!(chunks.span(8), Some((15, 15)));
        assert_eq!(chunks.span(9), Some((16, 30)));
        assert_eq!(chunks.next_index(), 10);
    }

    #[test]
    fn truncate_and_compact_keep_indexes_increasing() {
        let mut chunks = Chunks::empty(1);
        for (first, last) in [(1, 5), (6, 9), (10, 12)] {
            chunks.push(meta(first, last));
        }
        chunks.truncate_from(2);
        assert_eq!((chunks.len(), chunks.last_seqno(), chunks.next_index()), (1, Some(5), 2));
        chunks.push(meta(6, 20));
        assert_eq!(chunks.span(2), Some((6, 20)));
        chunks.compact_to(3);
        assert!(chunks.is_empty());
        assert_eq!((chunks.next_index(), chunks.last_seqno()), (3, None));
        chunks.push(meta(21, 22));
        assert_eq!((chunks.first_index(), chunks.find(21)), (3, Some(3)));
        chunks.truncate_from(3);
        assert_eq!((chunks.is_empty(), chunks.next_index()), (true, 4));
        chunks.push(meta(21, 22));
        chunks.push(meta(23, 24));
        chunks.replace_from(4, [meta(21, 30)]);
        assert_eq!((chunks.first_index(), chunks.len(), chunks.last_seqno()), (4, 1, Some(30)));
        chunks.replace_from(4, []);
        assert_eq!((chunks.is_empty(), chunks.next_index()), (true, 5));
    }

    #[test]
    fn the_tail_is_the_unsealed_end() {
        let mut chunks = Chunks::empty(1);
        let sealed =
            |first, last| ChunkMeta { chunk: Chunk { sealed: true, ..meta(first, last).chunk }, ..meta(first, last) };
        chunks.push(sealed(1, 5));
        chunks.push(meta(6, 6));
        chunks.push(meta(7, 8));
        assert_eq!((chunks.tail(), chunks.tail_records()), ((2, 2, 30), 3));
        chunks.push(sealed(9, 9));
        assert_eq!(chunks.tail(), (5, 0, 0));
        chunks.push(meta(10, 10));
        chunks.push(ChunkMeta::tombstone(11));
        assert_eq!((chunks.tail(), chunks.end_index(), chunks.next_index()), ((5, 1, 10), 6, 7));
        assert_eq!((chunks.find(10), chunks.find(11), chunks.last_seqno()), (Some(5), None, Some(10)));
        assert_eq!(ChunkMeta::decode(&ChunkMeta::tombstone(11).encode()), Some(ChunkMeta::tombstone(11)));
    }

    #[test]
    fn directory_values_round_trip_and_refuse_garbage() {
        let m = ChunkMeta { chunk: Chunk { first_seqno: 3, bytes: 70_000, sealed: true }, last_seqno: 9 };
        assert_eq!(ChunkMeta::decode(&m.encode()), Some(m));
        assert_eq!(ChunkMeta::decode(&m.encode()[..20]), None);
        let mut bad = m.encode();
        bad[20] = 7;
        assert_eq!(ChunkMeta::decode(&bad), None);
        assert_eq!(index_of_key(&key(42)), Some(42));
        assert_eq!(index_of_key(b"walship/first"), None);
        let (lo, hi) = key_range();
        assert!(lo <= key(0) && key(u64::MAX) < hi);
    }

    #[test]
    fn a_directory_with_a_hole_is_refused() {
        let entries = [(1, meta(1, 5)), (3, meta(6, 9))];
        assert!(Chunks::from_directory(&entries).is_err());
        let entries = [(1, meta(1, 5)), (2, meta(7, 9))];
        assert!(Chunks::from_directory(&entries).is_err());
        let entries = [(4, meta(1, 5)), (5, meta(6, 9))];
        let chunks = Chunks::from_directory(&entries).unwrap();
        assert_eq!((chunks.first_index(), chunks.last_seqno(), chunks.find(7)), (4, Some(9), Some(5)));
    }
}
