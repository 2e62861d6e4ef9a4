//! Results: cells, ratios, the Markdown table and the JSON document.

use std::fmt::Write as _;

use serde::Serialize;
use walship_loadgen::Measured;
use walship_wal::disk::DiskBaseline;

/// `walship-quorum` from the `--walship-baseline` binary.
pub const BASELINE: &str = "walship-quorum-baseline";

/// `walship-quorum` with every client calling the unary `Log.Append`, one
/// record per call.
pub const WALSHIP_UNARY: &str = "walship-unary";
/// `walship-quorum` with the clients sharing one batching producer, each
/// still waiting for its own record's acknowledgement.
pub const WALSHIP_BATCHED: &str = "walship-batched";
/// Its targets ("Fast for every client"): at 64 clients at least this many
/// times JetStream R3's and PostgreSQL's records/s; at one client (100 B) a
/// p50 within this many raw 4 KiB fdatasync p50s and at least this many
/// times PostgreSQL's records/s.
pub const UNARY_MIN_RATIO_64: f64 = 2.5;
pub const UNARY_MAX_P50_VS_FDATASYNC: f64 = 1.5;
pub const UNARY_MIN_RATIO_1: f64 = 1.5;
/// The pipelined target: at 64 clients and 100 B, `walship-quorum`
/// (`Log.AppendStream`) and `walship-batched` (the producer) at least this
/// many times JetStream R3's and PostgreSQL's records/s.
pub const PIPELINED_MIN_RATIO_64: f64 = 5.0;

/// `walship-quorum` with every client an exactly-once producer session.
pub const WALSHIP_PRODUCER: &str = "walship-quorum-producer";
/// `jetstream-r3` with a unique `Nats-Msg-Id` on every publish.
pub const JETSTREAM_DEDUPE: &str = "jetstream-dedupe";
/// (deduplicating system, the system it varies): the cost of deduplication
/// is the first's records/s ÷ the second's in the same cell.
pub const DEDUPE_PAIRS: [(&str, &str); 2] = [(WALSHIP_PRODUCER, "walship-quorum"), (JETSTREAM_DEDUPE, "jetstream-r3")];
/// The target: producer sessions cost walship at most 5 % of its
/// throughput.
pub const PRODUCER_MAX_COST: f64 = 0.05;

/// Latency quantiles kept for the CDF chart.
const CDF_QUANTILES: &[f64] =
    &[0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999, 1.0];

/// One closed-loop cell: `clients` appending back to back.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub system: String,
    pub record_bytes: usize,
    pub clients: usize,
    pub records_per_s: f64,
    pub mib_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// Payload MiB/s × copies written to the one disk ÷ raw sequential MiB/s.
    pub disk_ratio: f64,
    /// (quantile, latency µs) pairs.
    pub cdf: Vec<(f64, f64)>,
}

/// One open-loop cell: a fixed offered rate (a fraction of the system's
/// peak for that record size) served by `clients`.
#[derive(Debug, Clone, Serialize)]
pub struct LowLoadCell {
    pub system: String,
    pub record_bytes: usize,
    pub clients: usize,
    pub offered_per_s: f64,
    pub achieved_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// p99 ÷ the raw 4 KiB fdatasync p99.
    pub p99_vs_fdatasync_p99: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub command: String,
    pub started_utc: String,
    pub cores: usize,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub low_load_fraction: f64,
    /// A fixed open-loop rate that replaced the fraction, when given.
    pub low_load_rate: Option<f64>,
    /// Clients serving the open-loop arrivals; none = each system's peak
    /// cell's client count.
    pub low_load_clients: Option<usize>,
    /// Clients appending during the leader kills.
    pub failover_clients: usize,
    /// The `--walship-baseline` binary, when one ran as
    /// `walship-quorum-baseline`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub walship_baseline: Option<String>,
}

