//! One shipper's pushes in flight to one follower, oldest first.
//!
//! A push is handed to the follower node's ship stream task
//! (`ship_stream.rs`, `run_ship_stream`) with a oneshot for its answer. The stream
//! answers in the order it sent, so a shipper's pushes are answered in the
//! order it made them (unary calls to an older peer may finish out of
//! order; they are still taken oldest first). So the shipper only ever
//! waits on its oldest push: its answer, or its deadline (`ship_timeout_ms`
//! after it was made; later pushes have later deadlines).
//!
//! This replaced a `FuturesUnordered` of boxed calls, each with its own
//! `tokio::time::timeout`: with 1,000 busy shards every record is a push of
//! its own, and the box, the set's task node and the timer's registration
//! and removal were paid for each. Here a push costs its oneshot, and the
//! one timer is moved only when it fires before the oldest push's deadline
//! (deadlines only grow), about once per timeout, not once per push. (A
//! shipper whose pushes were all answered is woken once more when the timer
//! set for the last of them fires; its `select!` finds nothing ready and it
//! sleeps again.)
//!
//! A stream whose queue is full takes the push when it has room (handed
//! over while the shipper waits on [`Pushes::next`]); until then the
//! shipper makes no other push, so pushes reach the stream in the order
//! they were made.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::PollSender;
use tonic::Status;
use walship_proto::replication::{ShipSegmentRequest, ShipSegmentResponse};

/// A push and where its answer goes: what `run_ship_stream` receives.
pub(super) type ShipCall = (ShipSegmentRequest, oneshot::Sender<Result<ShipSegmentResponse, Status>>);

/// What a push's answer came to: the follower's answer or refusal, or
/// `None` when the call failed on the way (no stream, the stream closed
/// without answering, or no answer within the timeout).
pub(super) type Outcome = Option<Result<ShipSegmentResponse, Status>>;

/// What the shipper keeps of a push to settle its answer (see
/// `ReplicationNode::settle_push`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Sent<M> {
    /// When it was made (unix µs): what its answer proves dates from then.
    pub(super) at_us: u64,
    /// The shipper's own notes (the commit it told, the archiver it named).
    pub(super) note: M,
}

enum Answer {
    /// Handed to the stream (or waiting in `blocked` to be).
    Waiting(oneshot::Receiver<Result<ShipSegmentResponse, Status>>),
    /// Failed before it was handed over: settled at once.
    Failed,
}

struct Push<M> {
    sent: Sent<M>,
    deadline: Instant,
    answer: Answer,
}

/// A shipper's pushes in flight, oldest first (see the module docs).
pub(super) struct Pushes<M> {
    queue: VecDeque<Push<M>>,
    timeout: Duration,
    /// Fires at or before the oldest push's deadline whenever one waits.
    timer: Pin<Box<Sleep>>,
    /// A push its stream had no room for, and that stream.
    blocked: Option<(ShipCall, PollSender<ShipCall>)>,
}

