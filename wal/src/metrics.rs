//! The WAL's Prometheus metrics. Registered on the registry the node exposes
//! at `/metrics`; see `ops/METRICS.md` for the catalogue. Every family is
//! created (with its labels' children where they are fixed) when the WAL
//! starts, so a scrape shows it before anything happened.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use crate::zero_fill::Rotations;

use crate::store::ShardId;

/// Metrics of one node's WAL.
#[derive(Clone)]
pub struct WalMetrics {
    /// Latency of one group commit's write + fdatasync (raft-engine does both
    /// in one call).
    pub fsync_seconds: Histogram,
    /// Records made durable by one group commit.
    pub group_commit_records: Histogram,
    pub records_appended: IntCounter,
    /// Encoded frame bytes appended.
    pub bytes_appended: IntCounter,
    /// Appends sequenced and waiting for the group commit that makes them durable.
    pub queue_depth: IntGauge,
    /// Encoded bytes sequenced and not yet durable.
    pub staged_bytes: IntGauge,
    /// Appends that waited because more than `max_batch_bytes` was staged.
    pub staged_waits: IntCounter,
    /// Bytes of newest frames cached in memory for all shards together.
    pub tail_cache_bytes: IntGauge,
    first_seqno: IntGaugeVec,
    last_seqno: IntGaugeVec,
    durable_seqno: IntGaugeVec,
    /// Records known to be corrupt now, per shard (the corruption registry).
    pub corrupt_records: IntGaugeVec,
    /// New corrupt ranges found, by how: read, scrub or startup.
    pub corruption_detected: IntCounterVec,
    /// Frame bytes the scrubber read and verified.
    pub scrubbed_bytes: IntCounter,
    /// Unix time of the end of the last full scrub pass (0: none yet).
    pub scrub_last_pass: IntGauge,
    /// One series per shard for its positions; false (a node with
    /// thousands of shards): positions are not exported, and a shard's
    /// corrupt-records series appears only once it has corrupt records.
    pub per_shard: bool,
    /// Producer appends answered as duplicates (a retry of records already
    /// written: nothing written again).
    pub producer_duplicates: IntCounter,
    /// Producer appends refused, by reason: fenced, unknown, gap,
    /// forgotten, invalid, expected_last (a conditional append's mismatch),
    /// unavailable (the table is being repaired).
    pub producer_refusals: IntCounterVec,
    /// Producers forgotten by a shard's table, by reason: expired (idle
    /// past `producer_idle_expiry_s`) or evicted (past
    /// `producer_max_per_shard`).
    pub producers_forgotten: IntCounterVec,
    /// Producer snapshots written beside the log.
    pub producer_snapshots: IntCounter,
    /// Epoch and log-epoch raises made durable (fences, assignments).
    pub epoch_raises: IntCounter,
    /// Durable writes (one fsync each) that carried them: raises made at
    /// once share one.
    pub epoch_writes: IntCounter,
}

/// Cached per-shard gauge handles (a label lookup per commit is avoidable).
#[derive(Clone)]
pub(crate) struct ShardGauges {
    pub first_seqno: IntGauge,
    pub last_seqno: IntGauge,
    pub durable_seqno: IntGauge,
}

fn latency_buckets() -> Vec<f64> {
    // 25 µs .. ~13 s, doubling.
    prometheus::exponential_buckets(25e-6, 2.0, 20).expect("valid buckets")
}

