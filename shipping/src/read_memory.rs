//! The node-wide budget of read responses in memory.
//!
//! A `Read` answer is built whole (up to `limits.max_read_bytes`, 32 MiB by
//! default) and then sits in the HTTP/2 connection until its caller takes
//! it. A caller that asks and never reads (its flow-control window kept
//! shut) pins that memory for as long as it keeps the stream open, and one
//! connection may hold a hundred such streams: without a bound a handful of
//! unauthenticated callers could take every byte of a node's memory. So
//! every `Read` and every `Tail` batch takes its size out of one budget per
//! node (`limits.read_memory_bytes`) before it reads, gives back what it did
//! not use once the answer is built, and gives back the rest only when the
//! answer has left (the response body is dropped: sent, or its stream reset
//! or its connection gone). A `Read` that finds no room waits briefly
//! ([`READ_MEMORY_WAIT`], or less when its deadline is nearer) and is then
//! refused `RESOURCE_EXHAUSTED`; a `Tail` waits for room as it waits for
//! records.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use prometheus::IntGauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Longest a `Read` waits for room in the budget before it is refused.
pub const READ_MEMORY_WAIT: Duration = Duration::from_secs(5);

/// One node's budget, in bytes.
#[derive(Clone)]
pub struct ReadMemory {
    room: Arc<Semaphore>,
    bytes: usize,
    /// `walship_read_memory_held_bytes`: what [`ReadMemory::held`] says.
    gauge: IntGauge,
}

/// Room taken out of the budget, given back when dropped.
pub struct Held {
    permit: OwnedSemaphorePermit,
    gauge: IntGauge,
}

impl Held {
    fn new(permit: OwnedSemaphorePermit, gauge: &IntGauge) -> Held {
        gauge.add(permit.num_permits() as i64);
        Held { permit, gauge: gauge.clone() }
    }

    /// Gives back all but `used` bytes (an answer smaller than the room it
    /// took before reading).
    pub fn keep(&mut self, used: usize) {
        let excess = self.permit.num_permits().saturating_sub(used.max(1));
        if let Some(given_back) = self.permit.split(excess) {
            self.gauge.sub(given_back.num_permits() as i64);
        }
    }

    pub fn bytes(&self) -> usize {
        self.permit.num_permits()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.sub(self.permit.num_permits() as i64);
    }
}

/// Why a read found no room.
#[derive(Debug, PartialEq, Eq)]
pub struct NoRoom {
    pub budget: usize,
    pub wanted: usize,
    pub waited: Duration,
}

impl ReadMemory {
    /// A budget of `bytes` (at least one byte; at most what a semaphore
    /// counts).
    pub fn new(bytes: usize, gauge: IntGauge) -> ReadMemory {
        let bytes = bytes.clamp(1, Semaphore::MAX_PERMITS);
        ReadMemory { room: Arc::new(Semaphore::new(bytes)), bytes, gauge }
    }

    /// `walship_read_memory_held_bytes`, registered in `registry`.
    pub fn gauge(registry: &prometheus::Registry) -> prometheus::Result<IntGauge> {
        let gauge = IntGauge::new(
            "walship_read_memory_held_bytes",
            "Bytes of the node's read memory budget held by Read answers and Tail batches being built or not yet \
             taken by their callers",
        )?;
        registry.register(Box::new(gauge.clone()))?;
        Ok(gauge)
    }

    pub fn budget(&self) -> usize {
        self.bytes
    }

    /// Bytes held now by answers being built or not yet taken.
    pub fn held(&self) -> usize {
        self.bytes - self.room.available_permits()
    }

    fn amount(&self, wanted: usize) -> u32 {
        wanted.clamp(1, self.bytes).min(u32::MAX as usize) as u32
    }

    /// Takes `wanted` bytes (at most the whole budget), waiting up to
    /// `patience` for them.
    pub async fn take(&self, wanted: usize, patience: Duration) -> Result<Held, NoRoom> {
        let n = self.amount(wanted);
        if let Ok(permit) = self.room.clone().try_acquire_many_owned(n) {
            return Ok(Held::new(permit, &self.gauge));
        }
        match tokio::time::timeout(patience, self.room.clone().acquire_many_owned(n)).await {
            Ok(Ok(permit)) => Ok(Held::new(permit, &self.gauge)),
            // The semaphore is never closed; a timeout is the one way here.
            _ => Err(NoRoom { budget: self.bytes, wanted: n as usize, waited: patience }),
        }
    }

