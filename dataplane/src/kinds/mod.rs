//! Task kinds. A kind is one file here: a [`crate::worker::TaskRunner`]
//! for the node side, and what the coordinator needs to plan it.

pub mod export;
pub mod noop;
pub mod verify;

use std::sync::Arc;

use crate::limiter::RateLimiter;
use crate::worker::TaskRunner;

/// The newest seqno of a shard this node's replica knows committed (durable
/// on a majority; `None`: no such replica). Records past it may still be
/// truncated by a failover, so no task hands them out.
pub type Committed = Arc<dyn Fn(walship_wal::ShardId) -> Option<u64> + Send + Sync>;

/// Every kind a node runs, over its WAL. `read_budget` is shared by every
/// task that reads the WAL (verify, export): each page's bytes are taken
/// from it as the page is read, so the next read waits while it is spent.
pub fn runners(wal: walship_wal::Wal, read_budget: Arc<RateLimiter>, committed: Committed) -> Vec<Arc<dyn TaskRunner>> {
    vec![
        Arc::new(noop::NoopRunner),
        Arc::new(verify::VerifyRunner { wal: wal.clone(), budget: read_budget.clone() }),
        Arc::new(export::ExportRunner { wal, budget: read_budget, committed }),
    ]
}