impl WalMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<WalMetrics> {
        let fsync_seconds = Histogram::with_opts(
            HistogramOpts::new("walship_wal_fsync_seconds", "Latency of one group commit: WAL write plus fdatasync")
                .buckets(latency_buckets()),
        )?;
        let group_commit_records = Histogram::with_opts(
            HistogramOpts::new("walship_wal_group_commit_records", "Records made durable by one group commit")
                .buckets(prometheus::exponential_buckets(1.0, 2.0, 16)?),
        )?;
        let records_appended = IntCounter::new("walship_wal_records_appended_total", "Records written to the WAL")?;
        let bytes_appended =
            IntCounter::new("walship_wal_bytes_appended_total", "Encoded record bytes written to the WAL")?;
        let queue_depth = IntGauge::new(
            "walship_wal_queue_depth",
            "Appends sequenced and waiting for the group commit that makes them durable",
        )?;
        let staged_bytes = IntGauge::new(
            "walship_wal_staged_bytes",
            "Encoded bytes sequenced (shippable) and not yet durable on this node",
        )?;
        let staged_waits = IntCounter::new(
            "walship_wal_staged_waits_total",
            "Appends that waited because more than max_batch_bytes was sequenced and not yet durable",
        )?;
        let tail_cache_bytes = IntGauge::new(
            "walship_wal_tail_cache_bytes",
            "Bytes of the shards' newest frames this node keeps in memory for shippers and tails",
        )?;
        let shard_gauge = |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &["shard"]);
        let first_seqno = shard_gauge("walship_shard_first_seqno", "Oldest seqno retained in this node's WAL")?;
        let last_seqno = shard_gauge("walship_shard_last_seqno", "Newest seqno written to this node's WAL")?;
        let durable_seqno = shard_gauge("walship_shard_durable_seqno", "Newest seqno fsynced in this node's WAL")?;
        registry.register(Box::new(fsync_seconds.clone()))?;
        registry.register(Box::new(group_commit_records.clone()))?;
        registry.register(Box::new(records_appended.clone()))?;
        registry.register(Box::new(bytes_appended.clone()))?;
        registry.register(Box::new(queue_depth.clone()))?;
        registry.register(Box::new(staged_bytes.clone()))?;
        registry.register(Box::new(staged_waits.clone()))?;
        registry.register(Box::new(tail_cache_bytes.clone()))?;
        registry.register(Box::new(first_seqno.clone()))?;
        registry.register(Box::new(last_seqno.clone()))?;
        registry.register(Box::new(durable_seqno.clone()))?;
        let corrupt_records = shard_gauge(
            "walship_wal_corrupt_records",
            "Records of this node's WAL known to be corrupt now (found by reads, the scrubber or the start-up check; \
             cleared when truncated or compacted away)",
        )?;
        let corruption_detected = IntCounterVec::new(
            Opts::new(
                "walship_wal_corruption_detected_total",
                "Corrupt WAL record ranges found, by how: read, scrub, startup, or recovery (damage raft-engine's recovery cut away with the records after it)",
            ),
            &["how"],
        )?;
        let scrubbed_bytes =
            IntCounter::new("walship_wal_scrubbed_bytes_total", "Record bytes the WAL scrubber read and verified")?;
        let scrub_last_pass = IntGauge::new(
            "walship_wal_scrub_last_pass_timestamp_seconds",
            "Unix time the last full scrub pass over every shard's retained WAL ended (0: none yet)",
        )?;
        for how in ["read", "scrub", "startup", "recovery"] {
            corruption_detected.with_label_values(&[how]);
        }
        let producer_duplicates = IntCounter::new(
            "walship_producer_duplicates_total",
            "Producer appends answered as duplicates of records already written (nothing written again)",
        )?;
        let producer_refusals = IntCounterVec::new(
            Opts::new(
                "walship_producer_refusals_total",
                "Producer and conditional appends refused, by reason (fenced, unknown, gap, forgotten, invalid, \
                 expected_last, unavailable)",
            ),
            &["reason"],
        )?;
        for reason in
            ["fenced", "unknown", "gap", "forgotten", "forgotten_prefix", "invalid", "expected_last", "unavailable"]
        {
            producer_refusals.with_label_values(&[reason]);
        }
        let producers_forgotten = IntCounterVec::new(
            Opts::new(
                "walship_producers_forgotten_total",
                "Producers a shard's table forgot, by reason: expired (idle too long) or evicted (too many producers)",
            ),
            &["reason"],
        )?;
        for reason in ["expired", "evicted"] {
            producers_forgotten.with_label_values(&[reason]);
        }
        let producer_snapshots =
            IntCounter::new("walship_producer_snapshots_total", "Producer-table snapshots written beside the log")?;
        let epoch_raises = IntCounter::new(
            "walship_wal_epoch_raises_total",
            "Epoch and log-epoch raises made durable (fences and assignments)",
        )?;
        let epoch_writes = IntCounter::new(
            "walship_wal_epoch_writes_total",
            "Writes (one fsync each, none when nothing is raised) of epoch raises: raises made at once share one",
        )?;
        registry.register(Box::new(epoch_raises.clone()))?;
        registry.register(Box::new(epoch_writes.clone()))?;
        registry.register(Box::new(producer_duplicates.clone()))?;
        registry.register(Box::new(producer_refusals.clone()))?;
        registry.register(Box::new(producers_forgotten.clone()))?;
        registry.register(Box::new(producer_snapshots.clone()))?;
        registry.register(Box::new(corrupt_records.clone()))?;
        registry.register(Box::new(corruption_detected.clone()))?;
        registry.register(Box::new(scrubbed_bytes.clone()))?;
        registry.register(Box::new(scrub_last_pass.clone()))?;
        Ok(WalMetrics {
            fsync_seconds,
            group_commit_records,
            records_appended,
            bytes_appended,
            queue_depth,
            staged_bytes,
            staged_waits,
            tail_cache_bytes,
            first_seqno,
            last_seqno,
            durable_seqno,
            corrupt_records,
            corruption_detected,
            scrubbed_bytes,
            scrub_last_pass,
            per_shard: true,
            producer_duplicates,
            producer_refusals,
            producers_forgotten,
            producer_snapshots,
            epoch_raises,
            epoch_writes,
        })
    }

    /// Metrics registered on a private registry (tests, benchmarks).
    pub fn unregistered() -> WalMetrics {
        WalMetrics::new(&Registry::new()).expect("fresh registry")
    }

    pub(crate) fn shard(&self, shard: ShardId) -> Option<ShardGauges> {
        if !self.per_shard {
            return None;
        }
        let label = shard.to_string();
        // Shown (0) from the shard's start; the corruption registry sets it.
        self.corrupt_records.with_label_values(&[&label]);
        Some(ShardGauges {
            first_seqno: self.first_seqno.with_label_values(&[&label]),
            last_seqno: self.last_seqno.with_label_values(&[&label]),
            durable_seqno: self.durable_seqno.with_label_values(&[&label]),
        })
    }
}

