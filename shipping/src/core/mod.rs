//! The pure replication core: state machines that take events and return
//! decisions, with no sockets, files or clocks inside (time comes in as
//! microsecond arguments). The async shell in `crate::replica` performs what
//! they decide; the unit tests beside each file feed events and assert the
//! decisions, every rejection path included.
//!
//! * [`leader`]: one shard's leader — per-follower ship progress and modes,
//!   the commit position, lag, retention.
//! * [`follower`]: how a follower classifies an inbound segment.
//! * [`replica`]: one shard replica's role and epoch rules (fencing,
//!   assignment, following, stepping down, repair gating, pause, full disk,
//!   corruption), as commands for the shell.

pub mod follower;
pub mod leader;
pub mod replica;

use std::fmt;

/// A leadership term of one shard: raised by every change of leader, it
/// fences everything older. A newtype where it crosses from the shell into
/// the rules, so it is never confused with a seqno or a node id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl Epoch {
    /// No epoch at or past this (2^62) is taken or adopted: far beyond what
    /// any cluster raises, and far enough below u64::MAX that raising never
    /// runs out. A replica promising a forged u64::MAX would refuse every
    /// later epoch: the shard could never fail over again.
    pub const CEILING: u64 = 1 << 62;
}

/// A position in one shard's log: seqnos start at 1, are contiguous and are
/// never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct Seqno(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for Seqno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Seqno {
    /// The seqno before this one (0 before the first).
    pub fn prev(self) -> Seqno {
        Seqno(self.0.saturating_sub(1))
    }

    /// How many seqnos lie after `earlier` up to this one (0 if none).
    pub fn since(self, earlier: Seqno) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

/// `seqno + n`: the seqno `n` records later.
impl std::ops::Add<u64> for Seqno {
    type Output = Seqno;
    fn add(self, n: u64) -> Seqno {
        Seqno(self.0 + n)
    }
}

/// Tests compare positions with plain numbers.
#[cfg(test)]
impl PartialEq<u64> for Seqno {
    fn eq(&self, other: &u64) -> bool {
        self.0 == *other
    }
}

#[cfg(test)]
impl PartialEq<u64> for Epoch {
    fn eq(&self, other: &u64) -> bool {
        self.0 == *other
    }
}
