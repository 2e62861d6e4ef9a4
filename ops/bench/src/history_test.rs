//! [`check`] against a scripted `Log` server on a real loopback socket:
//! which (shard, node) pairs are read, asked again, or given up.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status, Streaming};
use walship_proto::log::log_server::{Log, LogServer};
use walship_proto::log::{
    AppendRequest, AppendResponse, AppendStreamRequest, AppendStreamResponse, ReadRequest, ReadResponse, Record,
    TailRequest, TailResponse,
};

use super::{ShardHistory, check, payload};

/// How the scripted node answers reads of one shard.
#[derive(Clone, Copy)]
enum Script {
    /// `DATA_LOSS` this many more times, then every acknowledged record.
    DamagedFor(u32),
    /// `DATA_LOSS` every time.
    Damaged,
    /// `UNAVAILABLE` (not caught up, say).
    Unavailable,
}

/// A node holding records 1..=3 of every shard, answering each shard's
/// reads as its script says (every acknowledged record when it has none);
/// counts the reads asked of each shard.
struct Node {
    scripts: Mutex<HashMap<u32, Script>>,
    reads: Mutex<HashMap<u32, u32>>,
}

type Stream<T> = futures::stream::BoxStream<'static, Result<T, Status>>;

#[tonic::async_trait]
impl Log for Node {
    async fn append(&self, _: Request<AppendRequest>) -> Result<Response<AppendResponse>, Status> {
        Err(Status::unimplemented("reads only"))
    }

    type AppendStreamStream = Stream<AppendStreamResponse>;

    async fn append_stream(
        &self,
        _: Request<Streaming<AppendStreamRequest>>,
    ) -> Result<Response<Self::AppendStreamStream>, Status> {
        Err(Status::unimplemented("reads only"))
    }

    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadResponse>, Status> {
        let shard = request.into_inner().shard_id;
        *self.reads.lock().entry(shard).or_default() += 1;
        let mut scripts = self.scripts.lock();
        match scripts.get(&shard).copied() {
            Some(Script::DamagedFor(n)) if n > 0 => {
                scripts.insert(shard, Script::DamagedFor(n - 1));
                return Err(Status::data_loss(format!("shard {shard}: corruption: stored records [2, 2]")));
            }
            Some(Script::Damaged) => return Err(Status::data_loss(format!("shard {shard}: corruption"))),
            Some(Script::Unavailable) => return Err(Status::unavailable("committed up to seqno 0")),
            _ => {}
        }
        let records = (1..=3)
            .map(|seqno| Record { seqno, payload: payload(1, shard, seqno, 20), ..Default::default() })
            .collect();
        Ok(Response::new(ReadResponse { records, next_seqno: 4, ..Default::default() }))
    }

    type TailStream = Stream<TailResponse>;

    async fn tail(&self, _: Request<TailRequest>) -> Result<Response<Self::TailStream>, Status> {
        Err(Status::unimplemented("reads only"))
    }
}

async fn start(scripts: &[(u32, Script)]) -> (String, Arc<Node>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let node = Arc::new(Node { scripts: Mutex::new(scripts.iter().copied().collect()), reads: Mutex::default() });
    tokio::spawn(
        Server::builder()
            .add_service(LogServer::from_arc(node.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (addr, node)
}

fn histories(shards: &[u32]) -> Vec<ShardHistory> {
    shards
        .iter()
        .map(|&shard| ShardHistory {
            shard,
            acked: (1..=3).map(|seqno| (seqno, payload(1, shard, seqno, 20))).collect::<Vec<(u64, Bytes)>>(),
            ..Default::default()
        })
        .collect()
}

#[tokio::test]
async fn a_damaged_shard_is_asked_again_until_repaired_and_costs_the_node_no_other_shard() {
    let (addr, node) = start(&[(1, Script::DamagedFor(2)), (2, Script::Damaged)]).await;
    let verdict = check(&histories(&[1, 2, 3]), std::slice::from_ref(&addr), Duration::from_secs(3), 0).await;
    assert_eq!(verdict.lost, 0, "{verdict:?}");
    // Shard 1 read once repaired, shard 2 never, shard 3 still asked.
    assert_eq!((verdict.checked, verdict.repaired, verdict.unchecked), (2, 1, 1), "{verdict:?}");
    assert_eq!(verdict.shards_unread, 1, "{verdict:?}");
    assert_eq!(verdict.unreadable.len(), 1, "{verdict:?}");
    assert!(verdict.unreadable[0].starts_with(&format!("{addr}: reading shard 2 ")), "{verdict:?}");
    let reads = node.reads.lock().clone();
    assert_eq!(reads[&1], 3, "two DATA_LOSS answers, then the read: {reads:?}");
    assert!(reads[&2] >= 2, "asked again while the wait lasted: {reads:?}");
    assert_eq!(reads[&3], 1, "{reads:?}");
}

#[tokio::test]
async fn a_node_that_cannot_answer_is_not_asked_for_the_other_shards() {
    let (addr, node) = start(&[(1, Script::Unavailable)]).await;
    let verdict = check(&histories(&[1, 2]), &[addr], Duration::from_secs(3), 0).await;
    assert_eq!((verdict.checked, verdict.unchecked, verdict.repaired), (0, 2, 0), "{verdict:?}");
    assert_eq!(verdict.unreadable.len(), 1, "the node, once: {verdict:?}");
    let reads = node.reads.lock().clone();
    assert_eq!(reads.get(&1), Some(&1), "not asked again: {reads:?}");
    assert_eq!(reads.get(&2), None, "{reads:?}");
}
