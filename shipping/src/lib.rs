//! Replication and the client-facing side of a shard replica.
//!
//! * [`auth`]: the cluster secret every cluster RPC carries.
//! * [`config`]: the cluster configuration (nodes, shards, replica sets,
//!   replication tuning).
//! * [`core`]: the pure state machines: a replica's role and epoch rules,
//!   a leader's shipping progress, commit, lease, lag and retention, a
//!   follower's segment classification; unit-tested by feeding events and
//!   asserting decisions.
//! * [`replica`]: the async shell that performs what the core decides,
//!   split by direction and lifecycle (leadership, send, receive, catch-up,
//!   retention, status), with one error type mapped to gRPC in one place.
//! * [`server`]: the `WalShipping` and `Control` gRPC services.
//! * [`log_service`]: `walship.v1.Log`, the client API a node serves.
//! * [`control`]: the coordinator: the leadership KV (a file or NATS), lease,
//!   failure detection, failover and drills.
//!
//! The epoch fences every message; leadership is static (from the cluster
//! config) without a coordinator and the coordinator's to move with one.

pub mod archive;
pub mod auth;
pub mod config;
pub mod control;
pub mod core;
pub mod log_service;
pub mod metrics;
pub mod peers;
pub mod producer_config;
pub mod read_memory;
pub mod replica;
pub mod server;

pub use config::{ClusterConfig, NodeSpec, ReplicationConfig, ShardSpec};
pub use log_service::{LogLimits, LogService, LogServiceMetrics};
pub use metrics::ReplicationMetrics;
pub use replica::{ReplicaStatus, ReplicationNode};
pub use server::{ControlService, WalShippingService};

/// A node's id in the cluster configuration.
pub type NodeId = u32;
