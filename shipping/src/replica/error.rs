//! The replication shell's one error type, and the one place it becomes a
//! gRPC status.
//!
//! Every refusal a replica gives (to a leader's shipment, a follower's
//! catch-up request, the coordinator's fence or assignment, a drill) is a
//! [`ReplicaError`] variant carrying what the answer needs. [`ReplicaError::reason`]
//! is its `walship_ship_refused_total` label (none for the retryable
//! waits, which are not refusals of the request's content), and
//! [`ReplicaError::retryable`] says whether the same request may succeed
//! later. `From<ReplicaError> for tonic::Status` maps each to exactly one
//! code, with the metadata a leader or follower acts on
//! ([`EPOCH_METADATA_KEY`], [`APPLIED_METADATA_KEY`]).

use tonic::Status;
use tonic::metadata::MetadataValue;
use walship_proto::replication::ShipSegmentResponse;
use walship_wal::{ShardId, WalError};

use crate::NodeId;
use crate::core::Epoch;
use crate::core::replica::Refusal;

/// Response metadata: the newest epoch a refusing replica has seen.
pub const EPOCH_METADATA_KEY: &str = "walship-epoch";
/// Response metadata: a follower's durable frontier on a gap refusal.
pub const APPLIED_METADATA_KEY: &str = "walship-applied-seqno";
/// The oldest seqno a leader still holds, on a `NeedsReseed` refusal (the
/// follower then re-seeds from the archive up to it).
pub const RETAINED_METADATA_KEY: &str = "walship-first-retained-seqno";
/// On every error a replica answers with itself (a refusal, a wait, a gap):
/// the node is up and said no for this shard, as opposed to a call that
/// never reached it (a broken link, a timeout, a partition drill). A leader
/// backs off from such a shard alone, without counting the node as down.
pub const REFUSED_METADATA_KEY: &str = "walship-refused";

/// Whether `status` is a replica's own answer (see [`REFUSED_METADATA_KEY`]).
pub fn refused_by_replica(status: &Status) -> bool {
    status.metadata().contains_key(REFUSED_METADATA_KEY)
}

/// On an `awaiting_assignment` refusal: the replica takes nothing until its
/// coordinator assigns it, and then pulls a catch-up itself, so its leader
/// stops pushing to it until then instead of retrying.
pub const AWAITING_ASSIGNMENT_METADATA_KEY: &str = "walship-awaiting-assignment";

/// Whether `status` says the replica waits for its coordinator's assignment
/// (see [`AWAITING_ASSIGNMENT_METADATA_KEY`]).
pub fn awaits_assignment(status: &Status) -> bool {
    status.metadata().contains_key(AWAITING_ASSIGNMENT_METADATA_KEY)
}

/// Request metadata opening a `ShipSegments` stream whose refusals are
/// answered in place (`refusal_code` in the answer) instead of ending it.
pub const INLINE_REFUSALS_KEY: &str = "walship-inline-refusals";

/// Whether a `ShipSegments` call asked for refusals in place.
pub fn inline_refusals(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.get(INLINE_REFUSALS_KEY).is_some_and(|v| v.as_bytes() == b"1")
}

/// A refused push's status as the answer that stands in for it on a stream
/// with refusals in place: code, message and `walship-*` metadata.
pub fn refusal_answer(status: &Status) -> ShipSegmentResponse {
    let refusal_metadata = status
        .metadata()
        .iter()
        .filter_map(|entry| match entry {
            tonic::metadata::KeyAndValueRef::Ascii(key, value) if key.as_str().starts_with("walship-") => {
                Some((key.as_str().to_string(), value.to_str().ok()?.to_string()))
            }
            _ => None,
        })
        .collect();
    ShipSegmentResponse {
        // A refusal with code OK cannot be told from an answer: say UNKNOWN.
        refusal_code: if status.code() == tonic::Code::Ok { tonic::Code::Unknown as u32 } else { status.code() as u32 },
        refusal_message: status.message().to_string(),
        refusal_metadata,
        ..Default::default()
    }
}

/// The status a push answered in place was refused with, if it was: what
/// the unary `ShipSegment` would have returned (metadata that is not valid
/// gRPC metadata is left out).
pub fn refusal_status(answer: &ShipSegmentResponse) -> Option<Status> {
    if answer.refusal_code == 0 {
        return None;
    }
    let code = i32::try_from(answer.refusal_code).map_or(tonic::Code::Unknown, tonic::Code::from);
    let mut status = Status::new(code, answer.refusal_message.clone());
    for (key, value) in &answer.refusal_metadata {
        if let (Ok(key), Ok(value)) =
            (tonic::metadata::AsciiMetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value.as_str()))
        {
            status.metadata_mut().insert(key, value);
        }
    }
    Some(status)
}

