//! `PeerExchange` and the object-store tier.
//!
//! Not built yet: a later issue adds here the `PeerExchange.FetchShuffle`
//! server and client (a node streams a sealed segment file it holds locally,
//! in chunks of at most 256 KiB, guarded by a coordinator-minted token and a
//! concurrency cap) and the object store that holds the durable copy of
//! archived segments (S3, and a local directory by default). The wire
//! contract already lives in `walship-proto` (`dataplane.v1.PeerExchange`).
