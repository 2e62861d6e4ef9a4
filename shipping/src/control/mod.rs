//! The control plane: the leadership KV, the coordinator's state in it, the
//! pure failover and liveness decisions and the coordinator runtime.

pub mod coordinator;
pub mod drills;
pub mod failover;
pub mod kv;
pub mod lenient;
pub mod liveness;
pub mod service;
pub mod state;

pub use coordinator::{CoordError, Coordinator, CoordinatorMetrics, FailoverOutcome, FailoverRequest};
pub use kv::{FileKv, Kv, KvEntry, KvError, NatsKv};
