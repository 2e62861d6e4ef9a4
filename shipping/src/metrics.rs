//! Replication metrics (`walship_*`); `ops/METRICS.md` is the catalogue.

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::NodeId;
use crate::core::leader::{FollowerProgress, Lag, ShipMode};

#[derive(Clone)]
pub struct ReplicationMetrics {
    commit_seqno: IntGaugeVec,
    acked_seqno: IntGaugeVec,
    lag_records: IntGaugeVec,
    lag_bytes: IntGaugeVec,
    lag_seconds: GaugeVec,
    mode: IntGaugeVec,
    in_flight: IntGaugeVec,
    /// Records per ShipSegment sent.
    pub ship_batch_records: Histogram,
    pub ship_message_pushes: Histogram,
    pub segments_shipped: IntCounter,
    pub bytes_shipped: IntCounter,
    pub ship_errors: IntCounterVec,
    /// Follower side: bytes applied by source (push, stream).
    pub received_bytes: IntCounterVec,
    /// Leader side: bytes served to catch-up streams.
    pub catchup_served_bytes: IntCounter,
    /// Follower side: bytes applied again after a corrupt tail was dropped.
    pub repair_refetched_bytes: IntCounter,
    /// Follower side: inbound ships and streams refused, by reason.
    pub ship_refused: IntCounterVec,
    pub heartbeats_received: IntCounter,
    pub heartbeats_sent: IntCounterVec,
    /// Each heartbeat round's phases (`late`: its start after the tick was
    /// due, `build`: the reports, `send`: the calls), the node's side of a
    /// late heartbeat.
    pub heartbeat_round_seconds: prometheus::HistogramVec,
    pub disk_bytes: IntGauge,
    pub append_rate: Gauge,
    /// Per-shard series (`shard` = the shard id); false: one series per
    /// follower with `shard="all"` (see [`ReplicationMetrics::set_followers_aggregate`]).
    pub per_shard: bool,
    /// Leader side: `NodeKeepalive` calls, by outcome.
    pub node_keepalives: IntCounterVec,
    /// Follower side: quiet shards a `NodeKeepalive` named that this node
    /// no longer follows at that epoch (the leader wakes them).
    pub quiet_refused: IntCounter,
    /// Leader side: (shard, follower) pairs quiet now.
    pub quiet_pairs: IntGauge,
    /// Replicas the heartbeat loop holds dormant (a peer node silent).
    pub dormant_replicas: IntGauge,
    /// Dormant replicas woken, by what woke them.
    pub dormant_wakes: IntCounterVec,
    /// Shards whose archive loop runs on this node (0 without `[archive]`).
    pub archive_loops: IntGauge,
    pub archive_listings: IntCounter,
    /// Leader side: leases lapsed past CheckQuorum's grace, by outcome.
    pub check_quorum: IntCounterVec,
}

/// `walship_grpc_undecodable_messages_total`: the process-wide count kept by
/// the gRPC codec ([`walship_proto::codec::undecodable_messages`]), read at
/// every scrape. Undecodable requests never reach a service, so they are
/// not in `walship_requests_rejected_total`.
pub struct UndecodableMessages {
    desc: prometheus::core::Desc,
}

const UNDECODABLE_NAME: &str = "walship_grpc_undecodable_messages_total";
const UNDECODABLE_HELP: &str = "Protobuf messages received that did not decode (requests refused with INVALID_ARGUMENT before any service, unreadable peer answers)";

impl UndecodableMessages {
    /// Registers the counter in `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<()> {
        let desc = prometheus::core::Desc::new(
            UNDECODABLE_NAME.into(),
            UNDECODABLE_HELP.into(),
            Vec::new(),
            Default::default(),
        )?;
        registry.register(Box::new(UndecodableMessages { desc }))
    }
}

