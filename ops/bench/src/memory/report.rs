//! The memory benchmark's figures, the Markdown table, the JSON document
//! and the CSV of every sample.

use std::fmt::Write as _;

use serde::Serialize;
use walship_wal::disk::DiskBaseline;

use super::{NodeSample, Reads, RunOutcome, Sample};

const MIB: f64 = (1u64 << 20) as f64;
/// The record count growth figures are scaled to.
pub const PER_RECORDS: f64 = 10_000_000.0;

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub command: String,
    pub started_utc: String,
    pub cores: usize,
    /// The binary measured as `new`, and the one measured as `baseline`.
    pub walship: String,
    pub baseline: Option<String>,
    pub clients: usize,
    pub record_bytes: usize,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub reads: usize,
    pub retain_bytes: u64,
    pub sample_every_s: f64,
    pub node_flags: Vec<String>,
}

/// One node's memory over a run.
#[derive(Debug, Clone, Serialize)]
pub struct NodeFigures {
    pub node: u32,
    /// Its role at the end of the load.
    pub role: String,
    /// Before the load (after the cluster's first append).
    pub rss_start_bytes: u64,
    pub rss_warmup_bytes: u64,
    pub rss_end_bytes: u64,
    pub rss_anon_end_bytes: u64,
    pub retained_warmup: u64,
    pub retained_end: u64,
    /// The shard's oldest seqno at the end (1 unless something compacted).
    pub first_seqno_end: u64,
    /// (RSS at end − RSS at the warm-up sample) ÷ records retained between
    /// them × 10 M, in MiB.
    pub rss_growth_per_10m_mib: Option<f64>,
    /// Least-squares slope of RSS against retained records over the samples
    /// from the warm-up on, in bytes per record.
    pub slope_bytes_per_record: Option<f64>,
    /// The same over every sample, the one before the load included.
    pub slope_all_bytes_per_record: Option<f64>,
    /// `walship_wal_index_bytes` at the end; none when not exported.
    pub index_end_bytes: Option<u64>,
    /// The index at the end ÷ records retained × 10 M, in MiB.
    pub index_per_10m_mib: Option<f64>,
    /// The index's growth between the warm-up and the end ÷ records
    /// retained between them × 10 M, in MiB.
    pub index_growth_per_10m_mib: Option<f64>,
}

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct RunFigures {
    pub label: String,
    pub binary: String,
    pub records_per_s: f64,
    pub append_p50_us: f64,
    pub append_p99_us: f64,
    pub load_seconds: f64,
    pub acked: u64,
    /// When the warm-up and end samples were taken (seconds of load).
    pub warmup_sample_s: f64,
    pub end_sample_s: f64,
    pub samples: usize,
    pub nodes: Vec<NodeFigures>,
    /// Means over the nodes (none when a node lacks the figure).
    pub mean_rss_growth_per_10m_mib: Option<f64>,
    pub mean_slope_bytes_per_record: Option<f64>,
    pub mean_index_per_10m_mib: Option<f64>,
    pub reads: Reads,
}

/// new ÷ baseline for one figure.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub figure: String,
    pub new: Option<f64>,
    pub baseline: Option<f64>,
    pub ratio: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    pub settings: Settings,
    pub disk: DiskBaseline,
    pub runs: Vec<RunFigures>,
    /// new ÷ baseline, when a baseline ran.
    pub ratios: Vec<Ratio>,
}

/// Least-squares slope of y against x; none with fewer than two distinct x.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

