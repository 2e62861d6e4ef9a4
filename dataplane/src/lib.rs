//! The `DataPlane` bidi stream between the coordinator and the nodes.
//!
//! Not built yet: a later issue adds both sides here. The coordinator side
//! will dispatch tasks (catch-up, replica checksum verification over a seqno
//! range, export, archive, replica rebuild), track their progress and
//! liveness, redispatch after a disconnect and drop duplicate completions,
//! and park permanently failed tasks in a dead-letter queue. The node side
//! will hold one `Connect` stream, de-dupe on `task_id` and report
//! `TaskProgress` and `ResultBatch`es. The wire contract already lives in
//! `walship-proto` (`dataplane.v1.DataPlane`).

pub mod arrow_export;
pub mod verify;
