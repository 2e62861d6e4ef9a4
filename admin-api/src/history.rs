//! The coordinator's short lag history: one sample a second of every
//! follower's lag (as `GET /v1/shards` shows it; less often when a pass over
//! every shard is costly, see [`sample_interval`]), the last 900 samples at
//! most, so the dashboard draws a chart the moment it opens. Memory is
//! bounded: [`MAX_SAMPLES`] per follower of each shard (under 64 KiB),
//! series of replicas that left a shard's replica set dropped. Consecutive
//! samples of equal lag are kept as one run (an idle, caught-up follower
//! costs one run, not 900 samples: 10,000 shards' followers fit in a few
//! MiB), and read back as one sample a second. It also keeps, for followers
//! whose lag is stale, when the leader accepted the oldest record each
//! lacks (one entry per such follower), so their lag in seconds is the age
//! of that record.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use crate::models::LagSample;

/// How often the coordinator samples lag, at most (see [`sample_interval`]).
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);

/// A pass over every shard may cost at most one part in this of the
/// coordinator's time.
const SAMPLING_SHARE: u32 = 200;

/// How long to wait after a pass that took `pass` (computing the lags and
/// recording them, not the fetches that follow): [`SAMPLE_INTERVAL`], or
/// longer when a pass is costly, so sampling takes at most 0.5 % of a
/// core. At 10,000 shards a pass that built each shard's whole view took
/// about 80 ms (release build) and sampling every second was most of an
/// idle coordinator's CPU; a pass that computes only the lags, under one
/// lock, and records them takes about 10 ms, a fifth of an idle
/// coordinator's CPU once a second (2026-12-06): every 2 s there.
pub fn sample_interval(pass: Duration) -> Duration {
    SAMPLE_INTERVAL.max(pass * SAMPLING_SHARE)
}
/// Samples kept per follower: 15 minutes at one a second.
pub const MAX_SAMPLES: usize = 900;

/// Consecutive samples of the same lag: the first as taken, `count` in
/// all, the last taken at `last_at_unix_ms` (the ones between spread
/// evenly between the two when read).
struct Run {
    first: LagSample,
    count: usize,
    last_at_unix_ms: u64,
}

impl Run {
    fn same_lag(a: &LagSample, b: &LagSample) -> bool {
        a.lag_records == b.lag_records
            && a.lag_bytes == b.lag_bytes
            && a.lag_seconds == b.lag_seconds
            && a.stale == b.stale
    }

    /// The `k`th sample of the run.
    fn sample(&self, k: usize) -> LagSample {
        let span = self.last_at_unix_ms.saturating_sub(self.first.at_unix_ms);
        let at = match self.count {
            0 | 1 => self.first.at_unix_ms,
            n => self.first.at_unix_ms + span * k as u64 / (n as u64 - 1),
        };
        LagSample { at_unix_ms: at, ..self.first.clone() }
    }
}

/// One follower's samples, as runs.
#[derive(Default)]
struct Series {
    runs: VecDeque<Run>,
    samples: usize,
    /// The pass that last sampled it.
    pass: u64,
}

impl Series {
    /// Adds a sample, dropping the oldest past [`MAX_SAMPLES`].
    fn push(&mut self, sample: LagSample) {
        match self.runs.back_mut() {
            Some(run) if Run::same_lag(&run.first, &sample) => {
                run.count += 1;
                run.last_at_unix_ms = sample.at_unix_ms;
            }
            _ => self.runs.push_back(Run { last_at_unix_ms: sample.at_unix_ms, first: sample, count: 1 }),
        }
        self.samples += 1;
        while self.samples > MAX_SAMPLES {
            let front = self.runs.front_mut().expect("samples are in runs");
            if front.count == 1 {
                self.runs.pop_front();
            } else {
                front.first.at_unix_ms = front.sample(1).at_unix_ms;
                front.count -= 1;
            }
            self.samples -= 1;
        }
    }
}

/// Every follower's series, keyed `(shard, node)`, and how many passes
/// have been recorded.
#[derive(Default)]
struct Passes {
    series: BTreeMap<(u32, u32), Series>,
    done: u64,
}

#[derive(Default)]
pub struct LagHistory {
    series: Mutex<Passes>,
    /// The current interval between samples, in ms (0: not set yet).
    interval_ms: std::sync::atomic::AtomicU64,
    /// `(shard, seqno)` -> unix µs its leader accepted that record.
    written_us: Mutex<BTreeMap<(u32, u64), u64>>,
}

impl LagHistory {
    /// Records one pass: a sample of each follower `(shard, node)` as it
    /// is now. Series of replicas the pass did not sample (no longer
    /// followers) are dropped. One lock for the whole pass.
    pub fn record_pass(&self, samples: impl IntoIterator<Item = ((u32, u32), LagSample)>) {
        let mut passes = self.series.lock().expect("lag history lock");
        passes.done += 1;
        let pass = passes.done;
        for (key, sample) in samples {
            let series = passes.series.entry(key).or_default();
            series.push(sample);
            series.pass = pass;
        }
        passes.series.retain(|_, s| s.pass == pass);
    }

    /// The interval between samples now (see [`sample_interval`]).
    pub fn interval(&self) -> Duration {
        match self.interval_ms.load(std::sync::atomic::Ordering::Relaxed) {
            0 => SAMPLE_INTERVAL,
            ms => Duration::from_millis(ms),
        }
    }

