//! `walship append` with a producer session: the groups of `--batch`
//! records go through [`walship_client::Producer`], up to `--in-flight` of
//! them on the way at once over one `Log.AppendStream` to the leader,
//! instead of one unary `Append` call after another.
//!
//! What the user sees is what the one-at-a-time path shows:
//!
//! * each group is one batch of its own, so its records get contiguous
//!   seqnos, and it is reported by one line, in input order, once every
//!   record of it is acknowledged;
//! * retries are the producer's: a group whose answer was lost is sent
//!   again with the same sequences until `--deadline`, so it is written
//!   once, and only a group no retry settled is "outcome unknown" (exit 3);
//! * the first group that fails ends the run with that failure's error and
//!   exit code. Nothing is handed to the producer after it, but the groups
//!   already on the way are waited for: each one acknowledged still gets its
//!   line (a group refused for itself does not stop the ones behind it in
//!   the pipeline), each one whose outcome is unknown gets an `unknown`
//!   line with `--json`, and the error counts the records left
//!   unacknowledged behind the first failure.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use walship_client::{Acked, Connect, ConnectError, ProduceError, Producer, ProducerConfig, RecordAck};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

use crate::client::ChannelOptions;
use crate::client_error::{ClientError, Kind, status_error};

/// Largest request one group may make on the stream. A message over a
/// node's own limit would break the whole stream (every batch on it an
/// unknown outcome), so a larger group is refused here, before anything is
/// sent; 32 MiB is a node's default `max_batch_bytes`.
pub(crate) const MAX_STREAM_REQUEST_BYTES: usize = 32 << 20;

/// How a pipelined run appends.
pub(crate) struct Settings {
    pub servers: Vec<String>,
    pub options: ChannelOptions,
    pub shard: u32,
    pub durability: Durability,
    pub json: bool,
    pub in_flight: usize,
    pub request_timeout: Duration,
    pub deadline: Duration,
    pub producer_id: Option<u64>,
    pub producer_epoch: Option<u64>,
}

/// Who was tried: every connection failure since one last succeeded, and
/// the server of the last connection opened.
struct Tried {
    failures: Vec<ClientError>,
    server: Option<String>,
    /// How many servers the list has: an error names that many failures
    /// (at least three).
    servers: usize,
}

/// Appends the groups `groups` yields, in order, and prints one line per
/// acknowledged group; see the module docs.
pub(crate) async fn append(
    settings: Settings,
    mut groups: mpsc::Receiver<Result<Vec<AppendRecord>, ClientError>>,
) -> Result<(), ClientError> {
    let tried =
        Arc::new(std::sync::Mutex::new(Tried { failures: Vec::new(), server: None, servers: settings.servers.len() }));
    let producer = Producer::new(
        settings.servers.clone(),
        connector(settings.options, tried.clone()),
        ProducerConfig {
            durability: settings.durability,
            in_flight: settings.in_flight.max(1),
            deadline: settings.deadline,
            request_timeout: settings.request_timeout,
            id: settings.producer_id,
            epoch: settings.producer_epoch,
            max_request_bytes: MAX_STREAM_REQUEST_BYTES,
            ..ProducerConfig::default()
        },
    );
    // Cancelled by the printer at the first failure: no more input is read
    // or sent (even while waiting for the next line of an interactive stdin).
    let failed = CancellationToken::new();
    let (to_printer, pending) = mpsc::channel(settings.in_flight.max(1) * 2);
    let printer = tokio::spawn(print_in_order(pending, settings.shard, settings.json, failed.clone(), tried));
    let mut refused = None;
    loop {
        let group = tokio::select! {
            biased;
            _ = failed.cancelled() => break,
            group = groups.recv() => match group {
                Some(group) => group,
                None => break,
            },
        };
        let records = match group.and_then(|records| fits(settings.shard, records)) {
            Ok(records) => records,
            Err(error) => {
                refused = Some(error);
                break;
            }
        };
        let count = records.len();
        let acks = producer.send_batch(settings.shard, records.into_iter().map(|r| (r.key, r.payload)).collect()).await;
        if to_printer.send((count, acks)).await.is_err() {
            break;
        }
    }
    drop(to_printer);
    let printed = printer.await.map_err(|e| ClientError::new(Kind::Other, None, format!("printing outcomes: {e}")))?;
    match (printed, refused) {
        (Err(error), _) | (Ok(()), Some(error)) => Err(error),
        (Ok(()), None) => Ok(()),
    }
}

/// Opens connections as the one-at-a-time path does (TLS, timeouts, the
/// health probe), remembering who was tried for the error messages.
fn connector(options: ChannelOptions, tried: Arc<std::sync::Mutex<Tried>>) -> Connect {
    Arc::new(move |server: String| -> BoxFuture<'static, Result<_, ConnectError>> {
        let tried = tried.clone();
        Box::pin(async move {
            match crate::client::connect(&server, &options).await {
                Ok(client) => {
                    let mut tried = tried.lock().expect("never poisoned");
                    tried.failures.clear();
                    tried.server = Some(server);
                    Ok(client)
                }
                Err(error) => {
                    tried.lock().expect("never poisoned").failures.push(error.clone());
                    Err(Arc::new(error) as ConnectError)
                }
            }
        })
    })
}

