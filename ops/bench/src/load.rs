//! The one load generator every system is driven by.
//!
//! * Closed loop (`closed`): `clients` tasks, each appending one record
//!   and waiting for its acknowledgement before the next — the shape of a
//!   database client that needs each write acknowledged. Throughput and
//!   latency are what that concurrency gets.
//! * Open loop (`open`): arrivals at a fixed rate, served by a pool of
//!   clients; latency counts from the arrival's scheduled time, so time an
//!   arrival waits for a free client is included (no coordinated omission).
//!
//! Both warm up first (not measured), then measure for a fixed duration.
//! A failed append fails the cell: every system here is expected to
//! acknowledge every write.
//! Payloads are random bytes (incompressible), one buffer per client.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use rand::RngCore;

use crate::system::Appender;

/// Latencies in microseconds, from 1 µs to 60 s, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

/// What one measurement produced.
pub struct Measured {
    pub latency_us: Histogram<u64>,
    pub seconds: f64,
}

fn random_payload(size: usize) -> Bytes {
    let mut bytes = vec![0u8; size];
    rand::thread_rng().fill_bytes(&mut bytes);
    Bytes::from(bytes)
}

/// Closed loop: every appender appends back to back.
pub async fn closed(
    appenders: Vec<Arc<dyn Appender>>,
    size: usize,
    warmup: Duration,
    duration: Duration,
) -> Result<Measured> {
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for appender in appenders {
        let (measuring, stop) = (measuring.clone(), stop.clone());
        let payload = random_payload(size);
        tasks.push(tokio::spawn(async move {
            let mut lat = histogram();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                appender.append(payload.clone()).await?;
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

/// Open loop: `rate` arrivals per second spread evenly, served by the
/// appenders; each latency runs from the arrival's scheduled time to its
/// acknowledgement.
pub async fn open(
    appenders: Vec<Arc<dyn Appender>>,
    size: usize,
    rate: f64,
    warmup: Duration,
    duration: Duration,
) -> Result<Measured> {
    if !(rate.is_finite() && rate > 0.0) {
        bail!("open-loop rate must be positive, got {rate}");
    }
    let (tx, rx) = flume::unbounded::<(Instant, bool)>();
    let mut tasks = Vec::new();
    for appender in appenders {
        let rx = rx.clone();
        let payload = random_payload(size);
        tasks.push(tokio::spawn(async move {
            let mut lat = histogram();
            while let Ok((scheduled, measured)) = rx.recv_async().await {
                appender.append(payload.clone()).await?;
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
    scheduler.join().map_err(|_| anyhow::anyhow!("the arrival scheduler panicked"))?;
    let seconds = duration.as_secs_f64();
    Ok(Measured { latency_us: total, seconds })
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use std::sync::atomic::AtomicU64;

    /// Acknowledges after a fixed delay, counting appends.
    struct Fixed(Duration, AtomicU64);

    #[async_trait]
    impl Appender for Fixed {
        async fn append(&self, payload: Bytes) -> Result<()> {
            assert_eq!(payload.len(), 100);
            tokio::time::sleep(self.0).await;
            self.1.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    #[tokio::test]
    async fn closed_loop_counts_what_the_clients_got() {
        let fixed = Arc::new(Fixed(Duration::from_millis(10), AtomicU64::new(0)));
        let appenders: Vec<Arc<dyn Appender>> = (0..4).map(|_| fixed.clone() as Arc<dyn Appender>).collect();
        let m = closed(appenders, 100, Duration::from_millis(100), Duration::from_millis(500)).await.unwrap();
        // Four clients at ~10 ms each for 0.5 s: about 200 appends, never more.
        let n = m.latency_us.len();
        assert!((100..=210).contains(&n), "{n} appends measured");
        assert!(m.latency_us.value_at_quantile(0.5) >= 10_000);
        assert!(fixed.1.load(Ordering::Relaxed) > n, "warm-up appends are not measured");
    }

    #[tokio::test]
    async fn open_loop_keeps_its_rate_and_counts_queueing() {
        let fixed = Arc::new(Fixed(Duration::from_millis(5), AtomicU64::new(0)));
        let appenders: Vec<Arc<dyn Appender>> = (0..8).map(|_| fixed.clone() as Arc<dyn Appender>).collect();
        let m = open(appenders, 100, 200.0, Duration::from_millis(100), Duration::from_millis(500)).await.unwrap();
        let n = m.latency_us.len();
        assert!((95..=105).contains(&n), "{n} arrivals measured at 200/s over 0.5 s");
        assert!(m.latency_us.value_at_quantile(0.5) >= 5_000);

        // One client at 5 ms per append cannot serve 400/s: arrivals queue
        // and their latency, counted from the schedule, grows far past 5 ms.
        let slow: Vec<Arc<dyn Appender>> = vec![fixed.clone()];
        let m = open(slow, 100, 400.0, Duration::ZERO, Duration::from_millis(300)).await.unwrap();
        assert!(m.latency_us.value_at_quantile(0.99) > 50_000, "p99 {} µs", m.latency_us.value_at_quantile(0.99));
    }

    #[tokio::test]
    async fn open_loop_refuses_a_non_positive_rate() {
        let err = open(Vec::new(), 100, 0.0, Duration::ZERO, Duration::from_millis(10)).await.err().unwrap();
        assert!(err.to_string().contains("rate"), "{err}");
    }
}
