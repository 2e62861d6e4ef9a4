//! The bound on what is sequenced but not yet durable.

use super::*;

/// Bytes sequenced but not yet durable. Appenders wait while more than
/// `max_batch_bytes` is staged, so the run-ahead (all of it held in the tail
/// cache, see [`crate::tail_cache`]) stays bounded. The count is the
/// `walship_wal_staged_bytes` gauge itself.
pub(super) struct StagedBytes {
    bytes: prometheus::IntGauge,
    /// Appends that had to wait (`walship_wal_staged_waits_total`).
    waits: prometheus::IntCounter,
    limit: i64,
    drained: tokio::sync::Notify,
}

impl StagedBytes {
    pub(super) fn new(limit: usize, metrics: &WalMetrics) -> StagedBytes {
        StagedBytes {
            bytes: metrics.staged_bytes.clone(),
            waits: metrics.staged_waits.clone(),
            limit: limit as i64,
            drained: tokio::sync::Notify::new(),
        }
    }

    /// Waits while more than the limit is staged.
    pub(super) async fn wait_below_limit(&self) {
        let mut counted = false;
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.bytes.get() <= self.limit {
                return;
            }
            if !counted {
                self.waits.inc();
                counted = true;
            }
            drained.await;
        }
    }

    pub(super) fn add(&self, n: usize) {
        self.bytes.add(n as i64);
    }

    pub(super) fn release(&self, n: usize) {
        self.bytes.sub(n as i64);
        self.drained.notify_waiters();
    }
}
