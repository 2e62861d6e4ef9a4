//! Load drivers shared by `walship bench` and `walship-compare`.
//!
//! * [`closed`]: `clients` tasks, each running one operation and waiting for
//!   it before the next — the shape of a database client that needs each
//!   write acknowledged. Throughput and latency are what that concurrency
//!   gets.
//! * [`open`]: arrivals at a fixed rate, served by a pool of clients;
//!   latency counts from each arrival's scheduled time, so time an arrival
//!   waits for a free client is included (no coordinated omission).
//!
//! Both warm up first (not measured), then measure for a fixed duration. A
//! failed operation fails the run: the systems measured are expected to
//! acknowledge every write. Nothing here asserts a speed.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use hdrhistogram::Histogram;
use serde::Serialize;

/// Latencies in microseconds, from 1 µs to 60 s, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

/// What one measurement produced.
pub struct Measured {
    pub latency_us: Histogram<u64>,
    /// Length of the measured window.
    pub seconds: f64,
}

/// The usual figures of a measurement of `record_bytes`-sized operations.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub records_per_s: f64,
    pub mib_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

impl Measured {
    pub fn summary(&self, record_bytes: usize) -> Summary {
        let records_per_s = self.latency_us.len() as f64 / self.seconds;
        let quantile = |q| self.latency_us.value_at_quantile(q) as f64;
        Summary {
            records_per_s,
            mib_per_s: records_per_s * record_bytes as f64 / (1 << 20) as f64,
            p50_us: quantile(0.5),
            p99_us: quantile(0.99),
            p999_us: quantile(0.999),
        }
    }
}

/// Closed loop: `clients` tasks run `op(client)` back to back.
pub async fn closed<F, Fut>(clients: usize, warmup: Duration, duration: Duration, op: F) -> Result<Measured>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<()>> + Send,
{
    let op = Arc::new(op);
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (op, measuring, stop) = (op.clone(), measuring.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = histogram();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                op(client).await?;
                if measuring.load(Ordering::Relaxed) {
                    lat.record(t.elapsed().as_micros().max(1) as u64)?;
                }
            }
            anyhow::Ok(lat)
        }));
    }
    tokio::time::sleep(warmup).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    measuring.store(false, Ordering::Relaxed);
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut total = histogram();
    for task in tasks {
        total.add(task.await??)?;
    }
    Ok(Measured { latency_us: total, seconds })
}