fn mean(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let values: Option<Vec<f64>> = values.collect();
    let values = values?;
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// Node `i` in `sample`, when it has positions.
fn positioned(sample: &Sample, i: usize) -> Option<&NodeSample> {
    sample.nodes.get(i).filter(|n| n.retained().is_some())
}

/// Per-record growth of `end − warm` over the records retained between
/// them, scaled to 10 M records, in MiB.
fn per_10m(warm: f64, end: f64, records: u64) -> Option<f64> {
    (records > 0).then(|| (end - warm) / records as f64 * PER_RECORDS / MIB)
}

/// Node `i`'s figures from `samples` (the first is the one before the load).
fn node_figures(samples: &[Sample], i: usize, warmup_s: f64) -> Option<NodeFigures> {
    let first = samples.first()?.nodes.get(i)?;
    let warm_at = samples.iter().position(|s| s.t_s >= warmup_s && positioned(s, i).is_some())?;
    let end_at = samples.iter().rposition(|s| positioned(s, i).is_some())?;
    let (warm, end) = (positioned(&samples[warm_at], i)?, positioned(&samples[end_at], i)?);
    let (retained_warmup, retained_end) = (warm.retained()?, end.retained()?);
    let added = retained_end.saturating_sub(retained_warmup);
    let points = |from: usize| -> Vec<(f64, f64)> {
        samples[from..]
            .iter()
            .filter_map(|s| positioned(s, i))
            .map(|n| (n.retained().unwrap_or(0) as f64, n.rss_bytes as f64))
            .collect()
    };
    let index_growth = match (warm.index_bytes, end.index_bytes) {
        (Some(w), Some(e)) => per_10m(w as f64, e as f64, added),
        _ => None,
    };
    Some(NodeFigures {
        node: end.node,
        role: end.role.clone(),
        rss_start_bytes: first.rss_bytes,
        rss_warmup_bytes: warm.rss_bytes,
        rss_end_bytes: end.rss_bytes,
        rss_anon_end_bytes: end.rss_anon_bytes,
        retained_warmup,
        retained_end,
        first_seqno_end: end.first_seqno.unwrap_or(0),
        rss_growth_per_10m_mib: per_10m(warm.rss_bytes as f64, end.rss_bytes as f64, added),
        slope_bytes_per_record: slope(&points(warm_at)),
        slope_all_bytes_per_record: slope(&points(0)),
        index_end_bytes: end.index_bytes,
        index_per_10m_mib: end
            .index_bytes
            .and_then(|b| (retained_end > 0).then(|| b as f64 / retained_end as f64 * PER_RECORDS / MIB)),
        index_growth_per_10m_mib: index_growth,
    })
}

/// One run's figures from its samples.
pub fn figures(outcome: &RunOutcome) -> RunFigures {
    let samples = &outcome.samples;
    let warmup_s = outcome.spec.warmup_s;
    let node_count = samples.first().map_or(0, |s| s.nodes.len());
    let nodes: Vec<NodeFigures> = (0..node_count).filter_map(|i| node_figures(samples, i, warmup_s)).collect();
    let complete = nodes.len() == node_count && node_count > 0;
    let node_mean = |f: fn(&NodeFigures) -> Option<f64>| if complete { mean(nodes.iter().map(f)) } else { None };
    RunFigures {
        label: outcome.spec.label.clone(),
        binary: outcome.spec.walship.display().to_string(),
        records_per_s: outcome.records_per_s,
        append_p50_us: outcome.append_p50_us,
        append_p99_us: outcome.append_p99_us,
        load_seconds: outcome.load_seconds,
        acked: samples.last().map_or(0, |s| s.acked),
        warmup_sample_s: samples.iter().find(|s| s.t_s >= warmup_s).map_or(0.0, |s| s.t_s),
        end_sample_s: samples.last().map_or(0.0, |s| s.t_s),
        samples: samples.len(),
        mean_rss_growth_per_10m_mib: node_mean(|n| n.rss_growth_per_10m_mib),
        mean_slope_bytes_per_record: node_mean(|n| n.slope_bytes_per_record),
        mean_index_per_10m_mib: node_mean(|n| n.index_per_10m_mib),
        nodes,
        reads: outcome.reads.clone(),
    }
}

/// One figure of a run.
type Figure = fn(&RunFigures) -> Option<f64>;

/// new ÷ baseline for the headline figures.
pub fn ratios(new: &RunFigures, baseline: &RunFigures) -> Vec<Ratio> {
    let rows: [(&str, Figure); 7] = [
        ("RSS growth per 10 M records, MiB (mean of nodes)", |r| r.mean_rss_growth_per_10m_mib),
        ("RSS slope, bytes per record (mean of nodes)", |r| r.mean_slope_bytes_per_record),
        ("index per 10 M records, MiB (mean of nodes)", |r| r.mean_index_per_10m_mib),
        ("read p50, µs", |r| Some(r.reads.p50_us)),
        ("read p99, µs", |r| Some(r.reads.p99_us)),
        ("read mean, µs", |r| Some(r.reads.mean_us)),
        ("append throughput, records/s", |r| Some(r.records_per_s)),
    ];
    rows.iter()
        .map(|(figure, get)| {
            let (n, b) = (get(new), get(baseline));
            let ratio = match (n, b) {
                (Some(n), Some(b)) if b != 0.0 => Some(n / b),
                _ => None,
            };
            Ratio { figure: figure.to_string(), new: n, baseline: b, ratio }
        })
        .collect()
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "n/a".to_string(), |v| format!("{v:.decimals$}"))
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / MIB)
}

