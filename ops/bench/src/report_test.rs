use super::*;

fn cell(system: &str, size: usize, clients: usize, records_per_s: f64) -> Cell {
    Cell {
        system: system.into(),
        record_bytes: size,
        clients,
        records_per_s,
        mib_per_s: records_per_s * size as f64 / 1048576.0,
        p50_us: 1000.0,
        p99_us: 2000.0,
        p999_us: 3000.0,
        disk_ratio: 0.1,
        cdf: Vec::new(),
    }
}

fn report() -> Report {
    Report {
        settings: Settings {
            command: "walship-compare".into(),
            started_utc: "now".into(),
            cores: 2,
            duration_s: 8.0,
            warmup_s: 2.0,
            low_load_fraction: 0.25,
            low_load_rate: None,
            low_load_clients: Some(64),
            failover_clients: 16,
            walship_baseline: None,
        },
        baseline: DiskBaseline {
            fdatasync_4k_p50_us: 100.0,
            fdatasync_4k_p99_us: 200.0,
            fdatasync_4k_p999_us: 300.0,
            seq_write_mib_s: 500.0,
            fdatasync_4k_three_p50_us: 250.0,
            fdatasync_4k_three_p99_us: 600.0,
        },
        cells: vec![
            cell("walship-quorum", 100, 64, 30_000.0),
            cell("jetstream-r3", 100, 64, 10_000.0),
            cell("postgres-sync", 100, 64, 12_000.0),
            cell("walship-quorum", 4096, 64, 9_000.0),
            cell("postgres-sync", 4096, 64, 3_000.0),
        ],
        low_load: vec![LowLoadCell {
            system: "walship-quorum".into(),
            record_bytes: 100,
            clients: 64,
            offered_per_s: 7500.0,
            achieved_per_s: 7500.0,
            p50_us: 300.0,
            p99_us: 700.0,
            p999_us: 900.0,
            p99_vs_fdatasync_p99: 3.5,
        }],
        failover: vec![
            FailoverRow { system: "walship-quorum".into(), trials_ms: vec![240.0, 230.0, 250.0], note: String::new() },
            FailoverRow { system: "postgres-sync".into(), trials_ms: Vec::new(), note: "none built in".into() },
        ],
        dedupe_cost: Vec::new(),
    }
}

#[test]
fn ratios_and_verdicts_come_from_the_same_cells() {
    let r = report();
    assert_eq!(r.ratio("walship-quorum", "jetstream-r3", 100, 64), Some(3.0));
    assert_eq!(r.ratio("walship-quorum", "jetstream-r3", 4096, 64), None, "no JetStream cell at 4 KiB");
    let targets = r.targets();
    assert!(
        targets.iter().any(|t| t.contains("100 B: walship-quorum ÷ jetstream-r3 = 3.000× (target ≥ 3×: met)")),
        "{targets:?}"
    );
    assert!(
        targets.iter().any(|t| t.contains("100 B: walship-quorum ÷ postgres-sync = 2.500× (target ≥ 3×: NOT met)")),
        "{targets:?}"
    );
    assert!(
        targets.iter().any(|t| t.contains("4096 B: walship-quorum ÷ postgres-sync = 3.000× (target ≥ 3×: met)")),
        "{targets:?}"
    );
    assert!(targets.iter().any(|t| t.contains("3.50× fdatasync p99 (target ≤ 3×: NOT met)")), "{targets:?}");
    assert_eq!(targets.len(), 4, "no verdict without both cells: {targets:?}");
}

#[test]
fn a_ratio_just_short_of_the_target_does_not_print_as_the_target() {
    let mut r = report();
    r.cells.push(cell("jetstream-r3", 4096, 64, 3_005.0));
    let targets = r.targets();
    assert!(
        targets.iter().any(|t| t.contains("4096 B: walship-quorum ÷ jetstream-r3 = 2.995× (target ≥ 3×: NOT met)")),
        "{targets:?}"
    );
}

#[test]
fn markdown_shows_every_system_ratio_and_failover_row() {
    let md = report().markdown();
    assert!(md.contains("| 100 | 64 | 30000 | 10000 | 12000 | 3.00× | 2.50× |"), "{md}");
    assert!(md.contains("| 4096 | 64 | 9000 | – | 3000 | – | 3.00× |"), "{md}");
    assert!(md.contains("| walship-quorum | 3 | 240 | 250 | 240, 230, 250 |"), "{md}");
    assert!(md.contains("| postgres-sync | 0 | – | – | none built in |"), "{md}");
    assert!(md.contains("Latency at 25 % of each system's peak"), "{md}");
}

