//! Write unavailability when the leader dies: clients append continuously,
//! the process leading the log is killed with SIGKILL, and the window runs
//! from the kill to the first acknowledgement of an append *issued after*
//! it (an append in flight at the kill may still be answered by the dying
//! leader's peers; it does not count).
//!
//! Every client retries at once after an error; each attempt gives up
//! after [`ATTEMPT`], and the next may go to another server (see the
//! systems' `failover_appenders`), so the figure is how long the system
//! needs to elect and serve from a new leader, resolved to a few
//! milliseconds. Systems without automatic failover report none.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use bytes::Bytes;
use parking_lot::Mutex;

use crate::system::Cluster;

/// How long one append attempt may take during the failover measurement.
pub const ATTEMPT: Duration = Duration::from_millis(500);
/// Steady appends before the kill.
const BEFORE: Duration = Duration::from_millis(1500);
/// The longest wait for the first acknowledgement after the kill.
const GIVE_UP: Duration = Duration::from_secs(30);

/// One kill.
#[derive(Debug, Clone)]
pub struct Trial {
    /// The process killed.
    pub killed: String,
    /// Kill to first acknowledgement of an append issued after it.
    pub unavailable_ms: f64,
    /// Appends acknowledged before the kill (the load was really running).
    pub acked_before: u64,
    /// Failed attempts while the leader was gone.
    pub failed_attempts: u64,
}

/// Runs one trial on a fresh `cluster`; `None` when it cannot fail over.
pub async fn trial(cluster: &mut Box<dyn Cluster>, clients: usize, size: usize) -> Result<Option<Trial>> {
    let appenders = cluster.failover_appenders(clients).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    // (kill time, first ack of an append issued after it)
    let window: Arc<Mutex<(Option<Instant>, Option<Instant>)>> = Arc::default();
    let payload = Bytes::from(vec![0x5Au8; size]);
    let mut tasks = Vec::new();
    for appender in appenders {
        let (stop, acked, failed, window, payload) =
            (stop.clone(), acked.clone(), failed.clone(), window.clone(), payload.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let issued = Instant::now();
                match appender.append(payload.clone()).await {
                    Ok(()) => {
                        let now = Instant::now();
                        let mut w = window.lock();
                        match w.0 {
                            Some(killed) if issued > killed => {
                                w.1 = Some(w.1.map_or(now, |first| first.min(now)));
                            }
                            Some(_) => {}
                            None => {
                                acked.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Err(_) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
        }));
    }
    tokio::time::sleep(BEFORE).await;
    let acked_before = acked.load(Ordering::Relaxed);
    let failed_before = failed.load(Ordering::Relaxed);
    let killed = match cluster.kill_leader().await {
        Ok(Some(name)) => name,
        other => {
            stop.store(true, Ordering::Relaxed);
            for task in tasks {
                let _ = task.await;
            }
            return other.map(|_| None);
        }
    };
    let killed_at = Instant::now();
    window.lock().0 = Some(killed_at);
    let deadline = killed_at + GIVE_UP;
    let first = loop {
        if let Some(first) = window.lock().1 {
            break Some(first);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }
    let Some(first) = first else { bail!("{killed} killed: no append acknowledged within {GIVE_UP:?}") };
    if acked_before == 0 {
        bail!("no append was acknowledged before the kill: the load never ran");
    }
    Ok(Some(Trial {
        killed,
        unavailable_ms: (first - killed_at).as_secs_f64() * 1e3,
        acked_before,
        failed_attempts: failed.load(Ordering::Relaxed) - failed_before,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::system::Appender;
    use async_trait::async_trait;

    /// A cluster whose appends fail from the kill until `outage` later.
    struct Fake {
        killed_at: Arc<Mutex<Option<Instant>>>,
        outage: Duration,
        fails_over: bool,
    }

    struct FakeAppender {
        killed_at: Arc<Mutex<Option<Instant>>>,
        outage: Duration,
    }

    #[async_trait]
    impl Appender for FakeAppender {
        async fn append(&self, _payload: Bytes) -> Result<()> {
            tokio::time::sleep(Duration::from_millis(1)).await;
            match *self.killed_at.lock() {
                Some(at) if at.elapsed() < self.outage => bail!("no leader"),
                _ => Ok(()),
            }
        }
    }

    #[async_trait]
    impl Cluster for Fake {
        async fn appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
            Ok((0..clients)
                .map(|_| {
                    Arc::new(FakeAppender { killed_at: self.killed_at.clone(), outage: self.outage })
                        as Arc<dyn Appender>
                })
                .collect())
        }
        async fn stop(self: Box<Self>) -> Result<()> {
            Ok(())
        }
        async fn kill_leader(&mut self) -> Result<Option<String>> {
            if !self.fails_over {
                return Ok(None);
            }
            *self.killed_at.lock() = Some(Instant::now());
            Ok(Some("leader".into()))
        }
    }

    #[tokio::test]
    async fn measures_the_outage_from_the_kill_to_the_first_new_ack() {
        let outage = Duration::from_millis(300);
        let mut cluster: Box<dyn Cluster> = Box::new(Fake { killed_at: Arc::default(), outage, fails_over: true });
        let trial = trial(&mut cluster, 4, 100).await.unwrap().unwrap();
        assert_eq!(trial.killed, "leader");
        // At least the outage; the upper bound only catches a gross
        // miscount (a loaded machine delays the first new ack by itself).
        assert!(
            (300.0..2_000.0).contains(&trial.unavailable_ms),
            "measured {} ms for a 300 ms outage",
            trial.unavailable_ms
        );
        assert!(trial.acked_before > 0);
        assert!(trial.failed_attempts > 0, "the clients kept trying during the outage");
    }

    #[tokio::test]
    async fn a_system_without_failover_reports_none() {
        let mut cluster: Box<dyn Cluster> =
            Box::new(Fake { killed_at: Arc::default(), outage: Duration::ZERO, fails_over: false });
        assert!(trial(&mut cluster, 2, 100).await.unwrap().is_none());
    }
}