/// Open loop: `rate` arrivals per second spread evenly, each served by the
/// next free one of `clients` tasks running `op(client)`; each latency runs
/// from the arrival's scheduled time to the end of its operation.
pub async fn open<F, Fut>(clients: usize, rate: f64, warmup: Duration, duration: Duration, op: F) -> Result<Measured>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<()>> + Send,
{
    if !(rate.is_finite() && rate > 0.0) {
        bail!("open-loop rate must be positive, got {rate}");
    }
    if clients == 0 {
        bail!("open loop needs at least one client");
    }
    let op = Arc::new(op);
    let (tx, rx) = flume::unbounded::<(Instant, bool)>();
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (op, rx) = (op.clone(), rx.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = histogram();
            while let Ok((scheduled, measured)) = rx.recv_async().await {
                op(client).await?;
                if measured {
                    lat.record(scheduled.elapsed().as_micros().max(1) as u64)?;
                }
            }
            anyhow::Ok(lat)
        }));
    }
    drop(rx);
    // The arrivals come from a plain thread sleeping on the kernel's
    // high-resolution timers: tokio's timer ticks in milliseconds, and
    // released arrivals in 1 ms bursts, which put up to a millisecond of the
    // generator's own granularity into every latency measured from the
    // schedule. Each arrival carries its scheduled time.
    let interval = Duration::from_secs_f64(1.0 / rate);
    let scheduler = std::thread::spawn(move || {
        let start = Instant::now();
        let measure_from = start + warmup;
        let end = measure_from + duration;
        let mut next = start;
        while next < end {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            if tx.send((next, next >= measure_from)).is_err() {
                break;
            }
            next += interval;
        }
    });
    let mut total = histogram();
    for task in tasks {
        total.add(task.await??)?;
    }
    scheduler.join().map_err(|_| anyhow!("the arrival scheduler panicked"))?;
    Ok(Measured { latency_us: total, seconds: duration.as_secs_f64() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// An operation that takes `delay` and counts itself.
    fn fixed(
        delay: Duration,
        count: Arc<AtomicU64>,
    ) -> impl Fn(usize) -> std::pin::Pin<Box<dyn Future<Output = Result<()>> + Send>> + Send + Sync + 'static {
        move |_| {
            let count = count.clone();
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                count.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
        }
    }

    #[tokio::test]
    async fn closed_loop_counts_what_the_clients_got() {
        let count = Arc::new(AtomicU64::new(0));
        let m = closed(
            4,
            Duration::from_millis(100),
            Duration::from_millis(500),
            fixed(Duration::from_millis(10), count.clone()),
        )
        .await
        .unwrap();
        // Four clients at ~10 ms each for 0.5 s: about 200 operations, never more.
        let n = m.latency_us.len();
        assert!((100..=210).contains(&n), "{n} operations measured");
        assert!(m.latency_us.value_at_quantile(0.5) >= 10_000);
        assert!(count.load(Ordering::Relaxed) > n, "warm-up operations are not measured");
        let s = m.summary(100);
        assert!((s.records_per_s - n as f64 / m.seconds).abs() < 1e-9);
        assert!((s.mib_per_s - s.records_per_s * 100.0 / 1048576.0).abs() < 1e-9);
        assert!(s.p50_us <= s.p99_us && s.p99_us <= s.p999_us);
    }

    #[tokio::test]
    async fn open_loop_keeps_its_rate_and_counts_queueing() {
        let count = Arc::new(AtomicU64::new(0));
        let m = open(
            8,
            200.0,
            Duration::from_millis(100),
            Duration::from_millis(500),
            fixed(Duration::from_millis(5), count.clone()),
        )
        .await
        .unwrap();
        let n = m.latency_us.len();
        assert!((95..=105).contains(&n), "{n} arrivals measured at 200/s over 0.5 s");
        assert!(m.latency_us.value_at_quantile(0.5) >= 5_000);

        // One client at 5 ms per operation cannot serve 400/s: arrivals
        // queue and their latency, counted from the schedule, grows far past
        // 5 ms.
        let m = open(1, 400.0, Duration::ZERO, Duration::from_millis(300), fixed(Duration::from_millis(5), count))
            .await
            .unwrap();
        assert!(m.latency_us.value_at_quantile(0.99) > 50_000, "p99 {} µs", m.latency_us.value_at_quantile(0.99));
    }

    #[tokio::test]
    async fn open_loop_refuses_a_non_positive_rate_or_no_clients() {
        let count = Arc::new(AtomicU64::new(0));
        let op = fixed(Duration::ZERO, count.clone());
        let err = open(1, 0.0, Duration::ZERO, Duration::from_millis(10), op).await.err().unwrap();
        assert!(err.to_string().contains("rate"), "{err}");
        let err = open(0, 10.0, Duration::ZERO, Duration::from_millis(10), fixed(Duration::ZERO, count.clone()))
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("client"), "{err}");
        assert_eq!(count.load(Ordering::Relaxed), 0, "a refused run runs nothing");
    }

    #[tokio::test]
    async fn a_failed_operation_fails_the_run() {
        let err = closed(2, Duration::ZERO, Duration::from_millis(50), |client| async move {
            if client == 1 {
                return Err(anyhow!("refused by the system"));
            }
            tokio::task::yield_now().await;
            Ok(())
        })
        .await
        .err()
        .unwrap();
        assert!(err.to_string().contains("refused"), "{err}");
    }
}