#[test]
fn the_open_loop_cell_takes_the_peak_cells_rate_and_clients() {
    let mut cells = report().cells;
    cells.push(cell("walship-quorum", 100, 256, 90_000.0));
    cells.push(cell("walship-quorum", 100, 16, 12_000.0));
    assert_eq!(peak(&cells, "walship-quorum", 100), (90_000.0, 256));
    assert_eq!(peak(&cells, "postgres-sync", 4096), (3_000.0, 64));
    assert_eq!(peak(&cells, "jetstream-r3", 4096), (0.0, 1), "no cell: nothing to take");
    let md = report().markdown();
    assert!(md.contains("| walship-quorum | 100 | 64 | 7500 | 7500 |"), "the clients column: {md}");
    let mut r = report();
    r.settings.low_load_clients = None;
    assert!(r.markdown().contains("as many clients as the system's peak cell"), "{}", r.markdown());
}

#[test]
fn a_baseline_walship_gets_its_ratio_column_and_nothing_changes_without_it() {
    let plain = report().markdown();
    assert!(!plain.contains(BASELINE), "{plain}");
    assert!(!serde_json::to_string(&report()).unwrap().contains("walship_baseline"));
    let mut r = report();
    r.settings.walship_baseline = Some("/work/old/walship".into());
    r.cells.insert(1, cell(BASELINE, 100, 64, 24_000.0));
    let md = r.markdown();
    assert!(md.contains("`walship-quorum-baseline` is `walship-quorum` (same cluster"), "{md}");
    assert!(md.contains("from `/work/old/walship`"), "{md}");
    assert!(
        md.contains(
            "| record B | clients | walship-quorum | walship-quorum-baseline | jetstream-r3 | postgres-sync | \
             walship-quorum ÷ jetstream-r3 | walship-quorum ÷ postgres-sync | \
             walship-quorum ÷ walship-quorum-baseline | walship-quorum ÷ disk limit |"
        ),
        "{md}"
    );
    assert!(md.contains("| 100 | 64 | 30000 | 24000 | 10000 | 12000 | 3.00× | 2.50× | 1.250× | 0.100 |"), "{md}");
    assert!(md.contains("| 4096 | 64 | 9000 | – | – | 3000 | – | 3.00× | – |"), "{md}");
    assert_eq!(r.targets(), report().targets(), "the targets are walship-quorum's");
}

#[test]
fn deduplicating_systems_get_their_cost_table_and_json_and_nothing_changes_without_them() {
    assert!(report().dedupe_costs().is_empty());
    assert!(!report().markdown().contains("Cost of deduplication"));
    assert!(!serde_json::to_string(&report()).unwrap().contains("dedupe_cost"));
    let mut r = report();
    r.cells.push(cell(WALSHIP_PRODUCER, 100, 64, 28_800.0));
    r.cells.push(cell(JETSTREAM_DEDUPE, 100, 64, 9_000.0));
    r.cells.push(cell(WALSHIP_PRODUCER, 4096, 64, 8_000.0));
    r.dedupe_cost = r.dedupe_costs();
    let costs = &r.dedupe_cost;
    assert_eq!(costs.len(), 3, "{costs:?}");
    assert_eq!((costs[0].system.as_str(), costs[0].without.as_str()), (WALSHIP_PRODUCER, "walship-quorum"));
    assert!((costs[0].ratio - 0.96).abs() < 1e-9);
    assert_eq!((costs[1].system.as_str(), costs[1].without.as_str()), (JETSTREAM_DEDUPE, "jetstream-r3"));
    assert!((costs[1].ratio - 0.9).abs() < 1e-9);
    assert_eq!((costs[2].record_bytes, costs[2].system.as_str()), (4096, WALSHIP_PRODUCER));
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["dedupe_cost"].as_array().unwrap().len(), 3);
    assert_eq!(json["dedupe_cost"][1]["without_records_per_s"], 10_000.0);

    let md = r.markdown();
    assert!(
        md.contains(
            "| record B | clients | walship-quorum | walship-quorum-producer | \
             walship-quorum-producer ÷ walship-quorum | jetstream-r3 | jetstream-dedupe | \
             jetstream-dedupe ÷ jetstream-r3 | walship-quorum-producer ÷ jetstream-dedupe |"
        ),
        "{md}"
    );
    assert!(md.contains("| 100 | 64 | 30000 | 28800 | 0.960× | 10000 | 9000 | 0.900× | 3.20× |"), "{md}");
    assert!(md.contains("| 4096 | 64 | 9000 | 8000 | 0.889× | – | – | – | – |"), "{md}");
    let line = "- 100 B, 64 clients: walship producer sessions cost 4.0 % of the throughput (target ≤ 5 % cost: met)";
    assert!(md.contains(line), "{md}");
    let line = "- 4096 B, 64 clients: walship producer sessions cost 11.1 % of the throughput \
                (target ≤ 5 % cost: NOT met)";
    assert!(md.contains(line), "{md}");
    let line = "- 100 B, 64 clients: JetStream `Nats-Msg-Id` deduplication cost 10.0 % of the throughput";
    assert!(md.contains(line), "{md}");
    // The main table compares walship-quorum with the plain peers only.
    assert!(!md.contains("walship-quorum ÷ jetstream-dedupe"), "{md}");
    assert!(md.contains("| 100 | 64 | 30000 | 10000 | 12000 | 28800 | 9000 | 3.00× | 2.50× | 0.100 |"), "{md}");
    assert_eq!(r.targets(), report().targets());
    r.cells.push(cell(WALSHIP_PRODUCER, 100, 1, 1_050.0));
    r.cells.push(cell("walship-quorum", 100, 1, 1_000.0));
    let line = "- 100 B, 1 clients: walship producer sessions measured 5.0 % faster (no cost measured) \
                (target ≤ 5 % cost: met)";
    assert!(r.markdown().contains(line), "{}", r.markdown());
}

