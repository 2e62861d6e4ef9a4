//! Replication and the client-facing side of a shard replica.
//!
//! * [`config`]: the cluster configuration (nodes, shards, replica sets,
//!   replication tuning).
//! * [`core`]: the pure replica state machines (leader progress, commit,
//!   lag, retention; follower segment classification), unit-tested by
//!   feeding events and asserting decisions.
//! * [`log_service`]: `walship.v1.Log`, the client API a node serves.
//!
//! The async shell (replicas, the `WalShipping` server and client) grows
//! around the core in the modules added beside these.

pub mod config;
pub mod core;
pub mod log_service;

pub use log_service::{LogLimits, LogService, LogServiceMetrics};

/// A node's id in the cluster configuration.
pub type NodeId = u32;