impl Settings {
    /// How the open-loop rate was chosen, for headings.
    pub fn low_load_label(&self) -> String {
        match self.low_load_rate {
            Some(rate) => format!("a fixed {rate:.0} records/s"),
            None => format!("{:.0} % of each system's peak", self.low_load_fraction * 100.0),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub settings: Settings,
    pub baseline: DiskBaseline,
    pub cells: Vec<Cell>,
    pub low_load: Vec<LowLoadCell>,
    pub failover: Vec<FailoverRow>,
    /// [`Report::dedupe_costs`], filled in before the report is written
    /// (absent when no deduplicating system ran beside its plain one).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dedupe_cost: Vec<DedupeCost>,
}

/// A deduplicating system against the system it varies, in one cell.
#[derive(Debug, Clone, Serialize)]
pub struct DedupeCost {
    /// The deduplicating system (`walship-quorum-producer`, `jetstream-dedupe`).
    pub system: String,
    /// The system without deduplication (`walship-quorum`, `jetstream-r3`).
    pub without: String,
    pub record_bytes: usize,
    pub clients: usize,
    pub records_per_s: f64,
    pub without_records_per_s: f64,
    /// `records_per_s` ÷ `without_records_per_s`; 1 − this is the cost.
    pub ratio: f64,
}

/// One system's leader kills (see `failover.rs`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct FailoverRow {
    pub system: String,
    /// Kill → first acknowledgement of an append issued after it, per trial.
    pub trials_ms: Vec<f64>,
    /// Why there are no trials, when there are none.
    pub note: String,
}

impl FailoverRow {
    /// (median, worst) of the trials.
    pub fn median_and_max(&self) -> Option<(f64, f64)> {
        let mut t = self.trials_ms.clone();
        t.sort_by(f64::total_cmp);
        Some((*t.get(t.len() / 2)?, *t.last()?))
    }
}

pub fn cell(system: &str, size: usize, clients: usize, copies: f64, m: &Measured, base: &DiskBaseline) -> Cell {
    let f = m.summary(size);
    Cell {
        system: system.to_string(),
        record_bytes: size,
        clients,
        records_per_s: f.records_per_s,
        mib_per_s: f.mib_per_s,
        p50_us: f.p50_us,
        p99_us: f.p99_us,
        p999_us: f.p999_us,
        disk_ratio: f.mib_per_s * copies / base.seq_write_mib_s,
        cdf: CDF_QUANTILES.iter().map(|&q| (q, m.latency_us.value_at_quantile(q) as f64)).collect(),
    }
}

/// `system`'s best closed-loop records/s at `size`, and the clients of
/// that cell ((0, 1) when it has no cell).
pub fn peak(cells: &[Cell], system: &str, size: usize) -> (f64, usize) {
    cells
        .iter()
        .filter(|c| c.record_bytes == size && c.system == system)
        .map(|c| (c.records_per_s, c.clients))
        .fold((0.0, 1), |best, c| if c.0 > best.0 { c } else { best })
}

pub fn low_load_cell(
    system: &str,
    size: usize,
    clients: usize,
    offered_per_s: f64,
    m: &Measured,
    base: &DiskBaseline,
) -> LowLoadCell {
    let f = m.summary(size);
    LowLoadCell {
        system: system.to_string(),
        record_bytes: size,
        clients,
        offered_per_s,
        achieved_per_s: f.records_per_s,
        p50_us: f.p50_us,
        p99_us: f.p99_us,
        p999_us: f.p999_us,
        p99_vs_fdatasync_p99: f.p99_us / base.fdatasync_4k_p99_us,
    }
}

impl Report {
    /// Systems in the order they were measured.
    pub fn systems(&self) -> Vec<String> {
        let mut systems: Vec<String> = Vec::new();
        for c in &self.cells {
            if !systems.contains(&c.system) {
                systems.push(c.system.clone());
            }
        }
        systems
    }

    pub fn find(&self, system: &str, size: usize, clients: usize) -> Option<&Cell> {
        self.cells.iter().find(|c| c.system == system && c.record_bytes == size && c.clients == clients)
    }

    /// `a`'s records/s ÷ `b`'s in the same cell.
    pub fn ratio(&self, a: &str, b: &str, size: usize, clients: usize) -> Option<f64> {
        Some(self.find(a, size, clients)?.records_per_s / self.find(b, size, clients)?.records_per_s)
    }

