//! The operator files under `ops/` stay true to the code: alert rules pass
//! `promtool check rules`, every metric the alerts and the Grafana board use
//! is in the catalogue (so it exists), the deployment cluster config is
//! valid, and the systemd units only use flags the binary has.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

fn ops(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ops").join(path)).unwrap()
}

/// Metric family names a PromQL text mentions.
fn metrics_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("walship_") {
        let name: String = rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .fold(name.clone(), |n, s| n.strip_suffix(s).map(str::to_string).unwrap_or(n));
        out.insert(family);
        rest = &rest[i + name.len()..];
    }
    out
}

fn catalogued() -> BTreeSet<String> {
    ops("METRICS.md")
        .lines()
        .filter_map(|l| l.split('|').nth(1)?.trim().strip_prefix('`')?.strip_suffix('`').map(str::to_string))
        .collect()
}

#[test]
fn alert_rules_pass_promtool_and_use_real_metrics() {
    let promtool = std::env::var("WALSHIP_PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/prometheus/alerts.yml");
    let out = std::process::Command::new(&promtool).args(["check", "rules"]).arg(&path).output().unwrap_or_else(|e| {
        panic!("{promtool} not runnable ({e}): run ops/test.sh, which installs it (Debian package prometheus)")
    });
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let used = metrics_in(&ops("prometheus/alerts.yml"));
    assert!(used.len() >= 6, "{used:?}");
    let known = catalogued();
    for m in &used {
        assert!(known.contains(m), "alerts.yml uses {m}, which ops/METRICS.md does not list");
    }
}

#[test]
fn grafana_board_parses_and_uses_real_metrics() {
    let board: serde_json::Value = serde_json::from_str(&ops("grafana/walship.json")).unwrap();
    let panels = board["panels"].as_array().unwrap();
    assert!(panels.len() >= 8);
    let titles: Vec<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();
    for wanted in [
        "Follower lag (records)",
        "Follower lag (bytes)",
        "Commit vs durable positions",
        "Failovers",
        "Catch-up bytes by source",
    ] {
        assert!(titles.iter().any(|t| t.starts_with(wanted)), "no panel {wanted:?} in {titles:?}");
    }
    let known = catalogued();
    for panel in panels {
        for target in panel["targets"].as_array().unwrap() {
            for m in metrics_in(target["expr"].as_str().unwrap()) {
                assert!(known.contains(&m), "panel {:?} uses {m}, not in ops/METRICS.md", panel["title"]);
            }
        }
    }
}

#[test]
fn deployment_cluster_config_is_valid() {
    let config: walship_shipping::ClusterConfig = toml::from_str(&ops("deploy/cluster.toml")).unwrap();
    config.validate().unwrap();
    assert_eq!(config.nodes.len(), 3);
    assert!(config.coordinated());
    assert!(config.secret_file.is_some(), "the deployment names where its cluster secret lives");
}

#[test]
fn systemd_units_use_real_flags() {
    for (unit, sub) in
        [("deploy/systemd/walship-node.service", "node"), ("deploy/systemd/walship-coord.service", "coord")]
    {
        let text = ops(unit);
        let exec = text.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap();
        assert!(exec.contains(&format!("walship {sub} ")), "{exec}");
        let help = std::process::Command::new(common::walship_bin()).args([sub, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        for flag in exec.split_whitespace().filter(|w| w.starts_with("--")) {
            assert!(help.contains(flag), "{unit}: `walship {sub}` has no {flag}");
        }
    }
}

#[test]
fn kubernetes_manifests_hold_a_valid_cluster_and_real_flags() {
    let text = ops("deploy/kubernetes/walship.yaml");
    let docs: Vec<serde_yaml::Value> =
        serde_yaml::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect();
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for wanted in ["ConfigMap", "StatefulSet", "Deployment", "Service"] {
        assert!(kinds.contains(&wanted), "no {wanted} in {kinds:?}");
    }
    let config_map = docs.iter().find(|d| d["kind"] == "ConfigMap").unwrap();
    let cluster: walship_shipping::ClusterConfig =
        toml::from_str(config_map["data"]["cluster.toml"].as_str().unwrap()).unwrap();
    cluster.validate().unwrap();
    assert!(cluster.coordinated());
    let help = |sub: &str| {
        String::from_utf8_lossy(
            &std::process::Command::new(common::walship_bin()).args([sub, "--help"]).output().unwrap().stdout,
        )
        .to_string()
    };
    let (node_help, coord_help) = (help("node"), help("coord"));
    for doc in docs.iter().filter(|d| d["kind"] == "StatefulSet" || d["kind"] == "Deployment") {
        let container = &doc["spec"]["template"]["spec"]["containers"][0];
        let args: Vec<String> =
            container["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect();
        let words: Vec<&str> = args.iter().flat_map(|a| a.split_whitespace()).collect();
        let sub_help = if words.contains(&"node") { &node_help } else { &coord_help };
        for flag in words.iter().filter(|w| w.starts_with("--")) {
            assert!(sub_help.contains(flag), "{}: unknown flag {flag}", doc["metadata"]["name"].as_str().unwrap());
        }
        assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
        let env = container["env"].as_sequence().expect("an env list");
        assert!(
            env.iter().any(|e| e["name"] == "WALSHIP_CLUSTER_SECRET"
                && e["valueFrom"]["secretKeyRef"]["name"] == "walship-cluster"),
            "{}: no cluster secret from a Secret",
            doc["metadata"]["name"].as_str().unwrap()
        );
    }
}
