//! The one load generator every system is driven by: the shared drivers of
//! `walship-loadgen` (closed and open loop, see there) over the systems'
//! [`Appender`]s. Payloads are random bytes (incompressible), one buffer per
//! client.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use rand::RngCore;
use walship_loadgen::Measured;

use crate::system::Appender;

fn random_payload(size: usize) -> Bytes {
    let mut bytes = vec![0u8; size];
    rand::thread_rng().fill_bytes(&mut bytes);
    Bytes::from(bytes)
}

/// Client `i` appends its own payload through `appenders[i]`.
fn append_op(
    appenders: Vec<Arc<dyn Appender>>,
    size: usize,
) -> impl Fn(usize) -> futures::future::BoxFuture<'static, Result<()>> + Send + Sync + 'static {
    let payloads: Vec<Bytes> = appenders.iter().map(|_| random_payload(size)).collect();
    move |client| {
        let (appender, payload) = (appenders[client].clone(), payloads[client].clone());
        Box::pin(async move { appender.append(payload).await })
    }
}

/// Closed loop: every appender appends back to back.
pub async fn closed(
    appenders: Vec<Arc<dyn Appender>>,
    size: usize,
    warmup: Duration,
    duration: Duration,
) -> Result<Measured> {
    let clients = appenders.len();
    walship_loadgen::closed(clients, warmup, duration, append_op(appenders, size)).await
}

/// Open loop: `rate` arrivals per second served by the appenders.
pub async fn open(
    appenders: Vec<Arc<dyn Appender>>,
    size: usize,
    rate: f64,
    warmup: Duration,
    duration: Duration,
) -> Result<Measured> {
    let clients = appenders.len();
    walship_loadgen::open(clients, rate, warmup, duration, append_op(appenders, size)).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use std::sync::Mutex;

    /// Records which payload each append carried.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<Bytes>>);

    #[async_trait]
    impl Appender for Recorder {
        async fn append(&self, payload: Bytes) -> Result<()> {
            self.0.lock().unwrap().push(payload);
            tokio::task::yield_now().await;
            Ok(())
        }
    }

    #[tokio::test]
    async fn each_client_appends_its_own_random_payload_of_the_size() {
        let recorders: Vec<Arc<Recorder>> = (0..3).map(|_| Arc::new(Recorder::default())).collect();
        let appenders: Vec<Arc<dyn Appender>> = recorders.iter().map(|r| r.clone() as Arc<dyn Appender>).collect();
        let m = closed(appenders, 4096, Duration::ZERO, Duration::from_millis(50)).await.unwrap();
        assert!(!m.latency_us.is_empty());
        let firsts: Vec<Bytes> = recorders.iter().map(|r| r.0.lock().unwrap()[0].clone()).collect();
        for (r, first) in recorders.iter().zip(&firsts) {
            let seen = r.0.lock().unwrap();
            assert!(seen.iter().all(|p| p.len() == 4096 && p == first), "one payload per client");
        }
        assert_ne!(firsts[0], firsts[1], "clients' payloads differ (random)");
        assert!(firsts[0].iter().any(|&b| b != firsts[0][0]), "payload bytes vary");
    }
}
