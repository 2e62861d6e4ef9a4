//! The benchmark harnesses' shared parts: the systems under test (three
//! `walship node`s and a coordinator, NATS JetStream R3, PostgreSQL with two
//! synchronous standbys), child processes that never outlive the harness,
//! the load drivers, and the reports.
//!
//! Two binaries use them: `walship-compare` (`src/main.rs`, walship against
//! JetStream and PostgreSQL) and `walship-memory` (`src/bin/walship-memory.rs`,
//! a node's resident memory per retained record and single-record read
//! latency; see [`memory`]). `ops/bench/README.md` describes both.

pub mod chart;
pub mod failover;
pub mod load;
pub mod memory;
pub mod nats;
pub mod pg;
pub mod proc;
pub mod report;
pub mod system;
pub mod walship;
