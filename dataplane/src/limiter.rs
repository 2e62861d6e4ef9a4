//! The node's budget for the bytes its DataPlane tasks read from the WAL
//! (`verify`, `export`), shared by every task it runs: the WAL's
//! [`RateLimiter`].

pub use walship_wal::limiter::RateLimiter;

/// The default budget for all of a node's task reads together: 64 MiB/s.
pub const DEFAULT_TASK_READ_BYTES_PER_S: u64 = 64 << 20;