impl MemoryReport {
    pub fn markdown(&self) -> String {
        let (s, d) = (&self.settings, &self.disk);
        let mut out = String::new();
        let _ = writeln!(out, "Run {} on {} cores; `{}`.", s.started_utc, s.cores, s.command);
        let _ = writeln!(
            out,
            "Raw disk, same run: 4 KiB write + fdatasync p50 {:.0} µs, p99 {:.0} µs, p999 {:.0} µs; sequential write {:.0} MiB/s.",
            d.fdatasync_4k_p50_us, d.fdatasync_4k_p99_us, d.fdatasync_4k_p999_us, d.seq_write_mib_s
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "Each run: a fresh cluster of three `walship node`s and a `walship coord` (one shard, RF=3, the settings of a \
             `walship-compare` throughput cell, retention raised to {:.0} GiB per shard so nothing is compacted), \
             {} clients appending {} B records at `QUORUM` through `Log.AppendStream` (closed loop) for {} s; each node's \
             VmRSS, its retained records of the shard (`/v1/status`) and `walship_wal_index_bytes` (`/metrics`, n/a when \
             the binary does not export it) sampled every {} s. RSS growth per 10 M records = (RSS at the end − RSS at \
             the first sample at or after {} s of load) ÷ the records retained between them × 10 M; the slope is the \
             least-squares fit of RSS against retained records over the samples from that warm-up sample on. Then, \
             with the load stopped, {} `Log.Read` calls for one record each, one at a time, at uniformly random seqnos \
             in the older half of the leader's log.",
            s.retain_bytes as f64 / (1u64 << 30) as f64,
            s.clients,
            s.record_bytes,
            s.duration_s,
            s.sample_every_s,
            s.warmup_s,
            s.reads
        );
        let _ = writeln!(out);
        for run in &self.runs {
            let _ = writeln!(out, "- `{}`: `{}`", run.label, run.binary);
        }
        if !s.node_flags.is_empty() {
            let _ = writeln!(out, "- node flags: `{}`", s.node_flags.join(" "));
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "**Resident memory per node**");
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| run | node | role | RSS before load MiB | RSS at warm-up MiB | RSS at end MiB | records retained | \
             RSS growth per 10 M records MiB | slope bytes/record | slope bytes/record, all samples | index at end MiB | \
             index per 10 M records MiB |"
        );
        let _ = writeln!(out, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for run in &self.runs {
            for n in &run.nodes {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    run.label,
                    n.node,
                    n.role,
                    mib(n.rss_start_bytes),
                    mib(n.rss_warmup_bytes),
                    mib(n.rss_end_bytes),
                    n.retained_end,
                    opt(n.rss_growth_per_10m_mib, 1),
                    opt(n.slope_bytes_per_record, 1),
                    opt(n.slope_all_bytes_per_record, 1),
                    n.index_end_bytes.map_or_else(|| "n/a".into(), mib),
                    opt(n.index_per_10m_mib, 1),
                );
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "**Append throughput and single-record reads from the middle of the log**");
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| run | records/s | append p50 ms | append p99 ms | reads | read p50 µs | read p99 µs | read mean µs | \
             read max µs | read errors | seqnos read (leader) | records behind the tail |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|");
        for run in &self.runs {
            let r = &run.reads;
            let _ = writeln!(
                out,
                "| {} | {:.0} | {:.2} | {:.2} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {}–{} (node {}) | ≥ {} |",
                run.label,
                run.records_per_s,
                run.append_p50_us / 1e3,
                run.append_p99_us / 1e3,
                r.requested,
                r.p50_us,
                r.p99_us,
                r.mean_us,
                r.max_us,
                r.errors,
                r.from_seqno,
                r.to_seqno,
                r.node,
                r.last_seqno.saturating_sub(r.to_seqno),
            );
        }
        for run in self.runs.iter().filter(|r| r.reads.errors > 0) {
            let _ = writeln!(out);
            let _ = writeln!(
                out,
                "**{}: {} of {} reads failed**; the first: {}",
                run.label,
                run.reads.errors,
                run.reads.requested,
                run.reads.first_error.as_deref().unwrap_or("?")
            );
        }
        if !self.ratios.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(out, "**new ÷ baseline**");
            let _ = writeln!(out);
            let _ = writeln!(out, "| figure | new | baseline | new ÷ baseline |");
            let _ = writeln!(out, "|---|---:|---:|---:|");
            for r in &self.ratios {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} |",
                    r.figure,
                    opt(r.new, 1),
                    opt(r.baseline, 1),
                    r.ratio.map_or_else(|| "n/a".into(), |v| format!("{v:.3}×"))
                );
            }
        }
        out
    }
}

