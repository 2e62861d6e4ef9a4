//! The `testing` feature's storage failpoints on a real raft-engine store,
//! and what raft-engine makes of them: an injected write failure comes back
//! as a fatal error, an injected sync failure as a panic. The WAL ends the
//! process on both (`wal.rs`); that a panic does so on a real node process
//! is `tests/storage_failure.rs`'s part, since an abort cannot be tested in
//! process. One test function in its own binary: failpoints are global to
//! the process, and no other test may meet them.

#![cfg(feature = "testing")]

use walship_wal::{EngineStore, Frame, LogStore, RecordFields, ShardAppend};

fn append(seqno: u64) -> Vec<ShardAppend> {
    let frame = Frame::encode(RecordFields { seqno, epoch: 1, timestamp_us: 0, key: b"k", payload: b"payload" });
    vec![ShardAppend { shard: 1, frames: vec![frame] }]
}

#[test]
fn an_injected_write_failure_is_a_fatal_error_and_a_sync_failure_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    store.create_shard(1).unwrap();
    store.append(&append(1), true).unwrap();

    fail::cfg("wal::write", "return").unwrap();
    let failed = store.append(&append(2), true);
    fail::remove("wal::write");
    let error = failed.expect_err("the injected write failure");
    assert!(error.is_fatal(), "a failed write must be fatal to the WAL: {error}");
    assert_eq!(store.bounds(1).unwrap().last_seqno, 1, "the failed append changed nothing");

    fail::cfg("wal::sync", "return").unwrap();
    let synced = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.append(&append(2), true)));
    fail::remove("wal::sync");
    assert!(
        synced.is_err(),
        "raft-engine no longer panics on a failed sync ({synced:?}): revisit how the WAL ends the process"
    );
}
