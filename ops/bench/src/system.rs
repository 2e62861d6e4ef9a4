//! What the harness needs from each system under test.
//!
//! Every system is measured on the same unit: one record appended by one
//! client, counted when the system acknowledges it at the durability the
//! comparison fixes (walship `QUORUM`/`ALL`, JetStream's publish ack from
//! an R3 file stream with `sync_interval: always`, a committed PostgreSQL
//! insert with `synchronous_commit = on` and `ANY 1 (s1, s2)`).

use std::sync::Arc;

use anyhow::Result;
use async_trait::async_trait;
use bytes::Bytes;

/// One client's connection to a system. A client issues one append at a
/// time; the harness runs many clients concurrently.
#[async_trait]
pub trait Appender: Send + Sync {
    /// Appends one record and returns once the system acknowledges it.
    async fn append(&self, payload: Bytes) -> Result<()>;
}

/// A running system under test. Its processes stop when it is dropped
/// (`stop` does the same and reports errors).
#[async_trait]
pub trait Cluster: Send + Sync {
    /// Copies of every record written to the one disk (for the disk ratio).
    fn copies(&self) -> f64 {
        3.0
    }
    /// `clients` appenders: client `i` uses element `i`. Systems that
    /// multiplex (walship, NATS) may share connections between elements;
    /// PostgreSQL needs one connection per client.
    async fn appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>>;
    /// Stops every process and waits for them to exit.
    async fn stop(self: Box<Self>) -> Result<()>;

    /// After a cell's load, before `stop`: checks that the system holds
    /// exactly what its appenders saw acknowledged, where a system variant
    /// counts that (`jetstream-dedupe`); by default nothing is checked.
    async fn verify(&self) -> Result<()> {
        Ok(())
    }

    /// Kills (SIGKILL) the process leading the log and names it; `None`
    /// when the system has no automatic failover to measure.
    async fn kill_leader(&mut self) -> Result<Option<String>> {
        Ok(None)
    }

    /// Appenders for the failover measurement: each attempt gives up
    /// quickly, and after an error the next attempt may go to another
    /// server, so clients find whoever leads next.
    async fn failover_appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
        self.appenders(clients).await
    }
}
