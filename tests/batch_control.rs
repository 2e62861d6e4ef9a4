//! `FenceMany` and `AssignMany`, the batched Fence and Assign a coordinator
//! sends a node when many shards fail over at once: each item is done as
//! its single call would be and answered in order, and a batch holding a
//! malformed item (or no item, or too many) is refused whole as
//! INVALID_ARGUMENT, changing nothing. Real node and coordinator processes.

mod common;

use std::time::Duration;

use common::{Cluster, wait_until};
use tonic::Code;
use tonic::transport::Endpoint;
use walship_proto::log::control_client::ControlClient;
use walship_proto::log::{AssignManyRequest, AssignRequest, FenceManyRequest, FenceRequest, PositionRequest};

type Control = ControlClient<common::Member>;

async fn control(grpc: &str) -> Control {
    let channel = Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
    ControlClient::new(common::as_member(channel))
}

/// The epoch `node` promised for `shard`.
async fn promised(control: &mut Control, shard: u32) -> u64 {
    control.position(PositionRequest { shard_id: shard }).await.unwrap().into_inner().epoch_seen
}

async fn settled(cluster: &mut Cluster) -> Vec<(u32, u64)> {
    let mut leaders = Vec::new();
    for shard in [1, 2] {
        wait_until(&format!("a leader for shard {shard}"), Duration::from_secs(30), || {
            let leader = futures::executor::block_on(cluster.leader_of(1, shard));
            async move { leader.is_some() }
        })
        .await;
        let (leader, epoch) = cluster.leader_of(1, shard).await.unwrap();
        cluster.wait_node_leads(leader, shard, Duration::from_secs(30)).await;
        leaders.push((leader, epoch));
    }
    leaders
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_batches_are_refused_whole_and_change_nothing() {
    let mut cluster = Cluster::start_with(3, 2, 1, "", None);
    let leaders = settled(&mut cluster).await;
    let node = leaders[0].0;
    let mut control = control(&cluster.node(node).grpc.clone()).await;
    let before = [promised(&mut control, 1).await, promised(&mut control, 2).await];
    let high = 1u64 << 40;
    let fence = |shard_id, epoch| FenceRequest { shard_id, epoch };
    let assign = |shard_id, epoch, leader, replicas: Vec<u32>| AssignRequest {
        shard_id,
        epoch,
        leader,
        replicas,
        ..Default::default()
    };
    let refusals: Vec<(&str, Result<(), tonic::Status>, &str)> = vec![
        ("no fence", control.fence_many(FenceManyRequest { fences: vec![] }).await.map(drop), "no item"),
        (
            "4097 fences",
            control.fence_many(FenceManyRequest { fences: vec![fence(1, high); 4097] }).await.map(drop),
            "at most 4096",
        ),
        (
            "a fence of epoch 0 after a valid one",
            control.fence_many(FenceManyRequest { fences: vec![fence(1, high), fence(2, 0)] }).await.map(drop),
            "fences[1]: epochs start at 1",
        ),
        ("no assign", control.assign_many(AssignManyRequest { assigns: vec![] }).await.map(drop), "no item"),
        (
            "an assign naming a node outside the cluster after a valid one",
            control
                .assign_many(AssignManyRequest {
                    assigns: vec![assign(1, high, node, vec![1, 2, 3]), assign(2, high, 1, vec![1, 2, 9])],
                })
                .await
                .map(drop),
            "assigns[1]: replicas: node 9 is not in the cluster config",
        ),
        (
            "an assign whose leader is not a voter",
            control
                .assign_many(AssignManyRequest {
                    assigns: vec![assign(1, high, node, vec![1, 2, 3]), assign(2, high, 3, vec![1, 2])],
                })
                .await
                .map(drop),
            "assigns[1]: leader 3 is not a voter",
        ),
        (
            "an assign of epoch 0",
            control.assign_many(AssignManyRequest { assigns: vec![assign(1, 0, node, vec![1, 2, 3])] }).await.map(drop),
            "assigns[0]: epochs start at 1",
        ),
    ];
    for (what, result, says) in refusals {
        let status = result.expect_err(&format!("{what} was accepted"));
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert!(status.message().contains(says), "{what}: {status:?} does not say {says:?}");
    }
    // Nothing changed: the valid items of the refused batches were not
    // done, the coordinator's leaders stand.
    assert_eq!([promised(&mut control, 1).await, promised(&mut control, 2).await], before);
    assert_eq!(settled(&mut cluster).await, leaders);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_item_of_a_batch_gets_its_own_outcome_in_order() {
    let mut cluster = Cluster::start_with(3, 2, 1, "", None);
    let leaders = settled(&mut cluster).await;
    // The calls below are made by hand; a coordinator would answer the
    // epochs they promise (it fails a shard over past an epoch newer than
    // its record), so only the nodes stay.
    cluster.coordinator(1).kill9();
    // A node that follows shard 1, so fencing it leaves the leader be.
    let node = (1..=3).find(|&n| n != leaders[0].0).unwrap();
    let mut control = control(&cluster.node(node).grpc.clone()).await;
    let high = 1u64 << 40;
    // Shard 2 promised `high` first, so an item below it is refused.
    let first = control.fence_many(FenceManyRequest { fences: vec![FenceRequest { shard_id: 2, epoch: high }] }).await;
    assert!(first.expect("one fence").into_inner().outcomes[0].answer.is_some());
    let outcomes = control
        .fence_many(FenceManyRequest {
            fences: vec![
                FenceRequest { shard_id: 1, epoch: high },
                FenceRequest { shard_id: 77, epoch: high },
                FenceRequest { shard_id: 2, epoch: high - 1 },
            ],
        })
        .await
        .expect("a well-formed batch")
        .into_inner()
        .outcomes;
    assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    let answer = outcomes[0].answer.as_ref().unwrap_or_else(|| panic!("shard 1: {:?}", outcomes[0]));
    assert_eq!((answer.node_id, answer.epoch_seen), (node, high), "shard 1 fenced at the new epoch");
    let not_hosted = outcomes[1].error.as_ref().expect("shard 77 is not hosted");
    assert_eq!(Code::from(not_hosted.code), Code::NotFound, "{not_hosted:?}");
    assert!(outcomes[1].answer.is_none());
    let older = outcomes[2].error.as_ref().expect("an epoch older than promised");
    assert_eq!(Code::from(older.code), Code::FailedPrecondition, "{older:?}");
    // The refused item changed nothing; the fenced one holds.
    assert_eq!(promised(&mut control, 2).await, high);
    assert_eq!(promised(&mut control, 1).await, high);

    // An assignment of an epoch older than the one just promised is
    // refused by itself; one for an unhosted shard naming no replica set
    // is not found; both answered in order.
    let outcomes = control
        .assign_many(AssignManyRequest {
            assigns: vec![
                AssignRequest { shard_id: 1, epoch: high - 1, leader: leaders[0].0, ..Default::default() },
                AssignRequest { shard_id: 78, epoch: high, leader: node, ..Default::default() },
            ],
        })
        .await
        .expect("a well-formed batch")
        .into_inner()
        .outcomes;
    let codes: Vec<Code> = outcomes.iter().map(|o| Code::from(o.error.as_ref().map_or(0, |e| e.code))).collect();
    assert_eq!(codes, [Code::FailedPrecondition, Code::NotFound], "{outcomes:?}");
    assert_eq!(promised(&mut control, 1).await, high);

    // An epoch no coordinator hands out (2^62 and up) is refused and
    // promised nowhere: promising u64::MAX would wedge the shard for good.
    for epoch in [1u64 << 62, u64::MAX] {
        let refused = control.fence(FenceRequest { shard_id: 1, epoch }).await.expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains(&epoch.to_string()), "{refused:?}");
    }
    assert_eq!(promised(&mut control, 1).await, high);
}