    /// Every deduplicating system against the one it varies, per record
    /// size and clients where both ran ([`DEDUPE_PAIRS`]).
    pub fn dedupe_costs(&self) -> Vec<DedupeCost> {
        let mut costs = Vec::new();
        for (size, clients) in self.sizes_and_clients() {
            for (with, without) in DEDUPE_PAIRS {
                let (Some(a), Some(b)) = (self.find(with, size, clients), self.find(without, size, clients)) else {
                    continue;
                };
                costs.push(DedupeCost {
                    system: with.into(),
                    without: without.into(),
                    record_bytes: size,
                    clients,
                    records_per_s: a.records_per_s,
                    without_records_per_s: b.records_per_s,
                    ratio: a.records_per_s / b.records_per_s,
                });
            }
        }
        costs
    }

    /// The "Cost of deduplication" section, empty without a pair.
    fn dedupe_markdown(&self, out: &mut String) {
        let costs = self.dedupe_costs();
        if costs.is_empty() {
            return;
        }
        let pairs: Vec<(&str, &str)> =
            DEDUPE_PAIRS.into_iter().filter(|(with, _)| costs.iter().any(|c| c.system == *with)).collect();
        let both = pairs.len() == DEDUPE_PAIRS.len();
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "**Cost of deduplication** (closed loop, records/s; each deduplicating system ÷ the same system without, \
             in the same run: `{WALSHIP_PRODUCER}` has every client append as its own producer session, \
             `{JETSTREAM_DEDUPE}` puts a unique `Nats-Msg-Id` on every publish with the default 2 min duplicate window)"
        );
        let _ = writeln!(out);
        let mut header = "| record B | clients |".to_string();
        let mut rule = "|---:|---:|".to_string();
        for (with, without) in &pairs {
            let _ = write!(header, " {without} | {with} | {with} ÷ {without} |");
            rule.push_str("---:|---:|---:|");
        }
        if both {
            let _ = write!(header, " {WALSHIP_PRODUCER} ÷ {JETSTREAM_DEDUPE} |");
            rule.push_str("---:|");
        }
        let _ = writeln!(out, "{header}\n{rule}");
        let mut keys: Vec<(usize, usize)> = costs.iter().map(|c| (c.record_bytes, c.clients)).collect();
        keys.dedup();
        for (size, clients) in keys {
            let mut row = format!("| {size} | {clients} |");
            for (with, _) in &pairs {
                let _ = match costs.iter().find(|c| c.system == *with && (c.record_bytes, c.clients) == (size, clients))
                {
                    Some(c) => {
                        write!(row, " {:.0} | {:.0} | {:.3}× |", c.without_records_per_s, c.records_per_s, c.ratio)
                    }
                    None => write!(row, " – | – | – |"),
                };
            }
            if both {
                let _ = match self.ratio(WALSHIP_PRODUCER, JETSTREAM_DEDUPE, size, clients) {
                    Some(r) => write!(row, " {r:.2}× |"),
                    None => write!(row, " – |"),
                };
            }
            let _ = writeln!(out, "{row}");
        }
        let _ = writeln!(out);
        for c in costs.iter().filter(|c| c.system == WALSHIP_PRODUCER) {
            let _ = writeln!(
                out,
                "- {} B, {} clients: walship producer sessions {} (target ≤ {:.0} % cost: {})",
                c.record_bytes,
                c.clients,
                cost_text(c.ratio),
                PRODUCER_MAX_COST * 100.0,
                if 1.0 - c.ratio <= PRODUCER_MAX_COST { "met" } else { "NOT met" }
            );
        }
        for c in costs.iter().filter(|c| c.system == JETSTREAM_DEDUPE) {
            let _ = writeln!(
                out,
                "- {} B, {} clients: JetStream `Nats-Msg-Id` deduplication {}",
                c.record_bytes,
                c.clients,
                cost_text(c.ratio)
            );
        }
    }

