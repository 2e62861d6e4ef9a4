//! The Rust client's `Producer` against real processes: records batched
//! and pipelined per shard, through a leader kill and a frozen leader,
//! each acknowledged once with the seqno it holds in the log, nothing
//! written twice.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::history::{FAST, WAIT, client, converge, wait_leading};
use common::{Cluster, read_all, wait_until};
use walship_client::{Connect, Producer, ProducerConfig};

fn connect() -> Connect {
    Arc::new(|server: String| {
        Box::pin(async move {
            client(&server).await.ok_or_else(|| -> walship_client::ConnectError {
                Arc::new(std::io::Error::other(format!("cannot connect to {server}")))
            })
        })
    })
}

/// Sends `n` records to each shard through `producer`, calling `fault`
/// once a third are sent; checks every ack against the log.
async fn produce_through(
    cluster: &mut Cluster,
    producer: &Producer,
    shards: &[u32],
    n: usize,
    fault: impl AsyncFnOnce(&mut Cluster),
) {
    let mut acks = Vec::new();
    let mut fault = Some(fault);
    for i in 0..n {
        if i == n / 3 {
            // Let the first third flow, then break something mid-stream.
            tokio::time::sleep(Duration::from_millis(100)).await;
            (fault.take().unwrap())(cluster).await;
        }
        for &shard in shards {
            let payload = Bytes::from(format!("s{shard}-r{i}"));
            acks.push((shard, payload.clone(), producer.send(shard, Bytes::new(), payload).await));
        }
    }
    producer.flush().await;
    let mut expected: HashMap<u32, HashMap<u64, Bytes>> = HashMap::new();
    let mut duplicates = 0;
    for (shard, payload, ack) in acks {
        let acked = ack.await.unwrap_or_else(|e| panic!("shard {shard} {payload:?}: {e}"));
        assert_ne!(acked.seqno, 0, "{payload:?}: a batch cut by the failover");
        duplicates += acked.duplicate as usize;
        assert!(expected.entry(shard).or_default().insert(acked.seqno, payload).is_none(), "a seqno acked twice");
    }
    for &shard in shards {
        let last = converge(cluster, shard).await;
        let records = read_all(&cluster.node(1).grpc.clone(), shard, last).await;
        let mine: Vec<_> = records.iter().filter(|r| r.payload.starts_with(format!("s{shard}-").as_bytes())).collect();
        assert_eq!(mine.len(), n, "shard {shard}: every record once");
        for r in mine {
            assert_eq!(expected[&shard].get(&r.seqno), Some(&r.payload), "shard {shard} seqno {}", r.seqno);
        }
        let mut payloads: Vec<_> = records.iter().map(|r| r.payload.clone()).collect();
        payloads.sort();
        payloads.dedup();
        assert_eq!(payloads.len(), records.len(), "shard {shard}: no record twice");
    }
    eprintln!("{} records acknowledged, {duplicates} as duplicates of a lost answer", n * shards.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_delivers_every_record_once_through_a_leader_kill() {
    let mut cluster = Cluster::start_with(3, 2, 1, FAST, None);
    wait_leading(&mut cluster, 1, 1).await;
    let servers = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let config = ProducerConfig { linger: Duration::from_millis(2), batch_records: 50, ..ProducerConfig::default() };
    let producer = Producer::new(servers, connect(), config);
    produce_through(&mut cluster, &producer, &[1, 2], 3_000, async |cluster: &mut Cluster| {
        let (leader, _) = cluster.leader_of(1, 1).await.unwrap();
        cluster.node(leader).kill9();
        let victim = leader;
        wait_until("a new leader of shard 1", WAIT, || {
            let now = futures::executor::block_on(cluster.leader_of(1, 1));
            async move { now.is_some_and(|(l, _)| l != victim) }
        })
        .await;
        cluster.restart(victim);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_retries_past_a_frozen_leader() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_leading(&mut cluster, 1, 1).await;
    let servers = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let config = ProducerConfig { request_timeout: Duration::from_millis(800), ..ProducerConfig::default() };
    let producer = Producer::new(servers, connect(), config);
    produce_through(&mut cluster, &producer, &[1], 1_500, async |cluster: &mut Cluster| {
        cluster.signal(1, libc::SIGSTOP);
        wait_until("a new leader of shard 1", WAIT, || {
            let now = futures::executor::block_on(cluster.leader_of(1, 1));
            async move { now.is_some_and(|(l, _)| l != 1) }
        })
        .await;
        cluster.signal(1, libc::SIGCONT);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_record_fails_alone_and_the_rest_are_written() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_leading(&mut cluster, 1, 1).await;
    let servers = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    // One record per batch, so the oversized one is a batch of its own.
    let config = ProducerConfig { batch_records: 1, ..ProducerConfig::default() };
    let producer = Producer::new(servers, connect(), config);
    let mut acks = Vec::new();
    for i in 0..20 {
        let payload = if i == 7 { Bytes::from(vec![b'x'; 2 << 20]) } else { Bytes::from(format!("r{i}")) };
        acks.push(producer.send(1, Bytes::new(), payload).await);
    }
    let mut seqnos = Vec::new();
    for (i, ack) in acks.into_iter().enumerate() {
        match ack.await {
            Ok(acked) => seqnos.push(acked.seqno),
            Err(walship_client::ProduceError::Refused(status)) if i == 7 => {
                assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
            }
            Err(e) => panic!("record {i}: {e}"),
        }
    }
    assert_eq!(seqnos, (1..=19).collect::<Vec<_>>(), "the others written once, in order");
    let last = converge(&mut cluster, 1).await;
    assert_eq!(last, 19);
    let records = read_all(&cluster.node(1).grpc.clone(), 1, last).await;
    let sequences: Vec<u64> = records.iter().map(|r| r.producer.unwrap().sequence).collect();
    assert_eq!(sequences, (1..=19).collect::<Vec<_>>(), "the refused record's sequence was reused: no gap");
}
