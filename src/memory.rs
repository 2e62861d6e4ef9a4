//! Giving freed heap back to the operating system.
//!
//! glibc's allocator keeps memory a process freed for its own reuse, and
//! gives back only what lies at the top of its main heap. A node's bursts
//! (thousands of shards taking leaders at start-up, a bulk failover, a
//! catch-up) leave free memory spread through its heaps, counted in its
//! resident size for as long as it runs: at 10,000 shards, 17 MiB of a
//! node's 152 MiB. A node returns it every [`TRIM_EVERY`]
//! (`malloc_trim`, which frees whole free pages wherever they lie).

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// How often a node gives freed memory back. A pass over a 10,000-shard
/// node's heaps took 1-6 ms.
const TRIM_EVERY: Duration = Duration::from_secs(10);

/// Gives freed memory back every [`TRIM_EVERY`] until `shutdown`.
pub async fn return_freed_memory(shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(TRIM_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        // It holds each heap's lock while it walks it: off the runtime's threads.
        let trimmed = tokio::task::spawn_blocking(|| {
            let started = Instant::now();
            let released = trim();
            (released, started.elapsed())
        })
        .await;
        if let Ok((released, took)) = trimmed {
            tracing::debug!(released, took_us = took.as_micros() as u64, "gave freed memory back");
        }
    }
}

/// Whether any memory was given back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() -> bool {
    // SAFETY: malloc_trim only walks and releases the allocator's own free
    // memory; it takes no pointers and is safe to call from any thread.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    false
}