    /// Takes `wanted` bytes, waiting as long as it takes.
    pub async fn take_when_free(&self, wanted: usize) -> Held {
        let permit = self.room.clone().acquire_many_owned(self.amount(wanted)).await;
        Held::new(permit.expect("the read memory semaphore is never closed"), &self.gauge)
    }
}

/// Room a unary answer holds, carried from the handler to the transport in
/// the response's extensions (which need `Clone`).
#[derive(Clone)]
pub struct HeldByAnswer(Arc<Mutex<Option<Held>>>);

impl HeldByAnswer {
    pub fn new(held: Held) -> HeldByAnswer {
        HeldByAnswer(Arc::new(Mutex::new(Some(held))))
    }
}

/// Wraps a gRPC service so that room a handler put in its response's
/// extensions ([`HeldByAnswer`]) is held by the response body until the
/// body is dropped: the answer's bytes have left, or its stream or
/// connection ended.
#[derive(Clone)]
pub struct HoldUntilSent<S>(pub S);

impl<S: tonic::server::NamedService> tonic::server::NamedService for HoldUntilSent<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tower_service::Service<http::Request<B>> for HoldUntilSent<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let answer = self.0.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            let held = response.extensions_mut().remove::<HeldByAnswer>().and_then(|h| h.0.lock().take());
            Ok(match held {
                Some(held) => response.map(|body| tonic::body::Body::new(Holding { body, _held: held })),
                None => response,
            })
        })
    }
}

/// A response body holding room in the budget until it is dropped. The
/// transport asks a body for its next frame only once what it buffered of
/// the last has mostly left (hyper's per-stream send buffer): the answer is
/// handed over whole, and the body, with its room, lives until the caller
/// has taken nearly all of it and the trailers go.
struct Holding {
    body: tonic::body::Body,
    _held: Held,
}

impl http_body::Body for Holding {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gauge() -> IntGauge {
        IntGauge::new("held", "held").unwrap()
    }

    #[tokio::test]
    async fn room_is_given_back_when_the_holder_is_dropped_and_what_an_answer_did_not_use_at_once() {
        let memory = ReadMemory::new(1000, gauge());
        let mut first = memory.take(600, Duration::ZERO).await.expect("room");
        assert_eq!((memory.held(), memory.gauge.get()), (600, 600));
        let refused = memory.take(600, Duration::from_millis(20)).await.err().expect("no room");
        assert_eq!(refused, NoRoom { budget: 1000, wanted: 600, waited: Duration::from_millis(20) });
        assert_eq!(memory.held(), 600, "a refused take holds nothing");
        first.keep(100);
        assert_eq!((memory.held(), first.bytes(), memory.gauge.get()), (100, 100, 100));
        let second = memory.take(600, Duration::ZERO).await.expect("room once the excess is back");
        drop(first);
        assert_eq!(memory.held(), 600);
        drop(second);
        assert_eq!((memory.held(), memory.gauge.get()), (0, 0));
    }

    #[tokio::test]
    async fn a_take_larger_than_the_budget_takes_the_whole_budget_and_a_waiting_take_gets_room_once_freed() {
        let memory = ReadMemory::new(1000, gauge());
        let all = memory.take(5000, Duration::ZERO).await.expect("the whole budget");
        assert_eq!(all.bytes(), 1000);
        let waiting = {
            let memory = memory.clone();
            tokio::spawn(async move { memory.take_when_free(10).await.bytes() })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "no room while the whole budget is held");
        drop(all);
        assert_eq!(waiting.await.unwrap(), 10);
        assert_eq!(memory.held(), 0);
    }

    #[tokio::test]
    async fn keep_never_drops_to_zero_nor_grows() {
        let memory = ReadMemory::new(1000, gauge());
        let mut held = memory.take(300, Duration::ZERO).await.unwrap();
        held.keep(5000);
        assert_eq!(held.bytes(), 300, "keep never takes more room");
        held.keep(0);
        assert_eq!(held.bytes(), 1, "an empty answer still holds its one byte until sent");
    }
}
