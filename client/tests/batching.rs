//! How the producer batches, against the scripted server of `common`.

mod common;

use std::time::Duration;

use common::{Harness, zero_linger};

#[tokio::test]
async fn while_every_slot_is_busy_the_open_batch_takes_records_past_its_linger() {
    let mut h = Harness::start(zero_linger(1)).await;
    let a = h.send("a").await;
    let first = h.next_request().await;
    assert_eq!(first.payloads(), [b"a"], "a lone record goes at once");

    // Records sent while the one slot is busy, some of them well past a
    // linger of zero (and past the timer's millisecond), all wait...
    let mut acks = vec![h.send("b").await, h.send("c").await];
    tokio::time::sleep(Duration::from_millis(30)).await;
    acks.push(h.send("d").await);
    acks.push(h.send("e").await);
    h.sends_nothing_for(Duration::from_millis(100)).await;

    // ... and go as one batch once the slot frees.
    first.written_at(1).await;
    assert_eq!(a.await.unwrap().seqno, 1);
    let second = h.next_request().await;
    assert_eq!(second.payloads(), [b"b", b"c", b"d", b"e"]);
    let producer = second.request.append.as_ref().unwrap().producer.unwrap();
    assert_eq!(producer.sequence, 2, "the batch's sequence follows the first's record");
    second.written_at(2).await;
    for (ack, seqno) in acks.into_iter().zip(2..) {
        assert_eq!(ack.await.unwrap().seqno, seqno);
    }
}

#[tokio::test]
async fn with_a_slot_free_a_zero_linger_batch_goes_at_once() {
    let mut h = Harness::start(zero_linger(2)).await;
    let a = h.send("a").await;
    let first = h.next_request().await;
    let b = h.send("b").await;
    // Sent while the first is unanswered: the second slot is free.
    let second = h.next_request().await;
    assert_eq!((first.payloads(), second.payloads()), (vec![&b"a"[..]], vec![&b"b"[..]]));
    // A third record has no slot until one of them is answered.
    let c = h.send("c").await;
    h.sends_nothing_for(Duration::from_millis(100)).await;
    first.written_at(1).await;
    let third = h.next_request().await;
    assert_eq!(third.payloads(), [b"c"]);
    second.written_at(2).await;
    third.written_at(3).await;
    assert_eq!((a.await.unwrap().seqno, b.await.unwrap().seqno, c.await.unwrap().seqno), (1, 2, 3));
}
