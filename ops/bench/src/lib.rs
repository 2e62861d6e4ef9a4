//! The benchmark harnesses' shared parts: the systems under test (three
//! `walship node`s and a coordinator, NATS JetStream R3, PostgreSQL with two
//! synchronous standbys), child processes that never outlive the harness,
//! the load drivers, and the reports.
//!
//! Four binaries use them: `walship-compare` (`src/main.rs`, walship against
//! JetStream and PostgreSQL), `walship-memory` (`src/bin/walship-memory.rs`,
//! a node's resident memory per retained record and single-record read
//! latency; see [`memory`]), `walship-rebuild`
//! (`src/bin/walship-rebuild.rs`, re-seeding a replica from the archive
//! against `pg_basebackup` and a JetStream replica's catch-up; see
//! [`rebuild`] and [`nats_rebuild`]) and `walship-history`
//! (`src/bin/walship-history.rs`, acknowledged records of a sample of
//! shards checked on every node after a failover under load; see
//! [`history`]). `ops/bench/README.md`
//! describes them.

pub mod chart;
pub mod failover;
pub mod history;
pub mod load;
pub mod memory;
pub mod nats;
pub mod nats_rebuild;
pub mod pg;
pub mod proc;
pub mod rebuild;
pub mod report;
pub mod system;
pub mod walship;