/// Why a replica refused or failed a request.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("shard {shard} is not hosted by node {node}")]
    UnknownShard { shard: ShardId, node: NodeId },
    /// The role and epoch rules said no (`core::replica`).
    #[error("{}", refusal_message(*shard, *node, refusal))]
    Refused { shard: ShardId, node: NodeId, refusal: Refusal },
    /// The request contradicts itself or the protocol.
    #[error("{0}")]
    BadRequest(String),
    #[error("corrupt segment for shard {shard}: {detail}")]
    CorruptSegment { shard: ShardId, detail: String },
    #[error("shard {shard}: segment starts at {first} but this replica expects {expected}; catching up")]
    Gap { shard: ShardId, first: u64, expected: u64, durable: u64 },
    #[error("node {node} is not the leader of shard {shard}; the leader is {hint}")]
    NotLeader { shard: ShardId, node: NodeId, hint: String },
    /// A catch-up requester has seen a newer epoch than this leader.
    #[error("requester has seen epoch {seen} but this leader is at epoch {epoch}")]
    NewerRequester { epoch: u64, seen: u64 },
    #[error("shard {shard}: seqno {from} is no longer retained (oldest is {first}); the replica needs a re-seed")]
    NeedsReseed { shard: ShardId, from: u64, first: u64 },
    #[error("shard {shard}: from_seqno {from} is past the leader's durable seqno {durable}")]
    PastDurable { shard: ShardId, from: u64, durable: u64 },
    /// Queued frames did not become durable as expected (a repair truncated
    /// them meanwhile); the follower resynchronised from its WAL.
    #[error("shard {shard}: applying the segment: {source}")]
    Apply { shard: ShardId, source: WalError },
    /// The WAL refused to take more right now.
    #[error("{0}")]
    Busy(WalError),
    #[error("{0}")]
    Unavailable(String),
    /// The node's disk is below its free-space reserve.
    #[error("{0}")]
    NoSpace(String),
    /// A drill asked a replica to act as a follower while it follows no
    /// leader (none assigned yet, or a failover is under way).
    #[error("shard {shard}: node {node} follows no leader now (none assigned, or a failover is under way)")]
    NotFollowing { shard: ShardId, node: NodeId },
    #[error("crash drills are not enabled on this node (--allow-crash-drills)")]
    CrashDrillsDisabled,
    /// A partition drill cuts this node's replication traffic with `peer`.
    #[error("partitioned (drill): node {node} treats node {peer} as unreachable for replication")]
    Partitioned { node: NodeId, peer: NodeId },
    /// A damage drill named a record this replica does not hold durably.
    #[error("shard {shard}: node {node} holds no durable record {seqno} to damage (it holds [{first}, {durable}])")]
    NoSuchRecord { shard: ShardId, node: NodeId, seqno: u64, first: u64, durable: u64 },
    #[error(transparent)]
    Wal(#[from] WalError),
    /// A peer's answer, passed on (catch-up streams, repair).
    #[error(transparent)]
    Peer(#[from] Status),
}

fn refusal_message(shard: ShardId, node: NodeId, refusal: &Refusal) -> String {
    match *refusal {
        Refusal::StaleEpoch { epoch, seen } => {
            format!("shard {shard}: epoch {epoch} is older than epoch {seen} already seen")
        }
        Refusal::NotAReplica { node: leader } => format!("node {leader} holds no replica of shard {shard}"),
        Refusal::ForeignLeader { node: from } => format!("node {from} holds no replica of shard {shard}"),
        Refusal::RestartedEpoch { epoch } => format!(
            "node {node} restarted in epoch {epoch} of shard {shard}, which it may have led before; it leads only \
             in a newer epoch (a failover raises it)"
        ),
        Refusal::SteppedDown { epoch } => format!(
            "node {node} stepped down from epoch {epoch} of shard {shard} when a majority stopped answering it; it \
             leads only in a newer epoch (a failover raises it)"
        ),
        Refusal::NotFollower => format!("node {node} is the leader of shard {shard}, not a follower"),
        Refusal::WrongLeader { from, leader } => {
            format!("shard {shard}: segment from node {from} but the leader is node {leader}")
        }
        Refusal::Paused => format!("shard {shard} replica on node {node} is paused (drill)"),
        Refusal::Reconciling { epoch } => {
            format!("shard {shard}: reconciling with the leader of epoch {epoch} before applying its segments")
        }
        Refusal::LeaderCannotPause => format!("node {node} leads shard {shard}: pause a follower"),
        Refusal::AwaitingAssignment => format!(
            "shard {shard}: node {node} holds no epoch promise it can trust (a new or wiped data dir, or records \
             lost to WAL damage at start) and waits for its coordinator to assign it before it takes any"
        ),
        Refusal::EpochTooLarge { epoch } => {
            format!(
                "shard {shard}: epoch {epoch} is past the largest epoch {} any coordinator hands out",
                Epoch::CEILING - 1
            )
        }
    }
}

impl ReplicaError {
    /// The refusal's `reason` label, for `walship_ship_refused_total`; none
    /// for waits and failures that say nothing about the request.
    pub fn reason(&self) -> Option<&'static str> {
        Some(match self {
            ReplicaError::UnknownShard { .. } => "unknown_shard",
            ReplicaError::Refused { refusal: Refusal::Paused | Refusal::Reconciling { .. }, .. } => return None,
            ReplicaError::Refused { refusal, .. } => refusal.reason(),
            ReplicaError::BadRequest(_) | ReplicaError::PastDurable { .. } | ReplicaError::NoSuchRecord { .. } => {
                "bad_request"
            }
            ReplicaError::CorruptSegment { .. } => "corrupt",
            ReplicaError::Gap { .. } => "gap",
            ReplicaError::NotLeader { .. } => "not_leader",
            ReplicaError::NewerRequester { .. } => "stale_epoch",
            ReplicaError::NeedsReseed { .. } => "needs_reseed",
            ReplicaError::NoSpace(_) => "disk_full",
            ReplicaError::Apply { .. }
            | ReplicaError::Busy(_)
            | ReplicaError::Unavailable(_)
            | ReplicaError::CrashDrillsDisabled
            | ReplicaError::NotFollowing { .. }
            | ReplicaError::Partitioned { .. }
            | ReplicaError::Wal(_)
            | ReplicaError::Peer(_) => return None,
        })
    }

    /// Whether this is the leader of a catch-up saying it does not lead the
    /// shard in the follower's epoch (not yet: its own assignment is still
    /// on the way; or no longer): the follower's catch-up then waits for
    /// the leader's first shipment, which restarts it, rather than asking
    /// again and again while thousands of leaders start.
    pub fn leader_not_leading(&self) -> bool {
        matches!(self, ReplicaError::Peer(status)
            if status.code() == tonic::Code::FailedPrecondition && refused_by_replica(status))
    }

    /// Whether the same request may succeed if sent again later.
    pub fn retryable(&self) -> bool {
        match self {
            ReplicaError::Refused { refusal, .. } => refusal.retryable(),
            ReplicaError::Gap { .. }
            | ReplicaError::Busy(_)
            | ReplicaError::Unavailable(_)
            | ReplicaError::Partitioned { .. }
            | ReplicaError::NotFollowing { .. }
            | ReplicaError::NoSpace(_) => true,
            ReplicaError::Peer(status) => {
                matches!(status.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded)
            }
            _ => false,
        }
    }
}