/// The group itself, or why it is too large to send (nothing sent).
fn fits(shard: u32, records: Vec<AppendRecord>) -> Result<Vec<AppendRecord>, ClientError> {
    let request = AppendRequest { shard_id: shard, records, ..Default::default() };
    crate::client::refuse_if_larger(&request, MAX_STREAM_REQUEST_BYTES, || {
        format!(
            "the client sends at most {MAX_STREAM_REQUEST_BYTES} bytes in one request of a producer's stream (a \
             node's default max_batch_bytes): use a smaller --batch; this batch and the ones after it were not sent"
        )
    })?;
    Ok(request.records)
}

/// Waits for each group's acknowledgements in input order and prints its
/// line; returns the first group's failure, counting the records of the
/// groups behind it that were not acknowledged either.
async fn print_in_order(
    mut pending: mpsc::Receiver<(usize, Vec<RecordAck>)>,
    shard: u32,
    json: bool,
    failed: CancellationToken,
    tried: Arc<std::sync::Mutex<Tried>>,
) -> Result<(), ClientError> {
    let mut first: Option<ClientError> = None;
    let mut unacknowledged_after = 0usize;
    while let Some((count, acks)) = pending.recv().await {
        let outcomes = futures::future::join_all(acks).await;
        // Written by an earlier attempt that the shard no longer places:
        // acknowledged, its seqno unknown.
        let outcomes = outcomes.into_iter().map(|outcome| match outcome {
            Err(ProduceError::WrittenSeqnoUnknown(_)) => Ok(Acked { shard, seqno: 0, epoch: 0, duplicate: true }),
            other => other,
        });
        match outcomes.collect::<Result<Vec<Acked>, ProduceError>>() {
            Ok(acked) => print_acknowledged(shard, json, &acked),
            Err(e) => {
                let error = client_error(e, &tried.lock().expect("never poisoned"));
                if json && error.kind == Kind::OutcomeUnknown {
                    println!(
                        "{}",
                        json!({"shard": shard, "outcome": "unknown", "records": count, "detail": error.to_string()})
                    );
                }
                failed.cancel();
                match first {
                    None => first = Some(error),
                    Some(_) => unacknowledged_after += count,
                }
            }
        }
    }
    match first {
        None => Ok(()),
        Some(mut error) => {
            if unacknowledged_after > 0 {
                error.message.push_str(&format!(
                    " ({unacknowledged_after} records sent after it were not acknowledged either; the groups that \
                     were are printed)"
                ));
            }
            Err(error)
        }
    }
}

/// One acknowledged group's line.
fn print_acknowledged(shard: u32, json: bool, acked: &[Acked]) {
    let (Some(first), Some(last)) = (acked.first(), acked.last()) else { return };
    let duplicate = acked.iter().all(|a| a.duplicate);
    // A seqno of 0: a failover cut the group's batch in two, or the shard
    // no longer remembers where a retried batch went. Written, in order;
    // where is not known.
    let known = acked.iter().all(|a| a.seqno != 0);
    if json {
        let (first_seqno, last_seqno) =
            if known { (json!(first.seqno), json!(last.seqno)) } else { (json!(null), json!(null)) };
        println!(
            "{}",
            json!({"shard": shard, "outcome": "acknowledged", "first_seqno": first_seqno, "last_seqno": last_seqno, "epoch": last.epoch, "duplicate": duplicate})
        );
    } else if !known {
        println!("appended shard {shard}: {} records (written in order; their seqnos are not known)", acked.len());
    } else if duplicate {
        println!(
            "appended shard {shard} seqnos {}..={} (already written by an earlier attempt of this producer; nothing \
             written again)",
            first.seqno, last.seqno
        );
    } else {
        println!("appended shard {shard} seqnos {}..={} (epoch {})", first.seqno, last.seqno, last.epoch);
    }
}

/// A producer's failure as the client's error, with the exit code the
/// one-at-a-time path gives the same failure.
fn client_error(error: ProduceError, tried: &Tried) -> ClientError {
    let server = tried.server.as_deref();
    match error {
        ProduceError::Refused(status) => status_error(server.unwrap_or("the leader"), &status),
        ProduceError::OutcomeUnknown { server: sent_to, detail } => ClientError::new(
            Kind::OutcomeUnknown,
            sent_to.as_deref().or(server),
            format!("the append may or may not have been written: {detail}"),
        ),
        ProduceError::NotWritten(detail) => ClientError::new(
            Kind::DeadlineExceeded,
            None,
            format!("no leader accepted the append within --deadline; it was not written: {detail}"),
        ),
        ProduceError::Unreachable(last) => {
            let what = "no server could be reached; the append was not sent";
            if tried.failures.is_empty() {
                return match last.downcast_ref::<ClientError>() {
                    Some(error) => error.clone(),
                    None => ClientError::new(Kind::Unreachable, None, format!("{what}: {last}")),
                };
            }
            ClientError::of_all(what, &tried.failures[tried.failures.len().saturating_sub(tried.servers.max(3))..])
        }
        ProduceError::WrittenSeqnoUnknown(detail) => ClientError::new(
            Kind::Other,
            server,
            format!("the append was written, but the shard no longer knows its seqnos: {detail}"),
        ),
        ProduceError::Closed(detail) => {
            ClientError::new(Kind::Other, server, format!("the producer stopped: {detail}"))
        }
    }
}
