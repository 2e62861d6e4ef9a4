//! A token bucket in bytes per second, shared by every catch-up stream a
//! node serves, so catch-up cannot starve the live append path.

use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::Mutex;

pub struct RateLimiter {
    bytes_per_s: f64,
    /// Tokens may accumulate up to this many bytes (a 100 ms burst).
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    /// `bytes_per_s == 0` means unlimited.
    pub fn new(bytes_per_s: u64) -> RateLimiter {
        let rate = bytes_per_s as f64;
        RateLimiter { bytes_per_s: rate, burst: rate / 10.0, state: Mutex::new((rate / 10.0, Instant::now())) }
    }

    /// Waits until `bytes` may be sent. Cancellation-safe: a dropped wait
    /// has already charged the bytes, which errs on the side of less
    /// catch-up traffic.
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
    async fn debt_is_paid_in_time() {
        let limiter = RateLimiter::new(1_000);
        let start = tokio::time::Instant::now();
        limiter.acquire(100).await; // the initial burst
        assert_eq!(start.elapsed(), Duration::ZERO);
        limiter.acquire(500).await;
        // 500 bytes at 1,000 B/s: half a second of debt.
        assert!(start.elapsed() >= Duration::from_millis(499), "{:?}", start.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn zero_rate_is_unlimited() {
        let limiter = RateLimiter::new(0);
        let start = tokio::time::Instant::now();
        limiter.acquire(1 << 30).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
    }
}
