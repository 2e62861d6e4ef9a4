//! walship's Rust client.
//!
//! * [`producer`]: [`Producer`], which appends records to any shard
//!   exactly once: it batches them per shard (`linger` / `batch_records` /
//!   `batch_bytes`, as Kafka's producer), pipelines the batches over one
//!   `Log.AppendStream` per shard leader, follows the leader through
//!   failovers, and retries every batch whose outcome is unknown with the
//!   same producer sequences, so the shard never writes it twice. Each
//!   record's [`RecordAck`] resolves to where it was written.
//!
//! The wire contract is `proto/proto/walship/v1/log.proto`; a client in
//! another language gets the same guarantees by following what
//! `producer.rs` does (see the module docs there).

pub mod producer;

pub use producer::{Acked, Connect, ConnectError, ProduceError, Producer, ProducerConfig, RecordAck};
