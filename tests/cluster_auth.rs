//! The cluster's own RPCs (`Control`, `WalShipping`, the coordinator's
//! heartbeat endpoint) admit only callers holding the cluster secret; a
//! caller without it, or with a wrong one, gets `UNAUTHENTICATED` and
//! changes nothing, while clients of `Log` keep working. Real node and
//! coordinator processes over real sockets.

mod common;

use std::time::Duration;

use common::{Cluster, SECRET, wait_until};
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use walship_proto::log::control_client::ControlClient;
use walship_proto::log::{
    AppendRecord, AppendRequest, AssignManyRequest, AssignRequest, Durability, EpochEndRequest, FenceManyRequest,
    FenceRequest, PauseRequest, PositionRequest,
};
use walship_proto::replication::wal_shipping_client::WalShippingClient;
use walship_proto::replication::{HeartbeatRequest, ShipSegmentRequest, StreamRequest, WalSegmentId};
use walship_shipping::auth::{ClusterSecret, SECRET_HEADER};

async fn connect(grpc: &str) -> Channel {
    Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap()
}

/// A channel whose calls carry `secret` (or nothing) as their cluster secret.
fn offering(
    channel: Channel,
    secret: Option<&'static str>,
) -> InterceptedService<Channel, impl tonic::service::Interceptor + Clone> {
    InterceptedService::new(channel, move |mut request: tonic::Request<()>| {
        if let Some(secret) = secret {
            request.metadata_mut().insert(SECRET_HEADER, secret.parse().unwrap());
        }
        Ok(request)
    })
}

