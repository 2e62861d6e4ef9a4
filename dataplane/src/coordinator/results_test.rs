//! A job slower than its worker: the coordinator holds a bounded queue of
//! its results and the worker waits (over a real gRPC stream on loopback).

use std::sync::atomic::AtomicUsize;

use tokio_util::sync::CancellationToken;
use walship_proto::dataplane::data_plane_client::DataPlaneClient;
use walship_proto::dataplane::data_plane_server::DataPlaneServer;

use super::*;
use crate::bus::LocalBus;

const MIB: usize = 1 << 20;

fn settings() -> DataPlaneSettings {
    DataPlaneSettings {
        cluster_id: "c".into(),
        coordinator_id: "coord".into(),
        build_sha: "b".into(),
        build_policy: BuildPolicy::Warn,
        stall: Duration::from_secs(600),
        max_attempts: 3,
    }
}

fn batch(terminal: bool, n: usize) -> WorkerEnvelope {
    // Each payload names its place, so the order the job sees is checked.
    let mut payload = vec![0u8; MIB];
    payload[..8].copy_from_slice(&(n as u64).to_le_bytes());
    let batch = ResultBatch {
        query_id: "q-1".into(),
        worker_id: "w1".into(),
        terminal,
        row_count: 1,
        payload: payload.into(),
        err: String::new(),
        task_id: "t-1".into(),
        attempt: 0,
    };
    WorkerEnvelope { msg: Some(Up::ResultBatch(batch)) }
}

/// A worker sends 160 MiB of results to a job that takes none: the
/// coordinator reads about [`JOB_QUEUE_BYTES`] of them and then stops
/// reading the worker's stream. Once the job takes its results, every
/// batch arrives, in order, and the task succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_takes_no_results_holds_its_worker_back_within_its_queue() {
    const BATCHES: usize = 160;
    let stop = CancellationToken::new();
    let dispatcher = Dispatcher::start(settings(), Arc::new(|| Ok(())), Arc::new(LocalBus::in_memory()), stop.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .add_service(
            DataPlaneServer::new(DataPlaneService(dispatcher.clone()))
                .max_decoding_message_size(crate::MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    let server = tokio::spawn(server);

    let spec = TaskSpec {
        task_id: "t-1".into(),
        query_id: "q-1".into(),
        kind: "noop".into(),
        target: Some("w1".into()),
        shard: None,
        blob: Vec::new(),
        deadline_unix_nano: 0,
    };
    let mut events = dispatcher.submit("q-1", vec![spec]);

    let (tx, rx) = mpsc::channel(1);
    let hello = Hello { worker_id: "w1".into(), build_sha: "b".into(), num_cpus: 1, gomemlimit: 0 };
    tx.send(WorkerEnvelope { msg: Some(Up::Hello(hello)) }).await.unwrap();
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{address}")).unwrap().connect().await.unwrap();
    let mut client = DataPlaneClient::new(channel).max_encoding_message_size(crate::MAX_MESSAGE_BYTES);
    let mut inbound = client.connect(ReceiverStream::new(rx)).await.unwrap().into_inner();
    let mut dispatched = false;
    while !dispatched {
        let message = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await;
        match message.expect("a message within 10 s").unwrap().and_then(|m| m.msg) {
            Some(Down::TaskDispatch(d)) => dispatched = d.task_id == "t-1",
            Some(_) => {}
            None => panic!("the stream ended before the task was dispatched"),
        }
    }

    let sent = Arc::new(AtomicUsize::new(0));
    let sender = {
        let sent = sent.clone();
        tokio::spawn(async move {
            for n in 0..BATCHES {
                tx.send(batch(n + 1 == BATCHES, n)).await.unwrap();
                sent.fetch_add(1, Ordering::SeqCst);
            }
            tx
        })
    };
    // Until the worker's sends stop going through.
    let mut last = usize::MAX;
    while sent.load(Ordering::SeqCst) != last {
        last = sent.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // What went through is the job's queue plus what the channel, tonic's
    // and hyper's buffers and the HTTP/2 windows hold on the way.
    let slack = 16;
    assert!(
        last < JOB_QUEUE_BYTES / MIB + slack,
        "{last} MiB went through to a job that took nothing; its queue holds {} MiB",
        JOB_QUEUE_BYTES / MIB
    );
    assert!(
        last >= JOB_QUEUE_BYTES / MIB,
        "only {last} MiB went through: the queue should take {}",
        JOB_QUEUE_BYTES / MIB
    );
    assert!(!sender.is_finished(), "the worker is held back");

    // The job takes its results: every batch, in order, then the end.
    let mut taken = 0;
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), events.recv()).await;
        match event.expect("an event within 30 s").expect("the job's events go on") {
            JobEvent::Batch { batch, .. } => {
                assert_eq!(u64::from_le_bytes(batch.payload[..8].try_into().unwrap()), taken as u64);
                taken += 1;
            }
            JobEvent::Finished { state, error, .. } => {
                assert_eq!((state, error), (TaskState::Succeeded, None));
                break;
            }
        }
    }
    assert_eq!(taken, BATCHES);
    let _tx = sender.await.unwrap();
    dispatcher.close_job("q-1");
    stop.cancel();
    server.abort();
}
