//! The read side of the Log service: `Read` and `Tail`, their checks, the
//! wait for a `min_seqno`, and the room each answer takes in the node's
//! read memory budget ([`crate::read_memory`]).

use super::*;
use crate::read_memory::{Held, NoRoom, READ_MEMORY_WAIT, ReadMemory};

/// Longest a read waits for its `min_seqno` when the call carries no
/// deadline.
pub const MAX_READ_WAIT: Duration = Duration::from_secs(30);

/// The call's deadline from its `grpc-timeout` header (`<digits><unit>`,
/// unit one of H M S m u n), if it has a valid one.
pub(super) fn call_deadline(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let split = value.len().checked_sub(1)?;
    let (digits, unit) = value.split_at(split);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How long a read waits for its `min_seqno`: until shortly before the
/// call's deadline (so that the answer names how far this replica got,
/// rather than the transport's bare "timeout expired"), at most
/// [`MAX_READ_WAIT`].
fn read_wait_patience(deadline: Option<Duration>) -> Duration {
    match deadline {
        Some(d) => d.saturating_sub((d / 10).min(Duration::from_millis(500))).min(MAX_READ_WAIT),
        None => MAX_READ_WAIT,
    }
}

impl LogService {
    /// Checks `from` for a read or tail: seqnos start at 1 and compacted
    /// records are gone.
    /// Returns the first retained seqno and the newest readable (committed).
    pub(super) fn check_from(&self, shard: ShardId, from: u64) -> Result<(u64, u64), Status> {
        let readable = self.replica(shard)?.readable();
        let positions = self.wal.positions(shard).map_err(wal_status)?;
        if from == 0 {
            return Err(Status::invalid_argument("from_seqno must be >= 1 (seqnos start at 1)"));
        }
        if from < positions.first_seqno {
            return Err(Status::out_of_range(format!(
                "shard {shard}: seqno {from} is compacted; the oldest retained is {}",
                positions.first_seqno
            )));
        }
        Ok((positions.first_seqno, readable))
    }

    fn read_limit(&self, asked: u64) -> usize {
        match asked {
            0 => self.limits.default_read_bytes,
            n => (n.min(usize::MAX as u64) as usize).min(self.limits.max_read_bytes),
        }
    }

    /// Refuses a `min_seqno` the shard's leader has not even written: no
    /// acknowledged seqno is past it, so waiting would only wait out the
    /// call's deadline for a record that may never come (a seqno of another
    /// shard, say). A follower may be behind its leader, and waits.
    fn check_min_seqno(&self, shard: ShardId, min_seqno: u64) -> Result<(), Status> {
        if self.replica(shard)?.leader_state().is_none() {
            return Ok(());
        }
        let written = self.wal.positions(shard).map_err(wal_status)?.last_seqno;
        if min_seqno > written {
            return Err(Status::out_of_range(format!(
                "shard {shard}: min_seqno {min_seqno} is past the newest seqno {written} its leader has written"
            )));
        }
        Ok(())
    }

    /// Waits, up to `patience`, until this replica has committed `seqno`
    /// (a read's `min_seqno`); UNAVAILABLE naming how far it got otherwise.
    async fn wait_committed(&self, shard: ShardId, seqno: u64, patience: Duration) -> Result<(), Status> {
        let replica = self.replica(shard)?;
        let mut readable = replica.readable_watch();
        let reached = tokio::select! {
            reached = tokio::time::timeout(patience, readable.wait_for(|&c| c >= seqno)) => reached,
            _ = self.node.shutdown.cancelled() => {
                return Err(shutting_down(self.node.me));
            }
        };
        match reached {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(shutting_down(self.node.me)),
            Err(_) => Err(Status::unavailable(format!(
                "shard {shard}: this replica has committed up to seqno {}, short of min_seqno {seqno}, after \
                 waiting {} ms (the call's deadline); retry, or read from the leader",
                replica.readable(),
                patience.as_millis()
            ))),
        }
    }

    /// Room for a read of up to `bytes` in the node's read memory budget,
    /// waiting at most [`READ_MEMORY_WAIT`] (less with a nearer deadline).
    async fn read_room(&self, bytes: usize, deadline: Option<Duration>) -> Result<Held, Status> {
        let patience = read_wait_patience(deadline).min(READ_MEMORY_WAIT);
        self.read_memory.take(bytes, patience).await.map_err(|NoRoom { budget, wanted, waited }| {
            Status::resource_exhausted(format!(
                "node {}: its read memory budget (limits.read_memory_bytes = {budget}) is held by answers being \
                 built or not yet taken by their callers; this read of up to {wanted} bytes waited {} ms for room. \
                 Retry later, or ask for fewer bytes (max_bytes)",
                self.node.me,
                waited.as_millis()
            ))
        })
    }

    /// A read, and the room its answer holds in the read memory budget
    /// until sent (none for an answer with nothing to read).
    pub(super) async fn read_inner(
        &self,
        req: ReadRequest,
        deadline: Option<Duration>,
    ) -> Result<(ReadResponse, Option<Held>), Status> {
        let shard = req.shard_id;
        if req.last != 0 && req.from_seqno != 0 {
            return Err(Status::invalid_argument(format!(
                "from_seqno {} with last {}: a read of the newest records takes from_seqno 0",
                req.from_seqno, req.last
            )));
        }
        if req.min_seqno != 0 {
            // What no wait can cure is refused before waiting.
            if req.last == 0 {
                self.check_from(shard, req.from_seqno)?;
                check_order(&req)?;
            }
            self.check_min_seqno(shard, req.min_seqno)?;
            self.wait_committed(shard, req.min_seqno, read_wait_patience(deadline)).await?;
        }
        let req = if req.last == 0 {
            req
        } else {
            let durable = self.replica(shard)?.readable();
            let first = self.wal.positions(shard).map_err(wal_status)?.first_seqno;
            let to = if req.to_seqno == 0 { durable } else { req.to_seqno };
            if to > durable {
                return Err(Status::out_of_range(format!(
                    "shard {shard}: to_seqno {to} passes the newest committed seqno {durable}"
                )));
            }
            if to < first {
                // Nothing retained in range (an empty shard, say).
                let empty =
                    ReadResponse { records: Vec::new(), next_seqno: first, durable_seqno: durable, first_seqno: first };
                return Ok((empty, None));
            }
            let from = to.saturating_sub(req.last - 1).max(first);
            ReadRequest { from_seqno: from, to_seqno: to, ..req }
        };
        let (first_seqno, durable) = self.check_from(shard, req.from_seqno)?;
        check_order(&req)?;
        let to = if req.to_seqno == 0 { durable } else { req.to_seqno };
        if to < req.from_seqno {
            return Err(Status::out_of_range(format!(
                "shard {shard}: nothing at seqno {}; the newest committed is {durable}",
                req.from_seqno
            )));
        }
        if to > durable {
            return Err(Status::out_of_range(format!(
                "shard {shard}: range [{}, {to}] passes the newest committed seqno {durable}",
                req.from_seqno
            )));
        }
        let limit = self.read_limit(req.max_bytes);
        let mut room = self.read_room(limit, deadline).await?;
        let frames = self.wal.read(shard, req.from_seqno, to, limit).await.map_err(wal_status)?;
        let next_seqno = frames.last().map_or(req.from_seqno, |f| f.seqno() + 1);
        let response = ReadResponse {
            records: frames.iter().map(to_record).collect(),
            next_seqno,
            durable_seqno: durable,
            first_seqno,
        };
        drop(frames);
        room.keep(prost::Message::encoded_len(&response));
        Ok((response, Some(room)))
    }
}

/// A read whose `to_seqno` (when given) is before its `from_seqno`.
fn check_order(req: &ReadRequest) -> Result<(), Status> {
    if req.to_seqno != 0 && req.to_seqno < req.from_seqno {
        return Err(Status::invalid_argument(format!(
            "to_seqno {} is before from_seqno {}",
            req.to_seqno, req.from_seqno
        )));
    }
    Ok(())
}

/// Streams committed frames from `from`, waiting on the replica's readable
/// watch when caught up. Ends when the client goes away, the WAL stops, or a
/// read fails or the node shuts down (reported as the stream's last item).
pub(super) fn tail_stream(
    wal: Wal,
    shard: ShardId,
    durable: walship_wal::position::Receiver,
    from: u64,
    chunk_bytes: usize,
    stop: Stop,
    memory: ReadMemory,
) -> impl Stream<Item = Result<TailResponse, Status>> + Send {
    // The room the last batch holds goes back when the stream is polled for
    // the next one: the transport asks for more only once what it holds has
    // mostly left (its per-stream send buffer).
    futures::stream::unfold(Some((wal, durable, from, None::<Held>)), move |state| {
        let stop = stop.clone();
        let memory = memory.clone();
        async move {
            let (wal, mut durable, next, last) = state?;
            drop(last);
            loop {
                let newest = *durable.borrow_and_update();
                if newest >= next {
                    let mut room = tokio::select! {
                        room = memory.take_when_free(chunk_bytes) => room,
                        _ = stop.shutdown.cancelled() => return Some((Err(shutting_down(stop.node)), None)),
                    };
                    return match wal.read(shard, next, newest, chunk_bytes).await {
                        Ok(frames) => {
                            let after = frames.last().map_or(next, |f| f.seqno() + 1);
                            let response = TailResponse { records: frames.iter().map(to_record).collect() };
                            room.keep(prost::Message::encoded_len(&response));
                            Some((Ok(response), Some((wal, durable, after, Some(room)))))
                        }
                        Err(e) => Some((Err(wal_status(e)), None)),
                    };
                }
                tokio::select! {
                    changed = durable.changed() => if changed.is_err() { return None },
                    _ = stop.shutdown.cancelled() => return Some((Err(shutting_down(stop.node)), None)),
                }
            }
        }
    })
}
