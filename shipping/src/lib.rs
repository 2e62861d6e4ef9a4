//! Replication and the client-facing side of a shard replica.
//!
//! Today this crate holds [`log_service`], the `walship.v1.Log` gRPC service a
//! node serves for the shards it hosts, over the node's [`walship_wal::Wal`].
//! With one replica per shard, every durability level is met when the record
//! is fsynced locally. The replication issue adds here the pure replica state
//! machine, the `WalShipping` server and client, per-follower ship queues,
//! quorum acknowledgement, and later the control plane (leadership, epochs,
//! failover).

pub mod log_service;

pub use log_service::{LogLimits, LogService, LogServiceMetrics};
