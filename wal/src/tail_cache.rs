//! Each shard's newest written frames, kept in memory for the readers at the
//! head of its log (shippers, tails, short catch-ups), within a byte budget
//! shared by every shard of the node.
//!
//! A budget per shard alone does not bound a node: 8 MiB for each of 1,000
//! shards under load is 8 GiB, and a node hosting thousands of written
//! shards grew until it ran out of memory. So the shards draw on one node
//! budget ([`TailBudget`]): a shard may keep up to the per-shard ceiling
//! while the others leave room, and is cut back to its fair share (the node
//! budget over the shards hosted) on its next push once they do not. What a
//! node caches stays under twice the node budget: fair shares add up to the
//! budget, and what shards keep above their fair share was taken while the
//! total was under it.
//!
//! A frame not yet in the store is never evicted (the cache is then the only
//! place to read it from); the staged-bytes limit bounds those.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::record::Frame;

/// The node-wide budget every shard's [`TailCache`] draws on.
pub(crate) struct TailBudget {
    /// What all the shards together should keep (`tail_cache_total_bytes`).
    total: usize,
    /// What one shard may keep at most (`tail_cache_bytes`).
    per_shard: usize,
    /// Bytes cached now, every shard together (`walship_wal_tail_cache_bytes`).
    used: prometheus::IntGauge,
    /// Shards with a cache.
    shards: AtomicUsize,
}

impl TailBudget {
    pub(crate) fn new(total: usize, per_shard: usize, used: prometheus::IntGauge) -> Arc<TailBudget> {
        Arc::new(TailBudget { total, per_shard, used, shards: AtomicUsize::new(0) })
    }

    /// What a shard now holding `own` bytes may keep: its fair share, or
    /// whatever the other shards leave of the node budget if that is more,
    /// never above the per-shard ceiling.
    fn allowance(&self, own: usize) -> usize {
        let fair = self.total / self.shards.load(Ordering::Relaxed).max(1);
        let others = (self.used.get().max(0) as usize).saturating_sub(own);
        self.per_shard.min(fair.max(self.total.saturating_sub(others)))
    }

    fn add(&self, bytes: usize) {
        self.used.add(bytes as i64);
    }

    fn sub(&self, bytes: usize) {
        self.used.sub(bytes as i64);
    }
}

/// A shard's newest written frames, contiguous. Changed under the
/// sequencer lock (pushes, truncations, compactions), always before the
/// positions it covers are published.
pub(crate) struct TailCache {
    frames: VecDeque<Frame>,
    bytes: usize,
    budget: Arc<TailBudget>,
}

impl TailCache {
    pub(crate) fn new(budget: Arc<TailBudget>) -> TailCache {
        budget.shards.fetch_add(1, Ordering::Relaxed);
        TailCache { frames: VecDeque::new(), bytes: 0, budget }
    }