    fn sizes_and_clients(&self) -> Vec<(usize, usize)> {
        let mut keys: Vec<(usize, usize)> = self.cells.iter().map(|c| (c.record_bytes, c.clients)).collect();
        keys.sort();
        keys.dedup();
        keys
    }

    pub fn markdown(&self) -> String {
        let b = &self.baseline;
        let s = &self.settings;
        let systems = self.systems();
        // The deduplicating variants are compared in their own table.
        let peers: Vec<&String> = systems
            .iter()
            .filter(|s| !s.starts_with("walship") && !DEDUPE_PAIRS.iter().any(|(with, _)| with == s))
            .collect();
        let mut out = String::new();
        let _ = writeln!(out, "Run {} on {} cores; `{}`.", s.started_utc, s.cores, s.command);
        let _ = writeln!(
            out,
            "Raw disk, same run: 4 KiB write + fdatasync p50 {:.0} µs, p99 {:.0} µs, p999 {:.0} µs (three writers at once, \
             as three replicas on this one disk: p50 {:.0} µs); sequential write {:.0} MiB/s. Each cell: fresh data dirs, {} s warm-up, {} s measured. The disk limit in the ratios is that sequential \
             figure, measured once before the first cell; this disk's speed swings within a run, so a later cell can \
             write faster (a ratio above 1).",
            b.fdatasync_4k_p50_us,
            b.fdatasync_4k_p99_us,
            b.fdatasync_4k_p999_us,
            b.fdatasync_4k_three_p50_us,
            b.seq_write_mib_s,
            s.warmup_s,
            s.duration_s
        );
        if let Some(baseline) = &s.walship_baseline {
            let _ = writeln!(
                out,
                "`{BASELINE}` is `walship-quorum` (same cluster, settings and cells, run right after it) from `{baseline}`."
            );
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "**Throughput (records/s) and ratios, closed loop**");
        let _ = writeln!(out);
        let mut header = "| record B | clients |".to_string();
        let mut rule = "|---:|---:|".to_string();
        for system in &systems {
            let _ = write!(header, " {system} |");
            rule.push_str("---:|");
        }
        for peer in &peers {
            let _ = write!(header, " walship-quorum ÷ {peer} |");
            rule.push_str("---:|");
        }
        // The walship variants in the run, each with its own ratio columns.
        let variants: Vec<&str> =
            [WALSHIP_UNARY, WALSHIP_BATCHED].into_iter().filter(|v| systems.iter().any(|s| s == v)).collect();
        for variant in &variants {
            for peer in &peers {
                let _ = write!(header, " {variant} ÷ {peer} |");
                rule.push_str("---:|");
            }
        }
        let baseline = systems.iter().any(|s| s == BASELINE);
        if baseline {
            let _ = write!(header, " walship-quorum ÷ {BASELINE} |");
            rule.push_str("---:|");
        }
        header.push_str(" walship-quorum ÷ disk limit |");
        rule.push_str("---:|");
        let _ = writeln!(out, "{header}\n{rule}");
        for (size, clients) in self.sizes_and_clients() {
            let mut row = format!("| {size} | {clients} |");
            for system in &systems {
                let _ = match self.find(system, size, clients) {
                    Some(c) => write!(row, " {:.0} |", c.records_per_s),
                    None => write!(row, " – |"),
                };
            }
            for peer in &peers {
                let _ = match self.ratio("walship-quorum", peer, size, clients) {
                    Some(r) => write!(row, " {r:.2}× |"),
                    None => write!(row, " – |"),
                };
            }
            for variant in &variants {
                for peer in &peers {
                    let _ = match self.ratio(variant, peer, size, clients) {
                        Some(r) => write!(row, " {r:.2}× |"),
                        None => write!(row, " – |"),
                    };
                }
            }
            if baseline {
                let _ = match self.ratio("walship-quorum", BASELINE, size, clients) {
                    Some(r) => write!(row, " {r:.3}× |"),
                    None => write!(row, " – |"),
                };
            }
            let _ = match self.find("walship-quorum", size, clients) {
                Some(c) => write!(row, " {:.3} |", c.disk_ratio),
                None => write!(row, " – |"),
            };
            let _ = writeln!(out, "{row}");
        }
        self.dedupe_markdown(&mut out);
        let _ = writeln!(out);
        let _ = writeln!(out, "**Every cell**");
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| system | record B | clients | records/s | MiB/s | p50 ms | p99 ms | p999 ms | disk MiB/s (all copies) ÷ disk limit |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (size, clients) in self.sizes_and_clients() {
            for system in &systems {
                if let Some(c) = self.find(system, size, clients) {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {:.0} | {:.1} | {:.2} | {:.2} | {:.2} | {:.3} |",
                        c.system,
                        size,
                        clients,
                        c.records_per_s,
                        c.mib_per_s,
                        c.p50_us / 1e3,
                        c.p99_us / 1e3,
                        c.p999_us / 1e3,
                        c.disk_ratio
                    );
                }
            }
        }
        if !self.low_load.is_empty() {
            let _ = writeln!(out);
            let clients = match s.low_load_clients {
                Some(n) => format!("{n} clients"),
                None => "as many clients as the system's peak cell".into(),
            };
            let _ = writeln!(
                out,
                "**Latency at {}** (open loop, {clients}, latency from each arrival's scheduled time)",
                s.low_load_label(),
            );
            let _ = writeln!(out);
            let _ = writeln!(
                out,
                "| system | record B | clients | offered/s | achieved/s | p50 ms | p99 ms | p999 ms | p99 ÷ fdatasync p99 |"
            );
            let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
            for c in &self.low_load {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} |",
                    c.system,
                    c.record_bytes,
                    c.clients,
                    c.offered_per_s,
                    c.achieved_per_s,
                    c.p50_us / 1e3,
                    c.p99_us / 1e3,
                    c.p999_us / 1e3,
                    c.p99_vs_fdatasync_p99
                );
            }
        }
        if !self.failover.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(
                out,
                "**Write unavailability when the leader is killed** (SIGKILL while {} clients append 100 B records; \
                 from the kill to the first acknowledgement of an append issued after it; a fresh cluster per kill)",
                s.failover_clients
            );
            let _ = writeln!(out);
            let _ = writeln!(out, "| system | kills | median ms | worst ms | every kill, ms |");
            let _ = writeln!(out, "|---|---:|---:|---:|---|");
            for row in &self.failover {
                let trials: Vec<String> = row.trials_ms.iter().map(|t| format!("{t:.0}")).collect();
                let _ = match row.median_and_max() {
                    Some((median, max)) => writeln!(
                        out,
                        "| {} | {} | {median:.0} | {max:.0} | {} |",
                        row.system,
                        trials.len(),
                        trials.join(", ")
                    ),
                    None => writeln!(out, "| {} | 0 | – | – | {} |", row.system, row.note),
                };
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "**Issue 6 targets** (walship `QUORUM`, 64 clients)");
        let _ = writeln!(out);
        for target in self.targets() {
            let _ = writeln!(out, "- {target}");
        }
        let unary = self.unary_targets();
        if !unary.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(out, "**Unary targets** (`{WALSHIP_UNARY}`: one record per `Log.Append` call)");
            let _ = writeln!(out);
            for target in unary {
                let _ = writeln!(out, "- {target}");
            }
        }
        let pipelined = self.pipelined_targets();
        if !pipelined.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(
                out,
                "**Pipelined targets** (`walship-quorum`: one record per `Log.AppendStream` message; \
                 `{WALSHIP_BATCHED}`: the clients share a batching producer)"
            );
            let _ = writeln!(out);
            for target in pipelined {
                let _ = writeln!(out, "- {target}");
            }
        }
        out
    }

    /// The pipelined targets (100 B, 64 clients) of `walship-quorum` and
    /// `walship-batched`, each with its measured figure and verdict (empty
    /// when `walship-batched` did not run).
    pub fn pipelined_targets(&self) -> Vec<String> {
        if !self.cells.iter().any(|c| c.system == WALSHIP_BATCHED) {
            return Vec::new();
        }
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        let mut lines = Vec::new();
        for system in ["walship-quorum", WALSHIP_BATCHED] {
            for peer in ["jetstream-r3", "postgres-sync"] {
                if let Some(r) = self.ratio(system, peer, 100, 64) {
                    lines.push(format!(
                        "100 B, 64 clients: {system} ÷ {peer} = {r:.3}× (target ≥ {PIPELINED_MIN_RATIO_64}×: {})",
                        verdict(r >= PIPELINED_MIN_RATIO_64)
                    ));
                }
            }
        }
        lines
    }

    /// `walship-unary`'s targets, each with its measured figure and verdict
    /// (empty when it did not run).
    pub fn unary_targets(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        for size in [100, 4096] {
            for peer in ["jetstream-r3", "postgres-sync"] {
                if let Some(r) = self.ratio(WALSHIP_UNARY, peer, size, 64) {
                    lines.push(format!(
                        "{size} B, 64 clients: {WALSHIP_UNARY} ÷ {peer} = {r:.3}× (target ≥ {UNARY_MIN_RATIO_64}×: {})",
                        verdict(r >= UNARY_MIN_RATIO_64)
                    ));
                }
            }
        }
        if let Some(c) = self.find(WALSHIP_UNARY, 100, 1) {
            let fdatasync = self.baseline.fdatasync_4k_p50_us;
            let r = c.p50_us / fdatasync;
            lines.push(format!(
                "100 B, 1 client: {WALSHIP_UNARY} p50 {:.0} µs = {r:.2}× the raw 4 KiB fdatasync p50 {fdatasync:.0} µs \
                 (target ≤ {UNARY_MAX_P50_VS_FDATASYNC}×: {})",
                c.p50_us,
                verdict(r <= UNARY_MAX_P50_VS_FDATASYNC)
            ));
        }
        if let Some(r) = self.ratio(WALSHIP_UNARY, "postgres-sync", 100, 1) {
            lines.push(format!(
                "100 B, 1 client: {WALSHIP_UNARY} ÷ postgres-sync = {r:.3}× (target ≥ {UNARY_MIN_RATIO_1}×: {})",
                verdict(r >= UNARY_MIN_RATIO_1)
            ));
        }
        lines
    }

    /// The targets, each with its measured figure and verdict.
    pub fn targets(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        for size in [100, 4096] {
            for peer in ["jetstream-r3", "postgres-sync"] {
                if let Some(r) = self.ratio("walship-quorum", peer, size, 64) {
                    lines.push(format!(
                        // Three decimals: 2.995× must not read as 3.00× beside "NOT met".
                        "{size} B: walship-quorum ÷ {peer} = {r:.3}× (target ≥ 3×: {})",
                        verdict(r >= 3.0)
                    ));
                }
            }
        }
        for c in self.low_load.iter().filter(|c| c.system == "walship-quorum") {
            lines.push(format!(
                "{} B: p99 at {} = {:.2} ms = {:.2}× fdatasync p99 (target ≤ 3×: {})",
                c.record_bytes,
                self.settings.low_load_label(),
                c.p99_us / 1e3,
                c.p99_vs_fdatasync_p99,
                verdict(c.p99_vs_fdatasync_p99 <= 3.0)
            ));
        }
        if lines.is_empty() {
            lines.push("not measured in this run (needs walship-quorum and a peer at 64 clients)".into());
        }
        lines
    }
}

/// "cost 3.8 % of the throughput", or "measured 2.1 % faster (no cost
/// measured)" for a ratio above 1 (the noise of a shared machine).
fn cost_text(ratio: f64) -> String {
    if ratio <= 1.0 {
        format!("cost {:.1} % of the throughput", (1.0 - ratio) * 100.0)
    } else {
        format!("measured {:.1} % faster (no cost measured)", (ratio - 1.0) * 100.0)
    }
}

/// The time now, as the reports print it (`2026-12-01 14:30 UTC`).
pub fn utc_now() -> String {
    let out = std::process::Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]).output();
    out.ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
}

#[cfg(test)]
#[path = "report_test.rs"]
mod tests;
