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