impl prometheus::core::Collector for UndecodableMessages {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let counter = IntCounter::new(UNDECODABLE_NAME, UNDECODABLE_HELP).expect("valid metric name");
        counter.inc_by(walship_proto::codec::undecodable_messages());
        counter.collect()
    }
}

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: T) -> prometheus::Result<T> {
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

impl ReplicationMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<ReplicationMetrics> {
        let per_follower = |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &["shard", "follower"]);
        Ok(ReplicationMetrics {
            per_shard: true,
            commit_seqno: register(
                registry,
                IntGaugeVec::new(
                    Opts::new("walship_shard_commit_seqno", "Newest seqno durable on a majority (leader's view)"),
                    &["shard"],
                )?,
            )?,
            acked_seqno: register(
                registry,
                per_follower(
                    "walship_replica_acked_seqno",
                    "Follower's durable seqno as it last reported to the leader",
                )?,
            )?,
            lag_records: register(
                registry,
                per_follower(
                    "walship_replica_lag_records",
                    "Records durable on the leader and not yet on the follower",
                )?,
            )?,
            lag_bytes: register(
                registry,
                per_follower("walship_replica_lag_bytes", "Bytes durable on the leader and not yet on the follower")?,
            )?,
            lag_seconds: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "walship_replica_lag_seconds",
                        "Age on the leader's clock of the oldest record the follower has not written/flushed/applied",
                    ),
                    &["shard", "follower", "stage"],
                )?,
            )?,
            mode: register(
                registry,
                IntGaugeVec::new(
                    Opts::new("walship_replica_ship_mode", "1 for the follower's current ship mode"),
                    &["shard", "follower", "mode"],
                )?,
            )?,
            in_flight: register(
                registry,
                per_follower("walship_ship_queue_depth", "ShipSegment requests in flight to the follower")?,
            )?,
            ship_batch_records: register(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new("walship_ship_batch_records", "Records carried by one ShipSegment")
                        .buckets(prometheus::exponential_buckets(1.0, 4.0, 10)?),
                )?,
            )?,
            ship_message_pushes: register(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "walship_ship_message_pushes",
                        "Pushes (segments and keepalives) carried by one ShipBatches message to a follower node",
                    )
                    .buckets(prometheus::exponential_buckets(1.0, 2.0, 9)?),
                )?,
            )?,
            segments_shipped: register(
                registry,
                IntCounter::new("walship_ship_segments_total", "Segments shipped to followers by ShipSegment")?,
            )?,
            bytes_shipped: register(
                registry,
                IntCounter::new("walship_ship_bytes_total", "Segment bytes shipped to followers by ShipSegment")?,
            )?,
            ship_errors: register(
                registry,
                IntCounterVec::new(
                    Opts::new("walship_ship_errors_total", "ShipSegment requests that failed, by follower"),
                    &["follower"],
                )?,
            )?,
            received_bytes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "walship_catchup_bytes_total",
                        "Segment bytes a follower applied, by source (push, stream, archive)",
                    ),
                    &["source"],
                )?,
            )?,
            repair_refetched_bytes: register(
                registry,
                IntCounter::new(
                    "walship_repair_refetched_bytes_total",
                    "Segment bytes a follower applied again after truncating a corrupt tail of its log",
                )?,
            )?,
            catchup_served_bytes: register(
                registry,
                IntCounter::new(
                    "walship_catchup_served_bytes_total",
                    "Segment bytes this leader served to catch-up streams",
                )?,
            )?,
            ship_refused: register(
                registry,
                IntCounterVec::new(
                    Opts::new("walship_ship_refused_total", "Inbound ShipSegment/StreamSegments refused, by reason"),
                    &["reason"],
                )?,
            )?,
            heartbeats_received: register(
                registry,
                IntCounter::new("walship_heartbeats_received_total", "Heartbeats this node received")?,
            )?,
            heartbeats_sent: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "walship_heartbeats_sent_total",
                        "Heartbeat calls sent (batches), by outcome (ok, error)",
                    ),
                    &["outcome"],
                )?,
            )?,
            heartbeat_round_seconds: register(
                registry,
                prometheus::HistogramVec::new(
                    HistogramOpts::new(
                        "walship_heartbeat_round_seconds",
                        "Heartbeat rounds: how late each started after its tick was due (phase=late), and the time \
                         it spent building its reports (phase=build) and sending them (phase=send); a round late \
                         by more than the leader timeout makes the coordinator wait",
                    )
                    .buckets(prometheus::exponential_buckets(0.0005, 2.0, 14)?),
                    &["phase"],
                )?,
            )?,
            node_keepalives: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "walship_node_keepalives_total",
                        "NodeKeepalive calls this node sent for its quiet shards, by outcome (ok, error)",
                    ),
                    &["outcome"],
                )?,
            )?,
            quiet_refused: register(
                registry,
                IntCounter::new(
                    "walship_quiet_refused_total",
                    "Quiet shards a leader's NodeKeepalive named that this node no longer follows at that epoch",
                )?,
            )?,
            quiet_pairs: register(
                registry,
                IntGauge::new(
                    "walship_quiet_followers",
                    "(shard, follower) pairs this node leads that are quiet: no per-shard keepalives",
                )?,
            )?,
            dormant_replicas: register(
                registry,
                IntGauge::new(
                    "walship_dormant_replicas",
                    "Replicas whose heartbeat report waits, at two loads a look, for its activity or progress to \
                     move or a silent peer node to be heard again (a peer node down)",
                )?,
            )?,
            dormant_wakes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "walship_dormant_wakes_total",
                        "Dormant replicas the heartbeat loop looked at again, by reason (activity, progress, \
                         peer_contact, full_report)",
                    ),
                    &["reason"],
                )?,
            )?,
            archive_listings: register(
                registry,
                IntCounter::new(
                    "walship_archive_listings_total",
                    "Listings of a shard's archived segments this node made (a new archiving term, scrub passes); a \
                     shard with no committed record lists nothing",
                )?,
            )?,
            archive_loops: register(
                registry,
                IntGauge::new(
                    "walship_archive_loops",
                    "Shards whose archive loop runs on this node: those it leads or archives (a replica that only \
                     follows runs none; 0 without [archive])",
                )?,
            )?,
            check_quorum: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "walship_check_quorum_total",
                        "Leaderships whose lease lapsed past CheckQuorum's grace, by outcome (stepped_down, held)",
                    ),
                    &["outcome"],
                )?,
            )?,
            disk_bytes: register(
                registry,
                IntGauge::new("walship_wal_disk_bytes", "Bytes the node's WAL files occupy")?,
            )?,
            append_rate: register(
                registry,
                Gauge::new(
                    "walship_node_append_rate",
                    "Records per second this node made durable, over the last heartbeat interval",
                )?,
            )?,
        })
    }

    pub fn unregistered() -> ReplicationMetrics {
        ReplicationMetrics::new(&Registry::new()).expect("fresh registry")
    }

    /// The shard's commit gauge, for its replica to keep and set on every
    /// commit without a label lookup; `None` without per-shard series.
    pub fn commit_gauge(&self, shard: u32) -> Option<prometheus::IntGauge> {
        self.per_shard.then(|| self.commit_seqno.with_label_values(&[&shard.to_string()]))
    }

    /// The per-shard gauges of one (shard, follower) pair, looked up once
    /// for the caller to keep: setting them is then no label lookups.
    pub fn follower_gauges(&self, shard: u32, follower: NodeId) -> FollowerGauges {
        let (s, f) = (shard.to_string(), follower.to_string());
        FollowerGauges {
            acked: self.acked_seqno.with_label_values(&[&s, &f]),
            lag_records: self.lag_records.with_label_values(&[&s, &f]),
            lag_bytes: self.lag_bytes.with_label_values(&[&s, &f]),
            lag_seconds: ["write", "flush", "apply"].map(|stage| self.lag_seconds.with_label_values(&[&s, &f, stage])),
            modes: ShipMode::ALL.map(|mode| self.mode.with_label_values(&[&s, &f, mode.as_str()])),
            in_flight: self.in_flight.with_label_values(&[&s, &f]),
        }
    }

    /// Without per-shard series: per follower, over every shard this node
    /// leads, the largest lag (records, bytes, seconds), the number of
    /// shards in each ship mode, and the requests in flight, all with
    /// `shard="all"`.
    pub fn set_followers_aggregate(&self, followers: &std::collections::BTreeMap<NodeId, FollowerAggregate>) {
        for (follower, a) in followers {
            let f = follower.to_string();
            self.lag_records.with_label_values(&["all", &f]).set(a.lag_records as i64);
            self.lag_bytes.with_label_values(&["all", &f]).set(a.lag_bytes as i64);
            for stage in ["write", "flush", "apply"] {
                self.lag_seconds.with_label_values(&["all", &f, stage]).set(a.lag_seconds);
            }
            for (i, mode) in ShipMode::ALL.iter().enumerate() {
                self.mode.with_label_values(&["all", &f, mode.as_str()]).set(a.modes[i] as i64);
            }
            self.in_flight.with_label_values(&["all", &f]).set(a.in_flight as i64);
        }
    }
}

