//! The cluster config: parsing, checks and lookups.

use super::*;

fn node(id: NodeId, port: u16) -> NodeSpec {
    NodeSpec {
        id,
        grpc_addr: format!("127.0.0.1:{port}").parse().unwrap(),
        admin_addr: format!("127.0.0.1:{}", port + 100).parse().unwrap(),
        region: 0,
    }
}

fn three() -> ClusterConfig {
    ClusterConfig {
        cluster_id: "t".into(),
        coordinators: Vec::new(),
        nodes: vec![node(1, 7001), node(2, 7002), node(3, 7003)],
        shards: vec![ShardSpec { id: 1, replicas: vec![1, 2, 3], leader: 1, epoch: 1 }],
        replication: ReplicationConfig::default(),
        secret: None,
        secret_file: None,
        insecure_no_auth: false,
        tls: None,
        archive: None,
        producers: Default::default(),
    }
}

#[test]
fn shards_whose_replicas_could_span_more_regions_are_named() {
    let mut c = three();
    assert_eq!(c.unspread_shards(), vec![], "one region: nothing to spread over");
    c.nodes[2].region = 1;
    assert_eq!(c.unspread_shards(), vec![], "two regions, spanned");
    c.nodes.push(node(4, 7004));
    c.nodes[3].region = 2;
    assert_eq!(c.unspread_shards(), vec![(1, 2, 3)], "three regions, the shard spans two");
    c.shards.push(ShardSpec { id: 2, replicas: vec![1, 2], leader: 1, epoch: 1 });
    assert_eq!(c.unspread_shards(), vec![(1, 2, 3), (2, 1, 2)]);
}

#[test]
fn the_secret_comes_from_env_then_config_then_file_and_is_required() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = three();
    let error = c.resolve_secret(dir.path(), None).unwrap_err().to_string();
    assert!(error.contains("no cluster secret") && error.contains("WALSHIP_CLUSTER_SECRET"), "{error}");
    c.insecure_no_auth = true;
    c.resolve_secret(dir.path(), None).unwrap();
    assert!(c.secret().is_none());

    let mut c = three();
    std::fs::write(dir.path().join("s"), "from-the-file-0123456789\n").unwrap();
    c.secret_file = Some("s".into());
    c.resolve_secret(dir.path(), None).unwrap();
    assert!(c.secret().unwrap().matches(b"from-the-file-0123456789"));
    c.resolve_secret(dir.path(), Some("from-the-environment-0123".into())).unwrap();
    assert!(c.secret().unwrap().matches(b"from-the-environment-0123"), "the environment wins");
    let error = c.resolve_secret(dir.path(), Some("short".into())).unwrap_err().to_string();
    assert!(error.contains("WALSHIP_CLUSTER_SECRET") && error.contains("at least 16"), "{error}");

    let mut c = three();
    c.secret_file = Some("missing".into());
    assert!(c.resolve_secret(dir.path(), None).unwrap_err().to_string().contains("missing"));
    let parsed: Result<ClusterConfig, _> = toml::from_str("nodes = []\nshards = []\nsecret = \"tooshort\"\n");
    assert!(parsed.unwrap_err().to_string().contains("at least 16"));
}

#[test]
fn saving_puts_the_secret_in_a_private_file_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mut c = three();
    c.secret = Some(ClusterSecret::new("saved-secret-0123456789").unwrap());
    let path = dir.path().join("cluster.toml");
    c.save(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("saved-secret"), "{text}");
    let secret_file = dir.path().join("cluster.toml.secret");
    assert_eq!(std::fs::metadata(&secret_file).unwrap().permissions().mode() & 0o777, 0o600);
    let loaded = ClusterConfig::load(&path).unwrap();
    assert!(loaded.secret().unwrap().matches(b"saved-secret-0123456789"));
}

#[test]
fn example_cluster_config_parses_and_is_valid() {
    let config: ClusterConfig = toml::from_str(include_str!("../../ops/cluster.example.toml")).unwrap();
    config.validate().unwrap();
    assert!(config.secret_file.is_some(), "the example shows where the secret lives");
    assert_eq!(config.shards_of(2).len(), 3);
    assert_eq!(config.replication.heartbeat_to, Some("10.0.0.1:7400".parse().unwrap()));
    // Every [replication] key the example shows carries the default.
    let defaults = ReplicationConfig { heartbeat_to: config.replication.heartbeat_to, ..Default::default() };
    assert_eq!(config.replication, defaults);
}

#[test]
fn addresses_take_names_and_refuse_nonsense() {
    let a: Address = "walship-node-0.walship-node:7400".parse().unwrap();
    assert_eq!(a.port(), 7400);
    assert_eq!("[::1]:7400".parse::<Address>().unwrap().port(), 7400);
    assert!("127.0.0.1:7400".parse::<Address>().unwrap().resolve().is_ok());
    for bad in ["nohost", ":7400", "host:", "host:99999", "a b:1"] {
        assert!(bad.parse::<Address>().is_err(), "{bad}");
    }
    assert!(toml::from_str::<NodeSpec>("id = 1\ngrpc_addr = \"x\"\nadmin_addr = \"y:1\"").is_err());
}

#[test]
fn valid_config_passes() {
    three().validate().unwrap();
}

#[test]
fn each_mistake_is_named() {
    type Mutation = fn(&mut ClusterConfig);
    let cases: Vec<(Mutation, &str)> = vec![
        (|c| c.nodes[1].id = 1, "node id 1 appears twice"),
        (|c| c.nodes[1].grpc_addr = c.nodes[0].grpc_addr.clone(), "used twice"),
        (|c| c.shards[0].replicas = vec![1, 1], "distinct"),
        (|c| c.shards[0].replicas = vec![1, 9], "replica 9 is not a configured node"),
        (|c| c.shards[0].leader = 4, "leader 4 is not one of its replicas"),
        (|c| c.shards[0].epoch = 0, "epochs start at 1"),
        (|c| c.shards.push(c.shards[0].clone()), "shard 1 appears twice"),
        (|c| c.replication.ship_window = 0, "ship_window"),
        (|c| c.replication.full_report_ms = 10, "full_report_ms must be within heartbeat_ms (50)"),
        (|c| c.replication.full_report_ms = 3_600_001, "full_report_ms must be within"),
    ];
    for (mutate, expected) in cases {
        let mut config = three();
        mutate(&mut config);
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(expected), "{err:?} should mention {expected:?}");
    }
}