#[test]
fn the_unary_system_gets_its_ratio_columns_and_targets_and_nothing_changes_without_it() {
    assert!(report().unary_targets().is_empty());
    assert!(!report().markdown().contains(WALSHIP_UNARY));
    let mut r = report();
    r.cells.insert(1, cell(WALSHIP_UNARY, 100, 64, 26_000.0));
    r.cells.push(cell(WALSHIP_UNARY, 4096, 64, 7_000.0));
    r.cells.push(cell(WALSHIP_UNARY, 100, 1, 2_000.0));
    r.cells.push(cell("postgres-sync", 100, 1, 1_000.0));
    let md = r.markdown();
    assert!(
        md.contains(
            "| record B | clients | walship-quorum | walship-unary | jetstream-r3 | postgres-sync | \
             walship-quorum ÷ jetstream-r3 | walship-quorum ÷ postgres-sync | \
             walship-unary ÷ jetstream-r3 | walship-unary ÷ postgres-sync | walship-quorum ÷ disk limit |"
        ),
        "{md}"
    );
    assert!(
        md.contains("| 100 | 64 | 30000 | 26000 | 10000 | 12000 | 3.00× | 2.50× | 2.60× | 2.17× | 0.100 |"),
        "{md}"
    );
    assert!(md.contains("| 4096 | 64 | 9000 | 7000 | – | 3000 | – | 3.00× | – | 2.33× | 0.100 |"), "{md}");
    assert!(md.contains("| walship-unary | 100 | 64 | 26000 |"), "{md}");
    let targets = r.unary_targets();
    assert_eq!(
        targets,
        [
            "100 B, 64 clients: walship-unary ÷ jetstream-r3 = 2.600× (target ≥ 2.5×: met)",
            "100 B, 64 clients: walship-unary ÷ postgres-sync = 2.167× (target ≥ 2.5×: NOT met)",
            "4096 B, 64 clients: walship-unary ÷ postgres-sync = 2.333× (target ≥ 2.5×: NOT met)",
            "100 B, 1 client: walship-unary p50 1000 µs = 10.00× the raw 4 KiB fdatasync p50 100 µs \
             (target ≤ 1.5×: NOT met)",
            "100 B, 1 client: walship-unary ÷ postgres-sync = 2.000× (target ≥ 1.5×: met)",
        ]
    );
    assert!(md.contains("**Unary targets**"), "{md}");
    assert!(md.contains(&format!("- {}", targets[0])), "{md}");
    assert_eq!(r.targets(), report().targets(), "the issue 6 targets stay walship-quorum's");
}

#[test]
fn the_batched_system_gets_its_ratio_columns_and_the_pipelined_targets() {
    assert!(report().pipelined_targets().is_empty());
    assert!(!report().markdown().contains("Pipelined targets"));
    let mut r = report();
    r.cells.push(cell(WALSHIP_BATCHED, 100, 64, 60_000.0));
    let md = r.markdown();
    assert!(
        md.contains(
            "| record B | clients | walship-quorum | jetstream-r3 | postgres-sync | walship-batched | \
             walship-quorum ÷ jetstream-r3 | walship-quorum ÷ postgres-sync | \
             walship-batched ÷ jetstream-r3 | walship-batched ÷ postgres-sync | walship-quorum ÷ disk limit |"
        ),
        "{md}"
    );
    assert!(
        md.contains("| 100 | 64 | 30000 | 10000 | 12000 | 60000 | 3.00× | 2.50× | 6.00× | 5.00× | 0.100 |"),
        "{md}"
    );
    assert_eq!(
        r.pipelined_targets(),
        [
            "100 B, 64 clients: walship-quorum ÷ jetstream-r3 = 3.000× (target ≥ 5×: NOT met)",
            "100 B, 64 clients: walship-quorum ÷ postgres-sync = 2.500× (target ≥ 5×: NOT met)",
            "100 B, 64 clients: walship-batched ÷ jetstream-r3 = 6.000× (target ≥ 5×: met)",
            "100 B, 64 clients: walship-batched ÷ postgres-sync = 5.000× (target ≥ 5×: met)",
        ]
    );
    assert!(md.contains("**Pipelined targets**"), "{md}");
}

#[test]
fn median_and_worst_of_the_kills() {
    let row = FailoverRow { system: "x".into(), trials_ms: vec![5.0, 1.0, 3.0], note: String::new() };
    assert_eq!(row.median_and_max(), Some((3.0, 5.0)));
    assert_eq!(FailoverRow::default().median_and_max(), None);
}
