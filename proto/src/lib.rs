//! walship's wire contracts, generated from `proto/` by `build.rs`.
//!
//! * [`replication`]: `tidal.replication.v1.WalShipping`, node-to-node
//!   replication (seed contract; walship's additions use new field numbers).
//! * [`dataplane`]: `dataplane.v1.DataPlane` (coordinator <-> node task
//!   stream) and `dataplane.v1.PeerExchange` (node -> node segment fetch).
//! * [`log`]: `walship.v1.Log`, the client API.
//!
//! Every service uses [`codec::StrictCodec`], which answers an undecodable
//! message with `INVALID_ARGUMENT` rather than `INTERNAL`: a malformed request
//! is the caller's fault and must not look like a server failure.

pub mod codec;
pub mod pipeline;

/// `tidal.replication.v1`: WalShipping.
pub mod replication {
    tonic::include_proto!("tidal.replication.v1");
}

/// `dataplane.v1`: DataPlane and PeerExchange.
pub mod dataplane {
    tonic::include_proto!("dataplane.v1");
}

/// `walship.v1`: the client Log service and the Control service
/// (leadership: fence, assign, epoch ends; drills).
pub mod log {
    tonic::include_proto!("walship.v1");
}

/// Encoded `FileDescriptorSet` of every walship proto, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("walship_descriptor");

/// Name of the response metadata key that carries the current leader of a
/// shard (`<node_id>@<grpc address>`) on a not-leader refusal.
pub const LEADER_METADATA_KEY: &str = "walship-leader";

/// The gRPC address of the leader a not-leader refusal names (its
/// `LEADER_METADATA_KEY` value after the `@`), if it names one.
pub fn leader_address(status: &tonic::Status) -> Option<&str> {
    status.metadata().get(LEADER_METADATA_KEY)?.to_str().ok()?.split_once('@').map(|(_, address)| address)
}

/// Name of the response metadata key set to `unknown` on an append whose
/// outcome the node cannot know (it stopped leading while waiting for the
/// durability asked for).
pub const OUTCOME_METADATA_KEY: &str = "walship-outcome";

/// Marks `status` as the answer to an append whose outcome is unknown.
pub fn mark_outcome_unknown(status: &mut tonic::Status) {
    status.metadata_mut().insert(OUTCOME_METADATA_KEY, tonic::metadata::MetadataValue::from_static("unknown"));
}

/// Whether `status` answers an append whose outcome is unknown.
pub fn outcome_unknown(status: &tonic::Status) -> bool {
    status.metadata().get(OUTCOME_METADATA_KEY).is_some_and(|v| v == "unknown")
}

/// Name of the response metadata key that says why a producer or
/// conditional append was refused (one of the `REFUSAL_*` values).
pub const REFUSAL_METADATA_KEY: &str = "walship-refusal";
/// A conditional append's expected last seqno was not the shard's.
pub const REFUSAL_EXPECTED_LAST: &str = "expected-last";
/// The producer's epoch is older than one the shard has seen.
pub const REFUSAL_PRODUCER_FENCED: &str = "producer-fenced";
/// The shard does not know the producer (or its new epoch) and the append
/// does not start at sequence 1.
pub const REFUSAL_PRODUCER_UNKNOWN: &str = "producer-unknown";
/// The append's sequence leaves a gap after the producer's last.
pub const REFUSAL_PRODUCER_SEQUENCE: &str = "producer-sequence";
/// Name of the response metadata key that carries the shard's newest seqno
/// on an `expected-last` refusal.
pub const LAST_SEQNO_METADATA_KEY: &str = "walship-last-seqno";

/// Why `status` refused a producer or conditional append, if it did.
pub fn refusal(status: &tonic::Status) -> Option<&str> {
    status.metadata().get(REFUSAL_METADATA_KEY).and_then(|v| v.to_str().ok())
}

/// The shard's newest seqno named by an `expected-last` refusal.
pub fn refused_last_seqno(status: &tonic::Status) -> Option<u64> {
    status.metadata().get(LAST_SEQNO_METADATA_KEY)?.to_str().ok()?.parse().ok()
}
