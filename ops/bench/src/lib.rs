//! The benchmark harness's parts: the systems under test (three
//! `walship node`s and a coordinator, NATS JetStream R3, PostgreSQL with two
//! synchronous standbys), child processes that never outlive the harness,
//! the load drivers, and the reports. A library so that more than one
//! binary can share them; `walship-compare` is `src/main.rs`.

pub mod chart;
pub mod failover;
pub mod load;
pub mod nats;
pub mod pg;
pub mod proc;
pub mod report;
pub mod system;
pub mod walship;
