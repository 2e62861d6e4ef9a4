//! The unsealed tails of [`super::EngineStore`]'s shards: the frames of a
//! shard's unsealed chunks kept for its next merge ([`KnownTail`]), the
//! budget all of them share ([`TailFrames`]), the check that a tail offered
//! by the caller is exactly that tail ([`holds_tail`]), and how a merge's
//! tail and new frames are cut into chunks ([`split`], [`Piece`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::ShardState;
use crate::record::Frame;
use crate::store::ShardId;

/// The frames of a shard's unsealed chunks, in order, and what they add up
/// to.
#[derive(Debug, Clone, Default)]
pub(super) struct KnownTail {
    pub(super) chunks: Vec<TailChunk>,
    pub(super) records: u64,
    pub(super) bytes: usize,
}

impl KnownTail {
    pub(super) fn push(&mut self, chunk: TailChunk) {
        self.records += chunk.records;
        self.bytes += chunk.frames.len();
        self.chunks.push(chunk);
    }
}

/// What the shards' known tails hold in memory together, against
/// [`super::EngineStoreConfig::tail_frames_bytes`]. Changed under the shards lock.
pub(super) struct TailFrames {
    pub(super) used: AtomicUsize,
    pub(super) limit: usize,
}

impl TailFrames {
    /// Takes `state`'s known tail out of the count.
    pub(super) fn take(&self, state: &mut ShardState) -> Option<KnownTail> {
        let tail = state.tail.take();
        if let Some(t) = &tail {
            self.used.fetch_sub(t.bytes, Ordering::Relaxed);
        }
        tail
    }

    /// Replaces `state`'s known tail with `tail`, or forgets it when the
    /// budget has no room for it (its next merge reads it back).
    pub(super) fn set(&self, state: &mut ShardState, tail: Option<KnownTail>) {
        self.take(state);
        state.tail = tail.filter(|t| {
            let fits = self.used.load(Ordering::Relaxed) + t.bytes <= self.limit;
            if fits {
                self.used.fetch_add(t.bytes, Ordering::Relaxed);
            }
            fits
        });
    }
}

/// Whether `held` is exactly a tail of `records` frames from `first` adding
/// up to `bytes`: seqnos in order from `first`, nothing missing or extra.
pub(super) fn holds_tail(held: &[Frame], first: u64, records: u64, bytes: u64) -> bool {
    held.len() as u64 == records
        && held.iter().zip(first..).all(|(f, seqno)| f.seqno() == seqno)
        && held.iter().map(|f| f.len() as u64).sum::<u64>() == bytes
}

/// The frames of one unsealed chunk, as written (a slice of its entry's
/// bytes).
#[derive(Debug, Clone)]
pub(super) struct TailChunk {
    pub(super) frames: bytes::Bytes,
    pub(super) records: u64,
}

/// One chunk to write: the frames of the unsealed chunks it merges, then
/// new frames, borrowed (encoded once, straight into the chunk).
pub(super) struct Piece<'a> {
    pub(super) first_seqno: u64,
    pub(super) records: u64,
    pub(super) bytes: usize,
    pub(super) merged: Vec<TailChunk>,
    pub(super) frames: Vec<&'a Frame>,
}

impl<'a> Piece<'a> {
    pub(super) fn new(first_seqno: u64) -> Piece<'a> {
        Piece { first_seqno, records: 0, bytes: 0, merged: Vec::new(), frames: Vec::new() }
    }

    /// The chunk's bytes: a segment header and the frames.
    pub(super) fn encode(&self, shard: ShardId) -> bytes::Bytes {
        let header = crate::segment::SegmentHeader {
            shard_id: shard,
            first_seqno: self.first_seqno,
            record_count: self.records as u32,
            frames_len: self.bytes,
        };
        let mut buf = bytes::BytesMut::with_capacity(crate::segment::SEGMENT_HEADER_LEN + self.bytes);
        buf.extend_from_slice(&header.encode());
        for tail in &self.merged {
            buf.extend_from_slice(&tail.frames);
        }
        for frame in &self.frames {
            buf.extend_from_slice(frame.as_bytes());
        }
        buf.freeze()
    }
}

/// Splits `merged` tail chunks (the records from `first_seqno`, less than
/// `limit` bytes in all) and the new `frames` after them into chunks of at
/// most `limit` bytes (a larger frame alone); the merged ones lead the
/// first.
pub(super) fn split<'a>(
    merged: Vec<TailChunk>,
    first_seqno: u64,
    frames: &[&'a Frame],
    limit: usize,
) -> Vec<Piece<'a>> {
    let mut pieces = Vec::new();
    let mut piece = Piece::new(first_seqno);
    for tail in merged {
        piece.records += tail.records;
        piece.bytes += tail.frames.len();
        piece.merged.push(tail);
    }
    for &frame in frames {
        if piece.records > 0 && piece.bytes + frame.len() > limit {
            let next = piece.first_seqno + piece.records;
            pieces.push(std::mem::replace(&mut piece, Piece::new(next)));
        }
        piece.records += 1;
        piece.bytes += frame.len();
        piece.frames.push(frame);
    }
    if piece.records > 0 {
        pieces.push(piece);
    }
    pieces
}