fn with_metadata(mut status: Status, key: &'static str, value: u64) -> Status {
    if let Ok(v) = MetadataValue::try_from(value.to_string()) {
        status.metadata_mut().insert(key, v);
    }
    status
}

/// A `u64` response metadata value, if present and well formed.
pub fn metadata_u64(status: &Status, key: &str) -> Option<u64> {
    status.metadata().get(key)?.to_str().ok()?.parse().ok()
}

impl From<ReplicaError> for Status {
    fn from(error: ReplicaError) -> Status {
        // A partition drill looks like a broken link; a peer's status is
        // passed on as it came.
        let own = !matches!(error, ReplicaError::Partitioned { .. } | ReplicaError::Peer(_));
        let mut status = status_of(error);
        if own {
            status.metadata_mut().insert(REFUSED_METADATA_KEY, MetadataValue::from_static("1"));
        }
        status
    }
}

fn status_of(error: ReplicaError) -> Status {
    {
        let message = error.to_string();
        match error {
            ReplicaError::UnknownShard { .. } => Status::not_found(message),
            ReplicaError::Refused { refusal, .. } => match refusal {
                Refusal::StaleEpoch { seen, .. } => {
                    with_metadata(Status::failed_precondition(message), EPOCH_METADATA_KEY, seen.0)
                }
                Refusal::NotAReplica { .. } | Refusal::EpochTooLarge { .. } => Status::invalid_argument(message),
                Refusal::Paused | Refusal::Reconciling { .. } => Status::unavailable(message),
                Refusal::AwaitingAssignment => {
                    with_metadata(Status::unavailable(message), AWAITING_ASSIGNMENT_METADATA_KEY, 1)
                }
                Refusal::ForeignLeader { .. }
                | Refusal::RestartedEpoch { .. }
                | Refusal::SteppedDown { .. }
                | Refusal::NotFollower
                | Refusal::WrongLeader { .. }
                | Refusal::LeaderCannotPause => Status::failed_precondition(message),
            },
            ReplicaError::BadRequest(_) | ReplicaError::CorruptSegment { .. } => Status::invalid_argument(message),
            ReplicaError::Gap { durable, .. } => {
                with_metadata(Status::out_of_range(message), APPLIED_METADATA_KEY, durable)
            }
            ReplicaError::NotLeader { .. } => Status::failed_precondition(message),
            ReplicaError::NewerRequester { seen, .. } => {
                with_metadata(Status::failed_precondition(message), EPOCH_METADATA_KEY, seen)
            }
            ReplicaError::NeedsReseed { first, .. } => {
                with_metadata(Status::out_of_range(message), RETAINED_METADATA_KEY, first)
            }
            ReplicaError::PastDurable { .. } | ReplicaError::NoSuchRecord { .. } => Status::out_of_range(message),
            ReplicaError::Apply { .. } | ReplicaError::NotFollowing { .. } => Status::failed_precondition(message),
            ReplicaError::Busy(_) | ReplicaError::Unavailable(_) | ReplicaError::Partitioned { .. } => {
                Status::unavailable(message)
            }
            ReplicaError::NoSpace(_) => Status::resource_exhausted(message),
            ReplicaError::CrashDrillsDisabled => Status::permission_denied(message),
            ReplicaError::Wal(e) if e.corrupt_range().is_some() => Status::data_loss(message),
            ReplicaError::Wal(_) => Status::internal(message),
            ReplicaError::Peer(status) => status,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Epoch;

    fn refused(refusal: Refusal) -> Status {
        ReplicaError::Refused { shard: 4, node: 2, refusal }.into()
    }

    #[test]
    fn a_stale_epoch_names_the_newest_epoch_in_metadata() {
        let status = refused(Refusal::StaleEpoch { epoch: Epoch(3), seen: Epoch(7) });
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert_eq!(metadata_u64(&status, EPOCH_METADATA_KEY), Some(7));
        assert_eq!(status.message(), "shard 4: epoch 3 is older than epoch 7 already seen");
    }

    #[test]
    fn a_gap_carries_the_durable_frontier() {
        let status: Status = ReplicaError::Gap { shard: 1, first: 9, expected: 5, durable: 4 }.into();
        assert_eq!(status.code(), tonic::Code::OutOfRange);
        assert_eq!(metadata_u64(&status, APPLIED_METADATA_KEY), Some(4));
    }

    #[test]
    fn waits_are_retryable_and_not_counted_as_refusals() {
        for refusal in [Refusal::Paused, Refusal::Reconciling { epoch: Epoch(2) }] {
            let error = ReplicaError::Refused { shard: 1, node: 1, refusal };
            assert!(error.retryable());
            assert_eq!(error.reason(), None);
            assert_eq!(Status::from(error).code(), tonic::Code::Unavailable);
        }
        let full = ReplicaError::NoSpace("the WAL's disk is full".into());
        assert!(full.retryable());
        assert_eq!(full.reason(), Some("disk_full"));
        assert_eq!(Status::from(full).code(), tonic::Code::ResourceExhausted);
        // A drill's partition looks like a broken link: retry later.
        let cut = ReplicaError::Partitioned { node: 1, peer: 2 };
        assert!(cut.retryable());
        assert_eq!(cut.reason(), None);
        let status = Status::from(cut);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().starts_with("partitioned (drill)"), "{}", status.message());
    }

    #[test]
    fn a_replicas_own_answers_are_marked_and_broken_links_are_not() {
        let own: [ReplicaError; 4] = [
            ReplicaError::Refused { shard: 1, node: 1, refusal: Refusal::Reconciling { epoch: Epoch(2) } },
            ReplicaError::UnknownShard { shard: 9, node: 1 },
            ReplicaError::Gap { shard: 1, first: 9, expected: 5, durable: 4 },
            ReplicaError::Unavailable("busy".into()),
        ];
        for error in own {
            let status = Status::from(error);
            assert!(refused_by_replica(&status), "{status:?}");
        }
        let cut = Status::from(ReplicaError::Partitioned { node: 1, peer: 2 });
        assert!(!refused_by_replica(&cut), "a partition drill is a broken link");
        // A catch-up's leader that does not lead (yet), as the follower sees it.
        let not_leading = Status::from(ReplicaError::NotLeader { shard: 1, node: 2, hint: "unknown".into() });
        assert!(ReplicaError::Peer(not_leading).leader_not_leading());
        assert!(!ReplicaError::Peer(cut).leader_not_leading(), "a broken link is retried");
        assert!(!ReplicaError::Peer(Status::failed_precondition("from a proxy")).leader_not_leading());
        let passed_on = Status::from(ReplicaError::Peer(Status::unavailable("connection refused")));
        assert!(!refused_by_replica(&passed_on), "a peer's transport error is not this replica's answer");
        assert!(!refused_by_replica(&Status::unavailable("transport error")));
    }

    #[test]
    fn a_refusal_answered_in_place_reads_back_as_the_same_status() {
        let refusals = [
            ReplicaError::Refused {
                shard: 4,
                node: 2,
                refusal: Refusal::StaleEpoch { epoch: Epoch(3), seen: Epoch(7) },
            },
            ReplicaError::Refused { shard: 4, node: 2, refusal: Refusal::Reconciling { epoch: Epoch(7) } },
            ReplicaError::Gap { shard: 1, first: 9, expected: 5, durable: 4 },
            ReplicaError::NeedsReseed { shard: 1, from: 2, first: 40 },
        ];
        for error in refusals {
            let status = Status::from(error);
            let answer = refusal_answer(&status);
            assert!(!answer.accepted);
            let back = refusal_status(&answer).expect("a refusal");
            assert_eq!((back.code(), back.message()), (status.code(), status.message()));
            for key in [EPOCH_METADATA_KEY, APPLIED_METADATA_KEY, RETAINED_METADATA_KEY] {
                assert_eq!(metadata_u64(&back, key), metadata_u64(&status, key), "{key}");
            }
            assert!(refused_by_replica(&back));
        }
        // An answer is no refusal; a code out of range reads as UNKNOWN.
        assert!(refusal_status(&ShipSegmentResponse { accepted: true, ..Default::default() }).is_none());
        let odd = ShipSegmentResponse { refusal_code: u32::MAX, ..Default::default() };
        assert_eq!(refusal_status(&odd).unwrap().code(), tonic::Code::Unknown);
        let mut metadata = tonic::metadata::MetadataMap::new();
        assert!(!inline_refusals(&metadata));
        metadata.insert(INLINE_REFUSALS_KEY, MetadataValue::from_static("1"));
        assert!(inline_refusals(&metadata));
    }

    #[test]
    fn each_refusal_maps_to_one_code() {
        use tonic::Code;
        let cases = [
            (Refusal::NotAReplica { node: 9 }, Code::InvalidArgument, "bad_request"),
            (Refusal::ForeignLeader { node: 9 }, Code::FailedPrecondition, "wrong_leader"),
            (Refusal::RestartedEpoch { epoch: Epoch(3) }, Code::FailedPrecondition, "restarted_epoch"),
            (Refusal::NotFollower, Code::FailedPrecondition, "not_follower"),
            (Refusal::WrongLeader { from: 3, leader: 2 }, Code::FailedPrecondition, "wrong_leader"),
            (Refusal::LeaderCannotPause, Code::FailedPrecondition, "bad_request"),
            (Refusal::EpochTooLarge { epoch: Epoch(u64::MAX) }, Code::InvalidArgument, "bad_request"),
        ];
        for (refusal, code, reason) in cases {
            let error = ReplicaError::Refused { shard: 1, node: 1, refusal };
            assert_eq!(error.reason(), Some(reason), "{refusal:?}");
            assert!(!error.retryable(), "{refusal:?}");
            assert_eq!(Status::from(error).code(), code, "{refusal:?}");
        }
    }
}