impl<M: Copy> Pushes<M> {
    pub(super) fn new(timeout: Duration) -> Self {
        Pushes {
            queue: VecDeque::new(),
            timeout,
            timer: Box::pin(tokio::time::sleep_until(far_future())),
            blocked: None,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// A push waits for room on its stream: no other may be made before it
    /// is handed over (or times out).
    pub(super) fn is_blocked(&self) -> bool {
        self.blocked.is_some()
    }

    /// Hands `request` to `stream` (`None`: there is none, the push fails)
    /// and keeps it in flight. Call only while not [`Pushes::is_blocked`].
    pub(super) fn push(&mut self, sent: Sent<M>, request: ShipSegmentRequest, stream: Option<&mpsc::Sender<ShipCall>>) {
        debug_assert!(self.blocked.is_none(), "a push made while another waits for room");
        let deadline = Instant::now() + self.timeout;
        let answer = match stream {
            None => Answer::Failed,
            Some(stream) => {
                let (reply, answer) = oneshot::channel();
                match stream.try_send((request, reply)) {
                    Ok(()) => Answer::Waiting(answer),
                    Err(TrySendError::Full(call)) => {
                        self.blocked = Some((call, PollSender::new(stream.clone())));
                        Answer::Waiting(answer)
                    }
                    Err(TrySendError::Closed(_)) => Answer::Failed,
                }
            }
        };
        self.queue.push_back(Push { sent, deadline, answer });
    }

    /// Hands the blocked push to its stream if it has room now (else the
    /// stream wakes this task when it has). A blocked push that timed out
    /// meanwhile is dropped instead; a stream that closed drops it (its
    /// answer never comes: it settles as failed).
    fn poll_blocked(&mut self, cx: &mut Context<'_>) {
        let Some(((_, reply), stream)) = self.blocked.as_mut() else { return };
        if reply.is_closed() {
            self.blocked = None;
            return;
        }
        match stream.poll_reserve(cx) {
            Poll::Pending => {}
            Poll::Ready(Ok(())) => {
                let (call, mut stream) = self.blocked.take().expect("blocked");
                // Reserved just now: only a stream closed since fails it.
                let _ = stream.send_item(call);
            }
            Poll::Ready(Err(_)) => self.blocked = None,
        }
    }

    /// The oldest push once it is answered or its deadline passed, with what
    /// it came to. Pending while there is none.
    pub(super) fn next(&mut self) -> impl Future<Output = (Sent<M>, Outcome)> + '_ {
        std::future::poll_fn(move |cx| self.poll_next(cx))
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<(Sent<M>, Outcome)> {
        self.poll_blocked(cx);
        let Some(front) = self.queue.front_mut() else { return Poll::Pending };
        let answered = match &mut front.answer {
            Answer::Failed => Some(None),
            Answer::Waiting(answer) => match Pin::new(answer).poll(cx) {
                Poll::Ready(answer) => Some(answer.ok()),
                Poll::Pending => None,
            },
        };
        if let Some(outcome) = answered {
            return Poll::Ready(self.pop(outcome));
        }
        let deadline = front.deadline;
        loop {
            if Instant::now() >= deadline {
                return Poll::Ready(self.pop(None));
            }
            // Deadlines only grow: a timer set for an older push fires
            // early, and is moved on then, not for every push.
            if self.timer.deadline() > deadline {
                self.timer.as_mut().reset(deadline);
            }
            match self.timer.as_mut().poll(cx) {
                Poll::Ready(()) => self.timer.as_mut().reset(deadline),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn pop(&mut self, outcome: Outcome) -> (Sent<M>, Outcome) {
        let push = self.queue.pop_front().expect("a push to settle");
        drop(push.answer);
        // The blocked push timed out: it is not handed over.
        if self.blocked.as_ref().is_some_and(|((_, reply), _)| reply.is_closed()) {
            self.blocked = None;
        }
        (push.sent, outcome)
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(365 * 24 * 3600)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to_ship(seqno: u64) -> ShipSegmentRequest {
        ShipSegmentRequest {
            id: Some(walship_proto::replication::WalSegmentId { region_id: 1, shard_id: 1, seqno }),
            ..Default::default()
        }
    }

    fn answer(seqno: u64) -> Result<ShipSegmentResponse, Status> {
        Ok(ShipSegmentResponse { accepted: true, applied_seqno: seqno, ..Default::default() })
    }

    fn sent(at_us: u64) -> Sent<u64> {
        Sent { at_us, note: at_us * 10 }
    }

    #[tokio::test(start_paused = true)]
    async fn answers_come_out_oldest_first_with_their_notes() {
        let (stream, mut calls) = mpsc::channel(8);
        let mut pushes = Pushes::new(Duration::from_secs(5));
        for seqno in 1..=3 {
            pushes.push(sent(seqno), to_ship(seqno), Some(&stream));
        }
        let mut replies: Vec<_> = Vec::new();
        for _ in 0..3 {
            replies.push(calls.recv().await.expect("handed over"));
        }
        // The newest is answered first: it still waits for the oldest.
        let (_, third) = replies.pop().unwrap();
        third.send(answer(3)).unwrap();
        for (request, reply) in replies {
            let seqno = request.id.unwrap().seqno;
            reply.send(answer(seqno)).unwrap();
        }
        for seqno in 1..=3 {
            let (sent, outcome) = pushes.next().await;
            assert_eq!((sent.at_us, sent.note), (seqno, seqno * 10));
            assert_eq!(outcome.expect("answered").expect("accepted").applied_seqno, seqno);
        }
        assert!(pushes.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_push_not_answered_in_time_fails_and_the_next_keeps_its_own_deadline() {
        let (stream, mut calls) = mpsc::channel(8);
        let mut pushes = Pushes::new(Duration::from_secs(5));
        pushes.push(sent(1), to_ship(1), Some(&stream));
        tokio::time::advance(Duration::from_secs(3)).await;
        pushes.push(sent(2), to_ship(2), Some(&stream));
        let started = Instant::now();
        let (first, outcome) = pushes.next().await;
        assert_eq!(first.at_us, 1);
        assert!(outcome.is_none(), "unanswered: failed");
        assert_eq!(Instant::now() - started, Duration::from_secs(2), "at its own deadline");
        // The second is answered late, but within its own deadline.
        let _first = calls.recv().await.unwrap();
        let (_, second) = calls.recv().await.unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        second.send(answer(2)).unwrap();
        let (next, outcome) = pushes.next().await;
        assert_eq!(next.at_us, 2);
        assert_eq!(outcome.expect("answered").unwrap().applied_seqno, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn no_stream_or_a_closed_one_fails_the_push_at_once() {
        let mut pushes = Pushes::new(Duration::from_secs(5));
        pushes.push(sent(1), to_ship(1), None);
        let (closed, calls) = mpsc::channel(8);
        drop(calls);
        pushes.push(sent(2), to_ship(2), Some(&closed));
        let (open, mut calls) = mpsc::channel(8);
        pushes.push(sent(3), to_ship(3), Some(&open));
        let (_, reply) = calls.recv().await.unwrap();
        // The stream task ends without answering.
        drop(reply);
        let started = Instant::now();
        for at in 1..=3 {
            let (sent, outcome) = pushes.next().await;
            assert_eq!(sent.at_us, at);
            assert!(outcome.is_none());
        }
        assert_eq!(Instant::now(), started, "none waited for the timeout");
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_stream_takes_the_push_when_it_has_room_and_never_after_its_deadline() {
        let (stream, mut calls) = mpsc::channel(1);
        let mut pushes = Pushes::new(Duration::from_secs(5));
        pushes.push(sent(1), to_ship(1), Some(&stream));
        pushes.push(sent(2), to_ship(2), Some(&stream));
        assert!(pushes.is_blocked(), "the stream's queue holds one");
        let (_, first) = calls.recv().await.unwrap();
        first.send(answer(1)).unwrap();
        assert_eq!(pushes.next().await.1.unwrap().unwrap().applied_seqno, 1);
        assert!(!pushes.is_blocked(), "handed over while waiting on the oldest");
        let (request, second) = calls.recv().await.expect("handed over once there was room");
        assert_eq!(request.id.unwrap().seqno, 2);
        second.send(answer(2)).unwrap();
        assert_eq!(pushes.next().await.1.unwrap().unwrap().applied_seqno, 2);

        // Blocked past its deadline: it fails, and is never handed over.
        pushes.push(sent(3), to_ship(3), Some(&stream));
        pushes.push(sent(4), to_ship(4), Some(&stream));
        assert!(pushes.is_blocked());
        let (at3, outcome3) = pushes.next().await;
        let (at4, outcome4) = pushes.next().await;
        assert_eq!((at3.at_us, at4.at_us), (3, 4));
        assert!(outcome3.is_none() && outcome4.is_none(), "neither answered in time");
        assert!(!pushes.is_blocked(), "the timed-out push is no longer waiting for room");
        let (request, _) = calls.recv().await.unwrap();
        assert_eq!(request.id.unwrap().seqno, 3);
        assert!(calls.try_recv().is_err(), "the timed-out push was not handed over");
    }
}
