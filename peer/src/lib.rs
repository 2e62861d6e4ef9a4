//! `PeerExchange`: a node streams a sealed segment of a shard it holds to a
//! peer, guarded by a fetch token ([`token`]); the fetching side
//! ([`client`]) checks every chunk and falls through to the next peer, then
//! to the object store (the durable copy).
//!
//! In walship the "files" are the archive's segments: the serving node
//! re-reads the records a segment key names from its own WAL and encodes
//! them exactly as the archiver did, so a peer's copy and the object
//! store's are the same bytes under the same key, and a node needs no
//! second copy of its log on disk. Retention keeps a segment's records in
//! the WAL at least until the archive holds them.

pub mod client;
pub mod server;
pub mod token;
