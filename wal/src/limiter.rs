//! A token bucket in bytes per second for reads of the WAL that must not
//! starve live appends and replication of disk and CPU: the catch-up
//! streams a leader serves (`walship-shipping`) and the pages DataPlane
//! tasks read (`verify`, `export`). Each user holds its own bucket.

use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

pub struct RateLimiter {
    bytes_per_s: f64,
    /// Tokens may accumulate up to this many bytes (a 100 ms burst).
    burst: f64,
    /// Tokens (negative: debt) and when they were counted.
    state: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    /// `bytes_per_s == 0` means unlimited.
    pub fn new(bytes_per_s: u64) -> RateLimiter {
        let rate = bytes_per_s as f64;
        RateLimiter { bytes_per_s: rate, burst: rate / 10.0, state: Mutex::new((rate / 10.0, Instant::now())) }
    }

    /// No limit.
    pub fn unlimited() -> RateLimiter {
        RateLimiter::new(0)
    }

    /// Bytes per second, 0 for unlimited.
    pub fn bytes_per_s(&self) -> u64 {
        self.bytes_per_s as u64
    }

    /// Takes `bytes` from the budget, waiting while it is in debt: a read
    /// larger than the tokens left goes through and the caller waits until
    /// the debt is paid, so the long-run rate holds whatever the sizes.
    /// Cancellation-safe: a dropped wait has already charged the bytes.
    pub async fn acquire(&self, bytes: usize) {
        if self.bytes_per_s <= 0.0 {
            return;
        }
        let wait = {
            let mut state = self.state.lock().await;
            let now = Instant::now();
            let refill = now.duration_since(state.1).as_secs_f64() * self.bytes_per_s;
            state.0 = (state.0 + refill).min(self.burst) - bytes as f64;
            state.1 = now;
            if state.0 < 0.0 { Duration::from_secs_f64(-state.0 / self.bytes_per_s) } else { Duration::ZERO }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_burst_is_free_and_debt_is_paid_in_time() {
        let limiter = RateLimiter::new(1_000);
        let start = Instant::now();
        limiter.acquire(100).await; // the initial burst
        assert_eq!(start.elapsed(), Duration::ZERO);
        limiter.acquire(500).await;
        // 500 bytes at 1,000 B/s: half a second of debt.
        assert_eq!(start.elapsed(), Duration::from_millis(500));
    }

    #[tokio::test(start_paused = true)]
    async fn the_long_run_rate_holds_across_callers() {
        let limiter = std::sync::Arc::new(RateLimiter::new(10_000));
        let start = Instant::now();
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let limiter = limiter.clone();
                tokio::spawn(async move {
                    for _ in 0..10 {
                        limiter.acquire(1_000).await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        // 40,000 bytes at 10,000 B/s, less the 1,000-byte initial burst.
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(3_900) && elapsed <= Duration::from_millis(4_000), "{elapsed:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_time_refills_only_up_to_the_burst() {
        let limiter = RateLimiter::new(1_000);
        tokio::time::sleep(Duration::from_secs(60)).await;
        let start = Instant::now();
        limiter.acquire(100).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        limiter.acquire(100).await;
        assert_eq!(start.elapsed(), Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn zero_rate_is_unlimited() {
        let limiter = RateLimiter::unlimited();
        let start = Instant::now();
        limiter.acquire(1 << 30).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(limiter.bytes_per_s(), 0);
    }
}
