//! `noop`: does nothing (or waits), for the dispatch benchmark and tests.
//! Blob: `{"sleep_ms": N, "advance": bool, "fail": "why"}`, all optional:
//! waits N ms (advancing its counters every 100 ms unless `advance` is
//! false, which a stall test uses), then succeeds, or fails with `fail`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::worker::{TaskContext, TaskOutcome, TaskRunner};

pub const KIND: &str = "noop";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Noop {
    #[serde(default)]
    pub sleep_ms: u64,
    #[serde(default = "yes")]
    pub advance: bool,
    #[serde(default)]
    pub fail: Option<String>,
}

fn yes() -> bool {
    true
}

pub struct NoopRunner;

impl TaskRunner for NoopRunner {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn run(&self, task: Arc<TaskContext>) -> Pin<Box<dyn Future<Output = TaskOutcome> + Send>> {
        Box::pin(async move {
            let noop: Noop = serde_json::from_slice(&task.blob).map_err(|e| format!("a noop task's blob: {e}"))?;
            let mut left = Duration::from_millis(noop.sleep_ms);
            while !left.is_zero() {
                let step = left.min(Duration::from_millis(100));
                tokio::time::sleep(step).await;
                left -= step;
                if noop.advance {
                    task.advance(1, 0);
                }
            }
            match noop.fail {
                Some(why) => Err(why),
                None => Ok((0, Vec::new())),
            }
        })
    }
}
