//! The `DataPlane` bidi stream between the coordinator and the nodes:
//! operational work on shards as tasks.
//!
//! * [`task`]: a task's record and state transitions (pure).
//! * [`coordinator`]: the coordinator side: `DataPlane/Connect`, worker
//!   admission, capacity-aware dispatch, result routing, redispatch after
//!   a disconnect, stall and deadline enforcement, cancellation, dead
//!   letters.
//! * [`worker`]: the node side: one stream to the active coordinator,
//!   reconnecting with backoff, de-duping dispatches, running tasks by kind
//!   and reporting their progress and results.
//! * [`bus`]: cancels broadcast between coordinators and the dead letters
//!   (in process, or NATS and JetStream).
//! * [`kinds`]: the task kinds; adding one is one file there.
//! * [`limiter`]: the node's byte-rate budget for the WAL reads of its tasks.
//! * [`arrow_export`]: records as Arrow record batches, IPC streams and files.
//! * [`verify`]: per-chunk checksums of a seqno range and where replicas
//!   first differ.
//!
//! The wire contract is `walship-proto`'s `dataplane.v1.DataPlane`.

pub mod arrow_export;
pub mod bus;
pub mod coordinator;
pub mod kinds;
pub mod limiter;
pub mod task;
pub mod verify;
pub mod worker;

/// Largest DataPlane message either side takes (a result batch is at most
/// this); a bigger one ends the stream with `RESOURCE_EXHAUSTED`.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;
