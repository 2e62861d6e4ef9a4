//! Replication and the client-facing side of a shard replica.
//!
//! * [`config`]: the cluster configuration (nodes, shards, replica sets,
//!   replication tuning).
//! * [`core`]: the pure replica state machines (leader progress, commit,
//!   lag, retention; follower segment classification), unit-tested by
//!   feeding events and asserting decisions.
//! * [`replica`]: the async shell — per-shard leader drivers and shippers,
//!   the follower apply path and catch-up, retention, heartbeats.
//! * [`server`]: the `WalShipping` gRPC service.
//! * [`log_service`]: `walship.v1.Log`, the client API a node serves.
//!
//! Leadership is static (from the cluster config) until the failover issue
//! adds the coordinator; the epoch already fences every message.

pub mod config;
pub mod control;
pub mod core;
pub mod limiter;
pub mod log_service;
pub mod metrics;
pub mod peers;
pub mod replica;
pub mod server;

pub use config::{ClusterConfig, NodeSpec, ReplicationConfig, ShardSpec};
pub use log_service::{LogLimits, LogService, LogServiceMetrics};
pub use metrics::ReplicationMetrics;
pub use replica::{ReplicaStatus, ReplicationNode};
pub use server::{ControlService, WalShippingService};

/// A node's id in the cluster configuration.
pub type NodeId = u32;