/// The gauges of one (shard, follower) pair ([`ReplicationMetrics::follower_gauges`]).
pub struct FollowerGauges {
    acked: IntGauge,
    lag_records: IntGauge,
    lag_bytes: IntGauge,
    lag_seconds: [Gauge; 3],
    modes: [IntGauge; 4],
    in_flight: IntGauge,
}

impl FollowerGauges {
    pub fn set(&self, progress: &FollowerProgress, lag: &Lag) {
        self.acked.set(progress.acked.0 as i64);
        self.lag_records.set(lag.records as i64);
        self.lag_bytes.set(lag.bytes as i64);
        for (gauge, value) in self.lag_seconds.iter().zip([lag.write_seconds, lag.flush_seconds, lag.apply_seconds]) {
            gauge.set(value);
        }
        for (gauge, mode) in self.modes.iter().zip(ShipMode::ALL) {
            gauge.set(i64::from(mode == progress.mode));
        }
        self.in_flight.set(progress.in_flight as i64);
    }
}

/// One follower over every shard a node leads (see
/// [`ReplicationMetrics::set_followers_aggregate`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct FollowerAggregate {
    pub lag_records: u64,
    pub lag_bytes: u64,
    pub lag_seconds: f64,
    /// Shards per [`ShipMode::ALL`] entry.
    pub modes: [u64; 4],
    pub in_flight: usize,
}

impl FollowerAggregate {
    pub fn add(&mut self, progress: &FollowerProgress, lag: &Lag) {
        self.lag_records = self.lag_records.max(lag.records);
        self.lag_bytes = self.lag_bytes.max(lag.bytes);
        self.lag_seconds = self.lag_seconds.max(lag.flush_seconds);
        if let Some(i) = ShipMode::ALL.iter().position(|m| *m == progress.mode) {
            self.modes[i] += 1;
        }
        self.in_flight += progress.in_flight;
    }
}
