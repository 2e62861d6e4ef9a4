//! How the producer batches, against the scripted server of `common`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;

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

/// Callers woken together (as one answer wakes every caller it
/// acknowledged) and each sending at once go out as one batch, not as a
/// lone first record followed by the rest. Without a yield, the first
/// caller's send runs the shard task straight after it (tokio's next-task
/// slot on a worker thread), before the other callers have queued theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn callers_woken_together_send_together() {
    let mut h = Harness::start(zero_linger(16)).await;
    // The shard's task and its stream to the leader are up.
    let warm = h.send("warm").await;
    h.next_request().await.written_at(1).await;
    assert_eq!(warm.await.unwrap().seqno, 1);
    let go = Arc::new(tokio::sync::Notify::new());
    let waiting = Arc::new(AtomicUsize::new(0));
    let callers: Vec<_> = (0..8)
        .map(|i| {
            let (producer, go, waiting) = (h.producer.clone(), go.clone(), waiting.clone());
            tokio::spawn(async move {
                // Registered as a waiter before it is counted.
                let woken = go.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                waiting.fetch_add(1, Ordering::SeqCst);
                woken.await;
                producer.send(1, Bytes::new(), Bytes::from(format!("r{i}"))).await.await
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while waiting.load(Ordering::SeqCst) < 8 {
        assert!(std::time::Instant::now() < deadline, "the callers never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Woken from a task on the runtime's worker, as an answer wakes them.
    tokio::spawn(async move { go.notify_waiters() }).await.unwrap();
    let first = h.next_request().await;
    assert_eq!(first.payloads().len(), 8, "one batch of every woken caller's record: {:?}", first.payloads());
    first.written_at(2).await;
    let mut seqnos = Vec::new();
    for caller in callers {
        seqnos.push(caller.await.unwrap().unwrap().seqno);
    }
    seqnos.sort();
    assert_eq!(seqnos, (2..=9).collect::<Vec<_>>());
}