/// Every way a stranger might call a cluster RPC on `grpc`, each of which
/// must be refused as unauthenticated.
async fn assert_every_cluster_rpc_refused(grpc: &str, secret: Option<&'static str>) {
    let channel = offering(connect(grpc).await, secret);
    let mut control = ControlClient::new(channel.clone());
    let mut shipping = WalShippingClient::new(channel);
    let calls: Vec<(&str, Result<(), tonic::Status>)> = vec![
        ("Fence", control.fence(FenceRequest { shard_id: 1, epoch: 1 << 62 }).await.map(drop)),
        (
            "Assign",
            control
                .assign(AssignRequest { shard_id: 1, epoch: 1 << 62, leader: 2, ..Default::default() })
                .await
                .map(drop),
        ),
        (
            "FenceMany",
            control
                .fence_many(FenceManyRequest { fences: vec![FenceRequest { shard_id: 1, epoch: 1 << 62 }] })
                .await
                .map(drop),
        ),
        (
            "AssignMany",
            control
                .assign_many(AssignManyRequest {
                    assigns: vec![AssignRequest { shard_id: 1, epoch: 1 << 62, leader: 2, ..Default::default() }],
                })
                .await
                .map(drop),
        ),
        ("Position", control.position(PositionRequest { shard_id: 1 }).await.map(drop)),
        ("EpochEnd", control.epoch_end(EpochEndRequest { shard_id: 1, epoch: 1 }).await.map(drop)),
        ("Pause", control.pause(PauseRequest { shard_id: 1, paused: true }).await.map(drop)),
        (
            "ShipSegment",
            shipping
                .ship_segment(ShipSegmentRequest {
                    id: Some(WalSegmentId { region_id: 1, shard_id: 1, seqno: 1 << 40 }),
                    epoch: 1 << 62,
                    leader_node_id: 2,
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "StreamSegments",
            shipping
                .stream_segments(StreamRequest { shard_id: 1, from_seqno: 1, epoch: 1 << 62, follower_node_id: 2 })
                .await
                .map(drop),
        ),
        (
            "Heartbeat",
            shipping.heartbeat(HeartbeatRequest { node_id: 2, shard_id: 1, ..Default::default() }).await.map(drop),
        ),
    ];
    for (name, result) in calls {
        let status = result.expect_err(&format!("{name} without the cluster secret was admitted"));
        assert_eq!(status.code(), Code::Unauthenticated, "{name}: {status:?}");
        assert!(status.message().contains("cluster secret"), "{name}: {status:?}");
        assert!(!status.message().contains(SECRET), "{name} must not echo the secret: {status:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_rpcs_without_the_secret_are_refused_and_change_nothing() {
    let mut cluster = Cluster::start_with(3, 1, 1, "", None);
    wait_until("a leader recorded for shard 1", Duration::from_secs(30), || {
        let leader = futures::executor::block_on(cluster.leader_of(1, 1));
        async move { leader.is_some() }
    })
    .await;
    let (leader, epoch) = cluster.leader_of(1, 1).await.unwrap();
    // Recorded by the coordinator is not yet leading: wait for the node.
    cluster.wait_node_leads(leader, 1, Duration::from_secs(30)).await;
    let follower = if leader == 1 { 2 } else { 1 };
    let epoch_of = |status: Option<serde_json::Value>| status.map(|s| s["shards"][0]["epoch"].clone());
    wait_until("every replica in the leader's epoch", Duration::from_secs(30), || {
        let all = (1..=3).all(|id| epoch_of(futures::executor::block_on(cluster.status(id))) == Some(epoch.into()));
        async move { all }
    })
    .await;

    for id in [leader, follower] {
        let grpc = cluster.node(id).grpc.clone();
        assert_every_cluster_rpc_refused(&grpc, None).await;
        assert_every_cluster_rpc_refused(&grpc, Some("not-the-cluster-secret-0123")).await;
        // The right secret with a byte changed, and with a byte more.
        assert_every_cluster_rpc_refused(&grpc, Some("test-cluster-secret-0123456788")).await;
        assert_every_cluster_rpc_refused(&grpc, Some("test-cluster-secret-01234567890")).await;
    }
    let coordinator = cluster.coordinator(1).grpc.clone();
    let mut heartbeats = WalShippingClient::new(connect(&coordinator).await);
    let refused = heartbeats.heartbeat(HeartbeatRequest { node_id: leader, shard_id: 1, ..Default::default() }).await;
    assert_eq!(refused.unwrap_err().code(), Code::Unauthenticated, "the coordinator's heartbeat endpoint");

    // Nothing changed: the same leader and epoch, every replica still in
    // it, and the shard takes QUORUM appends from a client without any
    // secret.
    assert_eq!(cluster.leader_of(1, 1).await, Some((leader, epoch)));
    for id in 1..=3 {
        assert_eq!(epoch_of(cluster.status(id).await), Some(epoch.into()), "node {id}'s epoch changed");
    }
    let mut log = cluster.node(leader).client().await;
    let request = AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: b"k".to_vec().into(), payload: b"after the strangers".to_vec().into() }],
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    let appended = log.append(request).await.expect("a client append needs no cluster secret").into_inner();
    assert!(appended.last_seqno >= 1);

    // A member's call is admitted: the right secret reaches the handler.
    let member = ControlClient::new(common::as_member(connect(&cluster.node(follower).grpc).await))
        .position(PositionRequest { shard_id: 1 })
        .await
        .expect("a member's Position");
    assert_eq!(member.into_inner().node_id, follower);
    assert!(ClusterSecret::new(SECRET).unwrap().matches(SECRET.as_bytes()));
}

/// A node or coordinator whose cluster config names no secret refuses to
/// start, and says how to set one; `insecure_no_auth = true` is the
/// explicit way out.
#[test]
fn a_cluster_without_a_secret_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let (g, a) = (common::free_port(), common::free_port());
    let base = format!(
        "[[nodes]]\nid = 1\ngrpc_addr = \"127.0.0.1:{g}\"\nadmin_addr = \"127.0.0.1:{a}\"\n\
         [[shards]]\nid = 1\nreplicas = [1]\nleader = 1\n"
    );
    let config = dir.path().join("cluster.toml");
    std::fs::write(&config, &base).unwrap();
    let run = |extra_env: Option<(&str, &str)>| {
        let mut command = std::process::Command::new(common::walship_bin());
        command.args(["node", "--node-id", "1", "--cluster"]).arg(&config).arg("--data-dir").arg(dir.path().join("d"));
        command.env_remove("WALSHIP_CLUSTER_SECRET");
        if let Some((k, v)) = extra_env {
            command.env(k, v);
        }
        command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        command.spawn().unwrap()
    };
    let out = run(None).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no cluster secret") && stderr.contains("WALSHIP_CLUSTER_SECRET"), "{stderr}");
    let out = run(Some(("WALSHIP_CLUSTER_SECRET", "short"))).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("at least 16"), "{stderr}");
    assert!(!stderr.contains("short\""), "the refused secret is not echoed: {stderr}");

    // The secret from the environment: the node starts.
    let (mut child, _) = common::spawn_listening(
        std::process::Command::new(common::walship_bin())
            .args(["node", "--node-id", "1", "--cluster"])
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("d"))
            .env("WALSHIP_CLUSTER_SECRET", SECRET),
        "node with the secret from the environment",
    );
    let _ = child.kill();
    let _ = child.wait();
}