    /// Adds the newest frames (copies of them in allocations of their own
    /// when `detach`: what the budget counts is then what they hold) and
    /// evicts the oldest past the shard's allowance, but only frames the
    /// store already holds (seqno `<= stored`): a frame that is sequenced
    /// and not yet in the store is readable from here alone.
    pub(crate) fn push(&mut self, frames: &[Frame], stored: u64, detach: bool) {
        if let (Some(back), Some(first)) = (self.frames.back(), frames.first())
            && back.seqno() + 1 != first.seqno()
        {
            self.clear();
        }
        let added: usize = frames.iter().map(Frame::len).sum();
        if detach {
            self.frames.extend(frames.iter().map(Frame::detached));
        } else {
            self.frames.extend(frames.iter().cloned());
        }
        self.bytes += added;
        self.budget.add(added);
        let allowance = self.budget.allowance(self.bytes);
        while self.bytes > allowance && self.frames.front().is_some_and(|f| f.seqno() <= stored) {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        let f = self.frames.pop_front().expect("checked by the caller");
        self.uncount(f.len());
    }

    fn clear(&mut self) {
        self.frames.clear();
        self.uncount(self.bytes);
    }

    /// Takes `bytes` of frames no longer held out of this shard's count
    /// and the node's.
    fn uncount(&mut self, bytes: usize) {
        self.bytes -= bytes;
        self.budget.sub(bytes);
    }

    /// Drops frames after `keep_through`.
    pub(crate) fn truncate(&mut self, keep_through: u64) {
        while self.frames.back().is_some_and(|f| f.seqno() > keep_through) {
            let f = self.frames.pop_back().expect("checked");
            self.uncount(f.len());
        }
    }

    /// Drops frames before `first_kept`.
    pub(crate) fn compact(&mut self, first_kept: u64) {
        while self.frames.front().is_some_and(|f| f.seqno() < first_kept) {
            self.pop_front();
        }
    }

    /// Frames `[from, to]` if the cache holds all of them, cut at
    /// `max_bytes` like a store read (at least one frame).
    pub(crate) fn read(&self, from: u64, to: u64, max_bytes: usize) -> Option<Vec<Frame>> {
        let first = self.frames.front()?.seqno();
        let last = self.frames.back()?.seqno();
        if from < first || to > last || from > to {
            return None;
        }
        let mut out = Vec::new();
        let mut size = 0;
        for frame in self.frames.range((from - first) as usize..=(to - first) as usize) {
            size += frame.len();
            if size > max_bytes && !out.is_empty() {
                break;
            }
            out.push(frame.clone());
        }
        Some(out)
    }
}

impl Drop for TailCache {
    fn drop(&mut self) {
        self.uncount(self.bytes);
        self.budget.shards.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(total: usize, per_shard: usize) -> Arc<TailBudget> {
        TailBudget::new(total, per_shard, prometheus::IntGauge::new("t", "t").unwrap())
    }

    #[test]
    fn keeps_the_newest_contiguous_frames_within_budget() {
        let frames = crate::conformance::frames(1, 10, 1);
        let one = frames[0].len();
        let budget = budget(one * 100, one * 4);
        let mut cache = TailCache::new(budget.clone());
        cache.push(&frames[..6], u64::MAX, false);
        assert_eq!(cache.frames.len(), 4, "budget of 4 frames");
        assert_eq!(budget.used.get(), (one * 4) as i64);
        assert_eq!(cache.read(3, 6, usize::MAX).unwrap(), frames[2..6].to_vec());
        assert_eq!(cache.read(2, 6, usize::MAX), None, "2 was evicted: the store serves it");
        assert_eq!(cache.read(5, 7, usize::MAX), None, "7 is not cached yet");
        assert_eq!(cache.read(3, 6, one).unwrap().len(), 1, "max_bytes cuts, at least one frame");
        // A push that does not continue the cached run replaces it.
        cache.push(&frames[7..9], u64::MAX, false);
        assert_eq!(cache.read(8, 9, usize::MAX).unwrap(), frames[7..9].to_vec());
        assert_eq!(cache.read(6, 6, usize::MAX), None);
        assert_eq!(budget.used.get(), (one * 2) as i64);
        cache.truncate(8);
        assert_eq!(cache.read(9, 9, usize::MAX), None);
        assert_eq!(budget.used.get(), one as i64);
        cache.compact(9);
        assert!(cache.frames.is_empty());
        assert_eq!(cache.bytes, 0);
        assert_eq!(budget.used.get(), 0);
    }

    #[test]
    fn never_evicts_what_the_store_does_not_hold() {
        let frames = crate::conformance::frames(1, 10, 1);
        let one = frames[0].len();
        let mut cache = TailCache::new(budget(one * 100, one * 2));
        // Only 1..=2 are stored: the budget of 2 frames gives way.
        cache.push(&frames[..6], 2, false);
        assert_eq!(cache.read(3, 6, usize::MAX).unwrap(), frames[2..6].to_vec());
        assert_eq!(cache.read(2, 2, usize::MAX), None, "stored frames are evicted first");
        // Once the store holds them, the budget applies again.
        cache.push(&frames[6..7], 6, false);
        assert_eq!(cache.read(6, 7, usize::MAX).unwrap(), frames[5..7].to_vec());
        assert_eq!(cache.read(5, 5, usize::MAX), None);
    }

    /// Frames that arrived in a message are slices of its buffer; detached,
    /// the cache holds copies of its own and the buffer can go.
    #[test]
    fn detached_frames_do_not_keep_the_message_they_came_in() {
        let frames = crate::conformance::frames(1, 3, 1);
        let mut message = bytes::BytesMut::new();
        for frame in &frames {
            message.extend_from_slice(frame.as_bytes());
        }
        let message = message.freeze();
        let (first, rest) = Frame::split_first(&message).unwrap();
        let (second, _) = Frame::split_first(&rest).unwrap();
        let within = |f: &Frame| message.as_ptr_range().contains(&f.as_bytes().as_ptr());
        assert!(within(&first) && within(&second), "decoded frames share the message");
        let mut kept = TailCache::new(budget(1 << 20, 1 << 20));
        kept.push(&[first.clone(), second.clone()], u64::MAX, true);
        assert!(kept.frames.iter().all(|f| !within(f)), "the cache holds copies");
        assert_eq!(kept.read(1, 2, usize::MAX).unwrap(), vec![first.clone(), second.clone()]);
        let mut shared = TailCache::new(budget(1 << 20, 1 << 20));
        shared.push(&[first, second], u64::MAX, false);
        assert!(shared.frames.iter().all(within), "a leader's own frames are kept as they are");
    }

    #[test]
    fn shards_share_the_node_budget() {
        // Seqnos of three digits: frames of one size.
        let frames = crate::conformance::frames(100, 40, 1);
        let one = frames[0].len();
        // Room for 8 frames on the node, 6 on one shard at most.
        let budget = budget(one * 8, one * 6);
        let mut a = TailCache::new(budget.clone());
        let mut b = TailCache::new(budget.clone());
        // Alone in use, a shard takes up to the per-shard ceiling.
        a.push(&frames[..10], u64::MAX, false);
        assert_eq!(a.frames.len(), 6);
        // The other takes what is left, but at least its fair share (4).
        b.push(&frames[..10], u64::MAX, false);
        assert_eq!(b.frames.len(), 4, "fair share: 8 frames over 2 shards");
        assert_eq!(budget.used.get(), (one * 10) as i64, "over the node budget, under twice it");
        // The first shard's next push cuts it back to its fair share.
        a.push(&frames[10..11], u64::MAX, false);
        assert_eq!(a.frames.len(), 4);
        assert_eq!(budget.used.get(), (one * 8) as i64);
        // A third shard lowers everyone's fair share; dropped, a shard's
        // bytes leave the count.
        let mut c = TailCache::new(budget.clone());
        c.push(&frames[..3], u64::MAX, false);
        assert_eq!(c.frames.len(), 2, "8 frames over 3 shards: 2 each, the others hold 8");
        drop(b);
        assert_eq!(budget.used.get(), (one * 6) as i64);
        c.push(&frames[3..4], u64::MAX, false);
        assert_eq!(c.frames.len(), 3, "room again: not cut while the node is under budget");
        drop((a, c));
        assert_eq!(budget.used.get(), 0);
        assert_eq!(budget.shards.load(Ordering::Relaxed), 0);
    }
}