    pub fn set_interval(&self, interval: Duration) {
        self.interval_ms.store(interval.as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// The samples of every follower of `shard` newer than `since_unix_ms`,
    /// oldest first.
    pub fn of_shard(&self, shard: u32, since_unix_ms: u64) -> Vec<(u32, Vec<LagSample>)> {
        self.series
            .lock()
            .expect("lag history lock")
            .series
            .range((shard, 0)..=(shard, u32::MAX))
            .map(|(&(_, node), s)| {
                let samples = s.runs.iter().flat_map(|run| (0..run.count).map(|k| run.sample(k)));
                (node, samples.filter(|x| x.at_unix_ms >= since_unix_ms).collect())
            })
            .collect()
    }

    /// When the leader accepted record `seqno` of `shard`, if fetched.
    pub fn written_us(&self, shard: u32, seqno: u64) -> Option<u64> {
        self.written_us.lock().expect("lag history lock").get(&(shard, seqno)).copied()
    }

    /// Replaces the write times kept (only those still needed).
    pub fn set_written(&self, times: BTreeMap<(u32, u64), u64>) {
        *self.written_us.lock().expect("lag history lock") = times;
    }

    /// Samples held, every series (for tests of the bound).
    pub fn len(&self) -> usize {
        self.series.lock().expect("lag history lock").series.values().map(|s| s.samples).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costly_passes_sample_less_often() {
        assert_eq!(sample_interval(Duration::from_millis(2)), SAMPLE_INTERVAL, "a cheap pass: every second");
        assert_eq!(sample_interval(Duration::from_millis(5)), SAMPLE_INTERVAL);
        assert_eq!(sample_interval(Duration::from_millis(10)), Duration::from_secs(2), "at most 0.5 % of a core");
        assert_eq!(sample_interval(Duration::from_millis(80)), Duration::from_secs(16));
        let h = LagHistory::default();
        assert_eq!(h.interval(), SAMPLE_INTERVAL, "before the first pass");
        h.set_interval(Duration::from_secs(4));
        assert_eq!(h.interval(), Duration::from_secs(4));
    }

    fn sample(at: u64) -> LagSample {
        LagSample { at_unix_ms: at, lag_records: Some(at), lag_bytes: None, lag_seconds: Some(0.0), stale: false }
    }

    #[test]
    fn each_series_keeps_at_most_fifteen_minutes() {
        let h = LagHistory::default();
        for at in 0..(3 * MAX_SAMPLES as u64) {
            h.record_pass([((1, 2), sample(at)), ((1, 3), sample(at))]);
        }
        assert_eq!(h.len(), 2 * MAX_SAMPLES);
        let series = h.of_shard(1, 0);
        assert_eq!(series.iter().map(|(n, _)| *n).collect::<Vec<_>>(), vec![2, 3]);
        // The newest are kept, oldest first.
        assert_eq!(series[0].1.first().unwrap().at_unix_ms, 2 * MAX_SAMPLES as u64);
        assert_eq!(series[0].1.last().unwrap().at_unix_ms, 3 * MAX_SAMPLES as u64 - 1);
        assert!(h.of_shard(2, 0).is_empty());
        assert_eq!(h.of_shard(1, 3 * MAX_SAMPLES as u64 - 10)[0].1.len(), 10);
    }

    #[test]
    fn a_follower_costs_at_most_64_kib() {
        assert!(std::mem::size_of::<LagSample>() * MAX_SAMPLES <= 64 << 10);
    }

    #[test]
    fn equal_samples_are_one_run_and_read_back_one_a_second() {
        let h = LagHistory::default();
        let idle = |at| LagSample {
            at_unix_ms: at,
            lag_records: Some(0),
            lag_bytes: Some(0),
            lag_seconds: Some(0.0),
            stale: false,
        };
        for k in 0..(2 * MAX_SAMPLES as u64) {
            h.record_pass([((1, 2), idle(k * 1_000))]);
        }
        h.record_pass([((1, 2), sample(5_000_000))]);
        assert_eq!(h.series.lock().unwrap().series[&(1, 2)].runs.len(), 2, "one run of idle samples, one other");
        assert_eq!(h.len(), MAX_SAMPLES);
        let read = &h.of_shard(1, 0)[0].1;
        assert_eq!(read.len(), MAX_SAMPLES);
        // The newest idle samples, one a second, then the last one.
        assert_eq!(read[0].at_unix_ms, (MAX_SAMPLES as u64 + 1) * 1_000);
        assert_eq!(read[1].at_unix_ms - read[0].at_unix_ms, 1_000);
        assert_eq!(read[MAX_SAMPLES - 2].at_unix_ms, (2 * MAX_SAMPLES as u64 - 1) * 1_000);
        assert_eq!(read[MAX_SAMPLES - 1].at_unix_ms, 5_000_000);
        assert_eq!(read[MAX_SAMPLES - 1].lag_records, Some(5_000_000));
    }

    #[test]
    fn series_of_replicas_that_left_are_dropped() {
        let h = LagHistory::default();
        h.record_pass([((1, 2), sample(1)), ((1, 3), sample(1))]);
        h.record_pass([((1, 3), sample(2))]);
        assert_eq!(h.of_shard(1, 0).iter().map(|(n, _)| *n).collect::<Vec<_>>(), vec![3]);
        assert_eq!(h.of_shard(1, 0)[0].1.len(), 2, "the follower that stayed keeps its samples");
    }
}
