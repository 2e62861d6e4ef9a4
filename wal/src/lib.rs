//! walship's durable log.
//!
//! * [`record`]: the crc32-protected record [`Frame`], encoded once by the
//!   leader and stored, shipped and read back byte-identical.
//! * [`segment`]: a contiguous run of one shard's frames, the unit shipped to
//!   followers.
//! * [`store`]: the [`LogStore`] seam with explicit positions, implemented by
//!   [`EngineStore`] (raft-engine, one instance per node, a region per
//!   shard, an entry per *chunk* of records) and [`MemStore`] (test
//!   double); both pass one conformance suite.
//! * [`chunk`]: the raft-engine store's sparse map from seqno to chunk, and
//!   what it costs in memory ([`LogStore::index_bytes`]).
//! * [`disk_space`]: the free-space reserve (`wal.min_free_bytes`) appends
//!   are refused below, before the WAL meets a real `ENOSPC`.
//! * [`producers`]: producer sessions (exactly-once appends): the table of
//!   what each producer wrote, rebuilt from the records' stamps, and its
//!   snapshots kept beside the log.
//! * [`wal`]: [`Wal`], the sequencer and group-commit persister shared by
//!   every shard on the node, with per-shard positions and watches of the
//!   written and durable seqnos.
//! * [`corruption`]: the registry of known corrupt ranges and the scrubber;
//!   [`recovery_log`]: raft-engine's recovery truncations classified as a
//!   torn tail (INFO) or corruption (ERROR).
//! * [`failpoints`]: storage fault injection for black-box tests (feature
//!   `testing`, never in a production build).

pub mod chunk;
pub mod corruption;
pub mod disk;
pub mod disk_space;
pub mod engine_store;
pub mod failpoints;
pub mod limiter;
pub mod mem_store;
pub mod metrics;
pub mod position;
pub mod producers;
mod raises;
pub mod record;
pub mod recovery_log;
pub mod segment;
pub mod store;
mod tail_cache;
pub mod wal;
pub mod zero_fill;

#[cfg(test)]
mod conformance;

pub use corruption::{CorruptRange, Detection, ScrubReport};
pub use disk_space::{DiskFull, DiskSpace};
pub use engine_store::{DEFAULT_SPARE_BYTES, EngineStore, EngineStoreConfig};
pub use mem_store::MemStore;
pub use metrics::WalMetrics;
pub use producers::{ProducerLimits, ProducerRefusal};
pub use record::{CodecError, Frame, ProducerStamp, RecordFields};
pub use segment::{Segment, SegmentHeader};
pub use store::{
    Counter, Earlier, LogBounds, LogStore, Raise, ShardAppend, ShardId, SnapshotChanges, StartupDamage, StoreError,
};
pub use wal::{
    AppendOptions, AppendOutcome, Appended, DEFAULT_PRODUCER_SNAPSHOT_BYTES, DEFAULT_SCRUB_BYTES_PER_S,
    DEFAULT_SCRUB_INTERVAL, NewRecord, Positions, ProducerStats, ShardCounters, Wal, WalConfig, WalError,
};
