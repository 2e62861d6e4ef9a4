//! The producer's limits and what it makes of a server's answers, against
//! the scripted server of `common`: the buffer bound, the request size
//! limit, an attempt that is never answered, and answers that say too
//! little.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Harness, zero_linger};
use walship_client::{ProduceError, ProducerConfig};
use walship_proto::log::AppendResponse;

#[tokio::test]
async fn send_waits_while_the_buffer_is_full_and_goes_on_when_an_ack_frees_it() {
    let config = ProducerConfig { buffer_bytes: 10, ..zero_linger(1) };
    let mut h = Harness::start(config).await;
    let a = h.send("aaaaa").await;
    let first = h.next_request().await;
    let b = h.send("bbbbb").await;
    // Ten bytes queued and unacknowledged: the third send waits.
    let producer = h.producer.clone();
    // `send` returns once the record is queued (`Some`: the ack itself is
    // awaited later).
    let mut third =
        tokio::spawn(async move { Some(producer.send(1, Bytes::new(), Bytes::from_static(b"ccccc")).await) });
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut third).await.is_err(),
        "a send past buffer_bytes returned before anything was acknowledged"
    );
    first.written_at(1).await;
    assert_eq!(a.await.unwrap().seqno, 1);
    let c = tokio::time::timeout(Duration::from_secs(10), third)
        .await
        .expect("the waiting send goes on once an ack frees the buffer")
        .unwrap()
        .expect("queued");
    // b and c, in order, in one batch or two.
    let mut seqno = 2;
    let mut sent = Vec::new();
    while sent.len() < 2 {
        let request = h.next_request().await;
        let n = request.payloads().len() as u64;
        sent.extend(request.payloads().iter().map(|p| p.to_vec()));
        request.written_at(seqno).await;
        seqno += n;
    }
    assert_eq!(sent, [b"bbbbb".to_vec(), b"ccccc".to_vec()]);
    assert_eq!((b.await.unwrap().seqno, c.await.unwrap().seqno), (2, 3));
}

#[tokio::test]
async fn a_batch_over_the_request_limit_fails_alone_and_is_never_sent() {
    let config = ProducerConfig { max_request_bytes: 64, ..zero_linger(1) };
    let mut h = Harness::start(config).await;
    let big = h.send_bytes(Bytes::from(vec![7u8; 100])).await;
    match tokio::time::timeout(Duration::from_secs(10), big).await.expect("answered") {
        Err(ProduceError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
            assert!(status.message().contains("max_request_bytes"), "{status}");
        }
        other => panic!("a record over the request limit was {other:?}"),
    }
    h.sends_nothing_for(Duration::from_millis(100)).await;
    // The next record takes the refused one's producer sequence.
    let small = h.send("ok").await;
    let request = h.next_request().await;
    assert_eq!(request.payloads(), [b"ok"]);
    assert_eq!(request.session().2, 1, "the refused batch left no gap in the sequences");
    request.written_at(1).await;
    assert_eq!(small.await.unwrap().seqno, 1);
}

#[tokio::test]
async fn an_unanswered_batch_is_sent_again_as_it_was_then_fails_as_outcome_unknown() {
    let config = ProducerConfig {
        request_timeout: Duration::from_millis(150),
        deadline: Duration::from_millis(1_500),
        ..zero_linger(1)
    };
    let mut h = Harness::start(config).await;
    let ack = h.send("a").await;
    let first = h.next_request().await;
    // Past the attempt's timeout its outcome is unknown: the same batch
    // goes again, with the same producer session and sequence, so a shard
    // that wrote the first attempt answers the second as a duplicate.
    let again = h.next_request().await;
    assert_eq!(again.payloads(), first.payloads());
    assert_eq!(again.session(), first.session());
    // Never answered: past the deadline it fails, as maybe written.
    match tokio::time::timeout(Duration::from_secs(10), ack).await.expect("failed within the deadline and a margin") {
        Err(ProduceError::OutcomeUnknown { .. }) => {}
        other => panic!("an unanswered record was {other:?}"),
    }
}

#[tokio::test]
async fn an_answer_naming_no_possible_range_is_an_ack_with_its_seqno_unknown() {
    let mut h = Harness::start(zero_linger(1)).await;
    let a = h.send("a").await;
    // last_seqno below first_seqno: no range at all.
    h.next_request().await.answer(AppendResponse { first_seqno: 5, last_seqno: 0, epoch: 1, duplicate: false }).await;
    let acked = a.await.expect("the server said written");
    assert_eq!(acked.seqno, 0, "a seqno the answer does not establish is reported as unknown");
    // The producer goes on.
    let b = h.send("b").await;
    h.next_request().await.written_at(6).await;
    assert_eq!(b.await.unwrap().seqno, 6);
}

#[tokio::test]
async fn an_answer_with_neither_a_response_nor_a_failure_is_an_unknown_outcome_and_sent_again() {
    let mut h = Harness::start(zero_linger(1)).await;
    let a = h.send("a").await;
    let first = h.next_request().await;
    let session = first.session();
    first.answer_nothing().await;
    // It may have been written: sent again as it was, never failed as
    // refused (which would tell the caller it was not written).
    let again = h.next_request().await;
    assert_eq!((again.payloads(), again.session()), (vec![&b"a"[..]], session));
    again.written_at(1).await;
    assert_eq!(a.await.unwrap().seqno, 1);
}