/// Every sample of every run, one line per node and instant.
pub fn samples_csv(outcomes: &[RunOutcome]) -> String {
    let mut out = String::from(
        "run,t_s,acked,node,pid,role,rss_bytes,rss_anon_bytes,first_seqno,last_seqno,retained,index_bytes\n",
    );
    let field = |v: Option<u64>| v.map_or_else(String::new, |v| v.to_string());
    for outcome in outcomes {
        for s in &outcome.samples {
            for n in &s.nodes {
                let _ = writeln!(
                    out,
                    "{},{:.3},{},{},{},{},{},{},{},{},{},{}",
                    outcome.spec.label,
                    s.t_s,
                    s.acked,
                    n.node,
                    n.pid,
                    n.role,
                    n.rss_bytes,
                    n.rss_anon_bytes,
                    field(n.first_seqno),
                    field(n.last_seqno),
                    field(n.retained()),
                    field(n.index_bytes),
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::*;
    use crate::memory::RunSpec;

    fn node(node: u32, rss: u64, last: Option<u64>, index: Option<u64>) -> NodeSample {
        NodeSample {
            node,
            pid: 100 + node,
            rss_bytes: rss,
            rss_anon_bytes: rss / 2,
            role: if node == 1 { "leader" } else { "follower" }.into(),
            first_seqno: last.map(|_| 1),
            last_seqno: last,
            index_bytes: index,
        }
    }

    /// Two nodes; node 1 grows 50 bytes per record from 100 MiB, node 2 25;
    /// a million records a second.
    fn outcome(index: bool) -> RunOutcome {
        let base = 100u64 << 20;
        let samples = (0..=20u64)
            .map(|t| {
                let records = t * 1_000_000 + 1;
                let idx = |per| index.then_some(records * per);
                Sample {
                    t_s: t as f64 + if t == 0 { 0.0 } else { 0.01 },
                    acked: records - 1,
                    nodes: vec![
                        node(1, base + records * 50, Some(records), idx(4)),
                        // Node 2's status did not answer at 15 s.
                        node(2, base + records * 25, (t != 15).then_some(records), idx(2)),
                    ],
                }
            })
            .collect();
        RunOutcome {
            spec: RunSpec {
                label: "new".into(),
                walship: PathBuf::from("/bin/walship"),
                dir: PathBuf::from("/tmp/x"),
                clients: 64,
                record_bytes: 100,
                duration: Duration::from_secs(20),
                warmup_s: 10.0,
                reads: 10,
                retain_bytes: 1 << 36,
                sample_every: Duration::from_secs(1),
                node_flags: Vec::new(),
            },
            samples,
            records_per_s: 1e6,
            append_p50_us: 900.0,
            append_p99_us: 3000.0,
            load_seconds: 20.0,
            reads: Reads {
                requested: 10,
                p50_us: 80.0,
                p99_us: 300.0,
                mean_us: 100.0,
                max_us: 400.0,
                ..Reads::default()
            },
        }
    }

    #[test]
    fn least_squares_slope() {
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), Some(2.0));
        assert_eq!(slope(&[(1.0, 1.0)]), None);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), None);
    }

    #[test]
    fn growth_slope_and_index_per_node() {
        let f = figures(&outcome(true));
        assert_eq!(f.nodes.len(), 2);
        let n1 = &f.nodes[0];
        assert_eq!(n1.retained_warmup, 10_000_001);
        assert_eq!(n1.retained_end, 20_000_001);
        // 50 bytes per record: 500 M bytes per 10 M records.
        let want = 500e6 / MIB;
        assert!((n1.rss_growth_per_10m_mib.unwrap() - want).abs() < 1e-6, "{n1:?}");
        assert!((n1.slope_bytes_per_record.unwrap() - 50.0).abs() < 1e-6);
        assert!((n1.slope_all_bytes_per_record.unwrap() - 50.0).abs() < 1e-6);
        assert_eq!(n1.index_end_bytes, Some(20_000_001 * 4));
        assert!((n1.index_per_10m_mib.unwrap() - 40e6 / MIB).abs() < 1e-6);
        assert!((n1.index_growth_per_10m_mib.unwrap() - 40e6 / MIB).abs() < 1e-6);
        let n2 = &f.nodes[1];
        assert!((n2.slope_bytes_per_record.unwrap() - 25.0).abs() < 1e-6, "the missing sample is skipped");
        assert!((f.mean_slope_bytes_per_record.unwrap() - 37.5).abs() < 1e-6);
        assert!((f.warmup_sample_s - 10.01).abs() < 1e-9);
        assert_eq!(f.acked, 20_000_000);
    }

    #[test]
    fn without_the_gauge_the_index_is_na_and_ratios_say_so() {
        let new = figures(&outcome(true));
        let mut old = figures(&outcome(false));
        assert_eq!(old.nodes[0].index_end_bytes, None);
        assert_eq!(old.mean_index_per_10m_mib, None);
        old.label = "baseline".into();
        old.records_per_s = 2e6;
        let ratios = ratios(&new, &old);
        let row = |name: &str| ratios.iter().find(|r| r.figure.starts_with(name)).unwrap().clone();
        assert!((row("RSS growth").ratio.unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(row("index").ratio, None);
        assert_eq!(row("append throughput").ratio, Some(0.5));
        let report = MemoryReport {
            settings: Settings {
                command: "walship-memory".into(),
                started_utc: "now".into(),
                cores: 2,
                walship: "/bin/walship".into(),
                baseline: Some("/bin/old".into()),
                clients: 64,
                record_bytes: 100,
                duration_s: 20.0,
                warmup_s: 10.0,
                reads: 10,
                retain_bytes: 1 << 36,
                sample_every_s: 1.0,
                node_flags: Vec::new(),
            },
            disk: DiskBaseline {
                fdatasync_4k_p50_us: 100.0,
                fdatasync_4k_p99_us: 200.0,
                fdatasync_4k_p999_us: 300.0,
                seq_write_mib_s: 500.0,
                fdatasync_4k_three_p50_us: 250.0,
                fdatasync_4k_three_p99_us: 600.0,
            },
            runs: vec![new, old],
            ratios,
        };
        let md = report.markdown();
        assert!(
            md.contains("| new | 1 | leader | 100.0 | 576.8 | 1053.7 | 20000001 | 476.8 | 50.0 | 50.0 | 76.3 | 38.1 |"),
            "{md}"
        );
        assert!(md.contains("| baseline | 1 | leader |") && md.contains("| n/a | n/a |"), "{md}");
        assert!(md.contains("| append throughput, records/s | 1000000.0 | 2000000.0 | 0.500× |"), "{md}");
        assert!(md.contains("| index per 10 M records, MiB (mean of nodes) | 28.6 | n/a | n/a |"), "{md}");
        assert!(md.contains("retention raised to 64 GiB"), "{md}");
        let csv = samples_csv(&[outcome(false)]);
        assert_eq!(csv.lines().count(), 1 + 21 * 2);
        assert!(csv.contains("\nnew,15.010,15000000,2,102,follower,"), "{csv}");
    }
}
