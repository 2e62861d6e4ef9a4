//! The client side of `Log.AppendStream`: many appends in flight over one
//! gRPC stream, each awaited on its own.
//!
//! A unary `Append` costs an HTTP/2 stream per call (headers both ways,
//! trailers, a task on each side). Clients with many appends in flight pay
//! that per record; the pipeline pays it once per connection and sends each
//! append as one message. [`AppendPipeline::append`] answers exactly what
//! the unary call would: the same response, or the same status with the
//! same `walship-leader` / `walship-outcome` metadata.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::log::append_stream_response::Result as Answer;
use crate::log::log_client::LogClient;
use crate::log::{AppendFailure, AppendRequest, AppendResponse, AppendStreamRequest};

type Waiter = oneshot::Sender<Result<AppendResponse, Status>>;

/// Appends waiting for their answer, and whether the stream has ended.
#[derive(Default)]
struct Pending {
    waiters: HashMap<u64, Waiter>,
    /// Set once the answer stream ended; later appends fail at once with it
    /// (they were never sent).
    ended: Option<Status>,
}

/// Pipelined appends to one node over one `AppendStream`. Cheap to share
/// (`Arc`) among any number of concurrent callers.
pub struct AppendPipeline {
    requests: mpsc::Sender<AppendStreamRequest>,
    pending: Arc<Mutex<Pending>>,
    next_id: AtomicU64,
}

/// Requests queued towards the stream before callers wait for room.
const REQUEST_BUFFER: usize = 1024;

impl AppendPipeline {
    /// Opens the stream on `client`'s connection.
    pub async fn open(mut client: LogClient<Channel>) -> Result<AppendPipeline, Status> {
        let (requests, rx) = mpsc::channel(REQUEST_BUFFER);
        let mut answers = client.append_stream(ReceiverStream::new(rx)).await?.into_inner();
        let pending = Arc::new(Mutex::new(Pending::default()));
        let reader = pending.clone();
        tokio::spawn(async move {
            let end = loop {
                match answers.message().await {
                    Ok(Some(answer)) => {
                        let waiter = reader.lock().waiters.remove(&answer.request_id);
                        if let Some(waiter) = waiter {
                            let _ = waiter.send(outcome(answer.result));
                        }
                    }
                    Ok(None) => break Status::unavailable("the append stream ended"),
                    Err(status) => break status,
                }
            };
            let mut pending = reader.lock();
            for (_, waiter) in pending.waiters.drain() {
                let _ = waiter.send(Err(unknown_outcome(&end)));
            }
            pending.ended = Some(Status::unavailable(format!("the append stream ended: {}", end.message())));
        });
        Ok(AppendPipeline { requests, pending, next_id: AtomicU64::new(1) })
    }

    /// Appends sent (or being sent) and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().waiters.len()
    }

    /// Appends through the stream and waits for the answer.
    pub async fn append(&self, append: AppendRequest) -> Result<AppendResponse, Status> {
        let request_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (waiter, answer) = oneshot::channel();
        {
            let mut pending = self.pending.lock();
            if let Some(end) = &pending.ended {
                return Err(end.clone());
            }
            pending.waiters.insert(request_id, waiter);
        }
        // A caller that gives up (its future dropped) leaves no waiter behind.
        let _forget = Forget { pending: &self.pending, request_id };
        if self.requests.send(AppendStreamRequest { request_id, append: Some(append) }).await.is_err() {
            return Err(Status::unavailable("the append stream is closed"));
        }
        match answer.await {
            Ok(outcome) => outcome,
            // The reader drains every waiter before it goes; a dropped
            // waiter means the runtime is shutting down.
            Err(_) => Err(unknown_outcome(&Status::unavailable("the append stream's reader stopped"))),
        }
    }
}

/// Removes a waiter when its `append` call ends, however it ends (the
/// reader has already removed it when an answer came).
struct Forget<'a> {
    pending: &'a Mutex<Pending>,
    request_id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.pending.lock().waiters.remove(&self.request_id);
    }
}

/// Failure of an append whose request was sent but whose answer never came:
/// like a unary call cut off mid-way, its outcome is unknown.
fn unknown_outcome(end: &Status) -> Status {
    let mut status = Status::unavailable(format!("no answer before the append stream ended: {}", end.message()));
    crate::mark_outcome_unknown(&mut status);
    status
}

fn outcome(answer: Option<Answer>) -> Result<AppendResponse, Status> {
    match answer {
        Some(Answer::Ok(response)) => Ok(response),
        Some(Answer::Failure(failure)) => Err(failure_status(failure)),
        // Nothing says whether it was written: its outcome is unknown (an
        // exactly-once client sends it again with the same sequence).
        None => {
            let mut status = Status::internal("the server answered an append with neither a response nor a failure");
            crate::mark_outcome_unknown(&mut status);
            Err(status)
        }
    }
}

/// The status the unary call would have returned for `failure`.
pub fn failure_status(failure: AppendFailure) -> Status {
    let mut status = Status::new(Code::from_i32(failure.code), failure.message);
    if let (false, Ok(leader)) = (failure.leader.is_empty(), failure.leader.parse()) {
        status.metadata_mut().insert(crate::LEADER_METADATA_KEY, leader);
    }
    if failure.outcome_unknown {
        crate::mark_outcome_unknown(&mut status);
    }
    if let (false, Ok(refusal)) = (failure.refusal.is_empty(), failure.refusal.parse()) {
        status.metadata_mut().insert(crate::REFUSAL_METADATA_KEY, refusal);
        if failure.refusal == crate::REFUSAL_EXPECTED_LAST {
            status.metadata_mut().insert(crate::LAST_SEQNO_METADATA_KEY, failure.last_seqno.into());
        }
    }
    status
}

/// The `AppendFailure` a stream answers with where the unary call would have
/// returned `status` (the inverse of [`failure_status`]).
pub fn append_failure(status: &Status) -> AppendFailure {
    let leader = status.metadata().get(crate::LEADER_METADATA_KEY).and_then(|v| v.to_str().ok()).unwrap_or_default();
    AppendFailure {
        code: status.code() as i32,
        message: status.message().to_string(),
        leader: leader.to_string(),
        outcome_unknown: crate::outcome_unknown(status),
        refusal: crate::refusal(status).unwrap_or_default().to_string(),
        last_seqno: crate::refused_last_seqno(status).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_with_neither_result_is_an_unknown_outcome() {
        let status = outcome(None).unwrap_err();
        assert_eq!(status.code(), Code::Internal);
        assert!(crate::outcome_unknown(&status), "{status:?}");
    }

    #[test]
    fn a_failure_becomes_the_unary_status_and_back() {
        let failure = AppendFailure {
            code: Code::FailedPrecondition as i32,
            message: "not the leader".into(),
            leader: "2@127.0.0.1:7001".into(),
            outcome_unknown: false,
            refusal: String::new(),
            last_seqno: 0,
        };
        let status = outcome(Some(Answer::Failure(failure.clone()))).unwrap_err();
        assert_eq!((status.code(), status.message()), (Code::FailedPrecondition, "not the leader"));
        assert!(!crate::outcome_unknown(&status));
        assert_eq!(append_failure(&status), failure);
        assert_eq!(crate::leader_address(&status), Some("127.0.0.1:7001"));
        assert_eq!(crate::leader_address(&Status::failed_precondition("no hint")), None);
    }

    #[test]
    fn a_failure_with_a_code_grpc_does_not_define_is_unknown() {
        let failure = AppendFailure { code: 999, message: "odd".into(), ..AppendFailure::default() };
        assert_eq!(failure_status(failure).code(), Code::Unknown);
    }
}