/// `walship_wal_rotations_total{into}`: the store's WAL file rotations by the
/// file rotated into, read at each scrape. `into="new"` growing means the
/// spare files of zeros ran out (`wal.spare_bytes`) and group commits pay
/// for allocating blocks again.
pub struct RotationsCollector {
    rotations: Arc<Rotations>,
    /// Describes the family; the values are built at each collect.
    template: IntCounterVec,
}

impl RotationsCollector {
    pub fn new(rotations: Arc<Rotations>) -> prometheus::Result<RotationsCollector> {
        Ok(RotationsCollector { rotations, template: Self::family()? })
    }

    fn family() -> prometheus::Result<IntCounterVec> {
        IntCounterVec::new(
            Opts::new(
                "walship_wal_rotations_total",
                "WAL file rotations since the node started, by the file rotated into: spare (a spare of zeros or a \
                 recycled file) or new (allocated as the log grows)",
            ),
            &["into"],
        )
    }
}

impl Collector for RotationsCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.template.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Ok(family) = Self::family() else { return Vec::new() };
        family.with_label_values(&["spare"]).inc_by(self.rotations.spare.load(Ordering::Relaxed));
        family.with_label_values(&["new"]).inc_by(self.rotations.new.load(Ordering::Relaxed));
        family.collect()
    }
}

/// `walship_wal_index_bytes` and `walship_wal_index_chunks`, read from the
/// store at each scrape: what the WAL's index of its log costs in memory.
pub struct IndexCollector {
    store: Arc<dyn crate::LogStore>,
    bytes: IntGauge,
    chunks: IntGauge,
}

impl IndexCollector {
    pub fn new(store: Arc<dyn crate::LogStore>) -> prometheus::Result<IndexCollector> {
        Ok(IndexCollector {
            store,
            bytes: IntGauge::new(
                "walship_wal_index_bytes",
                "Bytes of memory the WAL's index of its stored chunks takes, every shard (the storage engine's entry \
                 index and directory keys, and walship's seqno map; estimated from their sizes)",
            )?,
            chunks: IntGauge::new("walship_wal_index_chunks", "Stored chunks the WAL's index holds, every shard")?,
        })
    }
}

impl Collector for IndexCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.bytes.desc().into_iter().chain(self.chunks.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.bytes.set(self.store.index_bytes() as i64);
        self.chunks.set(self.store.index_chunks() as i64);
        self.bytes.collect().into_iter().chain(self.chunks.collect()).collect()
    }
}

/// Per-shard producer-session figures, read from the WAL at each scrape:
/// `walship_producers{shard}` (producers remembered) and
/// `walship_shard_producer_duplicates{shard}` (appends answered as
/// duplicates since the process started). Only shards that have producers
/// or have answered a duplicate get a series; with `per_shard` false, one
/// `shard="all"` series sums them.
pub struct ProducersCollector {
    wal: crate::Wal,
    per_shard: bool,
    producers: IntGaugeVec,
    duplicates: IntGaugeVec,
}

impl ProducersCollector {
    pub fn new(wal: crate::Wal, per_shard: bool) -> prometheus::Result<ProducersCollector> {
        Ok(ProducersCollector {
            wal,
            per_shard,
            producers: IntGaugeVec::new(
                Opts::new(
                    "walship_producers",
                    "Producer sessions (exactly-once appends) a shard's table remembers on this node",
                ),
                &["shard"],
            )?,
            duplicates: IntGaugeVec::new(
                Opts::new(
                    "walship_shard_producer_duplicates",
                    "Appends this node answered as duplicates of records already written, per shard, since it started",
                ),
                &["shard"],
            )?,
        })
    }
}

impl Collector for ProducersCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.producers.desc().into_iter().chain(self.duplicates.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        self.producers.reset();
        self.duplicates.reset();
        let (mut producers, mut duplicates) = (0, 0);
        for shard in self.wal.shards() {
            let Ok(stats) = self.wal.producer_stats(shard, now) else { continue };
            if stats.producers == 0 && stats.duplicates == 0 {
                continue;
            }
            producers += stats.producers as i64;
            duplicates += stats.duplicates as i64;
            if self.per_shard {
                let label = shard.to_string();
                self.producers.with_label_values(&[&label]).set(stats.producers as i64);
                self.duplicates.with_label_values(&[&label]).set(stats.duplicates as i64);
            }
        }
        if !self.per_shard {
            self.producers.with_label_values(&["all"]).set(producers);
            self.duplicates.with_label_values(&["all"]).set(duplicates);
        }
        self.producers.collect().into_iter().chain(self.duplicates.collect()).collect()
    }
}
