//! The in-memory tail cache is bounded per node, not only per shard: three
//! nodes (real processes, RF=3) host 12 shards with a node budget of 32 KiB
//! (`wal.tail_cache_total_bytes`) and the default 8 MiB per shard; each
//! shard is written 48 KiB. Every node then holds under twice the node
//! budget (a per-shard bound alone let it hold everything: 576 KiB here,
//! 8 GiB at 1,000 shards), and every record, most of them no longer in
//! memory, reads back intact from every replica.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Acked, Cluster, ClusterSpec};
use walship_proto::log::Durability;
use walship_proto::log::log_client::LogClient;

const SHARDS: u32 = 12;
const NODE_BUDGET: usize = 32 << 10;
const RECORDS: usize = 48;
const RECORD_BYTES: usize = 1 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_keeps_its_shards_tails_within_its_budget_and_reads_the_rest_from_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let node_args = (1..=3)
        .map(|id| {
            let config = dir.path().join(format!("node-{id}.toml"));
            // node_id and data_dir are overridden by the flags the cluster passes.
            let toml =
                format!("node_id = {id}\ndata_dir = \"unused\"\n[wal]\ntail_cache_total_bytes = {NODE_BUDGET}\n");
            std::fs::write(&config, toml).unwrap();
            (id, vec!["--config".to_string(), config.display().to_string()])
        })
        .collect();
    let mut cluster = Cluster::launch(&ClusterSpec { shards: SHARDS, node_args, ..ClusterSpec::default() });

    let acked: Acked = Acked::default();
    for shard in 1..=SHARDS {
        // Static cluster: shard s is led by node (s - 1) % 3 + 1.
        let leader = (shard - 1) % 3 + 1;
        let mut log = cluster.node(leader).client().await;
        for n in 0..RECORDS {
            let payload = Bytes::from(format!("{shard:02}-{n:03}-").repeat(RECORD_BYTES / 7));
            common::append_and_record(&mut log, shard, vec![payload], Durability::All, Duration::from_secs(10), &acked)
                .await
                .unwrap_or_else(|status| panic!("append {n} to shard {shard}: {status}"));
        }
    }

    let written = (SHARDS as usize * RECORDS * RECORD_BYTES) as f64;
    for id in 1..=3 {
        let admin = cluster.node(id).admin.clone();
        let cached = common::metric(&admin, "walship_wal_tail_cache_bytes").await;
        assert!(cached > 0.0, "node {id} caches its shards' newest records");
        assert!(
            cached <= 2.0 * NODE_BUDGET as f64,
            "node {id} caches {cached} bytes of the {written} written: over twice its {NODE_BUDGET}-byte budget"
        );
    }
    let acked = acked.lock().await;
    for id in 1..=3 {
        let grpc = cluster.node(id).grpc.clone();
        for shard in 1..=SHARDS {
            // A follower serves what it knows committed; the last commit
            // reaches it with the leader's next keepalive.
            common::wait_until("the last record to be readable", Duration::from_secs(10), || {
                readable(&grpc, shard, RECORDS as u64)
            })
            .await;
            let records = common::read_all(&grpc, shard, RECORDS as u64).await;
            assert_eq!(records.len(), RECORDS, "node {id} shard {shard}");
            for r in records {
                assert_eq!(r.payload, acked[&shard][&r.seqno], "node {id} shard {shard} seqno {}", r.seqno);
            }
        }
    }
}

/// Whether `grpc` serves seqno `seqno` of `shard`.
async fn readable(grpc: &str, shard: u32, seqno: u64) -> bool {
    let Ok(endpoint) = tonic::transport::Endpoint::from_shared(format!("http://{grpc}")) else { return false };
    let Ok(channel) = endpoint.connect().await else { return false };
    let request =
        walship_proto::log::ReadRequest { shard_id: shard, from_seqno: seqno, to_seqno: seqno, ..Default::default() };
    LogClient::new(channel).read(request).await.is_ok()
}
