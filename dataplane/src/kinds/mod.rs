//! Task kinds. A kind is one file here: a [`crate::worker::TaskRunner`]
//! for the node side, and what the coordinator needs to plan it.

pub mod export;
pub mod noop;
pub mod verify;

use std::sync::Arc;

use crate::worker::TaskRunner;

/// Every kind a node runs, over its WAL.
pub fn runners(wal: walship_wal::Wal) -> Vec<Arc<dyn TaskRunner>> {
    vec![Arc::new(noop::NoopRunner), Arc::new(verify::VerifyRunner(wal.clone())), Arc::new(export::ExportRunner(wal))]
}
