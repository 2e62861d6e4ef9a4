//! Unit tests of the raft-engine store: damage located to shard, seqnos and file, the start-up tail check, torn tails.

use std::path::Path;
use std::sync::Arc;

use super::*;
use crate::corruption::Detection;
use crate::record::RecordFields;
use crate::{Wal, WalConfig, WalError, WalMetrics};

/// Record `seqno`'s payload: a pattern found once in the log file.
fn payload(seqno: u64) -> Vec<u8> {
    format!("payload-{seqno:04}-").repeat(16).into_bytes()
}

fn frame(seqno: u64) -> Frame {
    Frame::encode(RecordFields { seqno, epoch: 1, timestamp_us: seqno, key: b"k", payload: &payload(seqno) })
}

/// Appends `from..=to` to `shard`, one batch (one raft-engine checksum)
/// per record.
fn append(store: &EngineStore, shard: ShardId, from: u64, to: u64) {
    for seqno in from..=to {
        store.append(&[ShardAppend { shard, frames: vec![frame(seqno)] }], true).unwrap();
    }
}

fn only_log_file(dir: &Path) -> PathBuf {
    let files = log_files(dir, ".raftlog");
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].1.clone()
}

/// Flips 4 bytes at `delta` from the start of record `seqno`'s payload
/// in the log file.
fn flip(file: &Path, seqno: u64, delta: usize) {
    let mut bytes = std::fs::read(file).unwrap();
    let pattern = payload(seqno);
    let at = bytes.windows(pattern.len()).position(|w| w == pattern.as_slice()).expect("payload in the file");
    for b in &mut bytes[at + delta..at + delta + 4] {
        *b ^= 0x5a;
    }
    std::fs::write(file, bytes).unwrap();
}

fn no_scrub() -> WalConfig {
    WalConfig { scrub_bytes_per_s: 0, ..WalConfig::default() }
}

fn seqnos(frames: &[Frame]) -> Vec<u64> {
    frames.iter().map(Frame::seqno).collect()
}

/// A byte flip in the middle of a record after a crash: the start-up
/// check names shard, seqno and file; reads before it work; a read of
/// it is a typed, non-fatal corrupt error; truncating it away clears it
/// and appends continue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_check_finds_a_flipped_record_and_a_truncation_repairs_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    store.create_shard(1).unwrap();
    store.create_shard(2).unwrap();
    append(&store, 1, 1, 30);
    append(&store, 2, 1, 5);
    drop(store); // No clean-shutdown marker: as after a kill -9.
    let file = only_log_file(dir.path());
    flip(&file, 17, 100);

    let store = Arc::new(EngineStore::open(dir.path(), &Default::default()).unwrap());
    let metrics = WalMetrics::unregistered();
    let wal = Wal::start(store.clone(), no_scrub(), metrics.clone()).unwrap();
    let found = wal.corruption();
    assert_eq!(found.len(), 1, "{found:?}");
    let range = &found[0];
    assert_eq!((range.shard, range.first_bad_seqno, range.last_bad_seqno), (1, 17, 17));
    assert_eq!(range.file.as_deref(), Some(file.as_path()));
    assert_eq!(range.how, Detection::Startup);
    assert!(range.detail.contains("Checksum"), "{}", range.detail);
    assert_eq!(metrics.corrupt_records.with_label_values(&["1"]).get(), 1);
    assert_eq!(metrics.corruption_detected.with_label_values(&["startup"]).get(), 1);
    assert!(wal.shard_corruption(2).is_empty());

    // Reads before the damage (and of the other shard) work.
    assert_eq!(seqnos(&wal.read(1, 1, 16, usize::MAX).await.unwrap()), (1..=16).collect::<Vec<_>>());
    assert_eq!(seqnos(&wal.read(2, 1, 5, usize::MAX).await.unwrap()), vec![1, 2, 3, 4, 5]);
    // A read covering it is the typed corrupt error, not Io, not fatal.
    let err = wal.read(1, 10, 30, usize::MAX).await.unwrap_err();
    assert_eq!(err.corrupt_range(), Some((1, 17, 17)), "{err:?}");
    let WalError::Store(store_err) = &err else { panic!("{err:?}") };
    assert!(!store_err.is_fatal());
    let message = err.to_string();
    assert!(message.contains("corruption") && message.contains(&file.display().to_string()), "{message}");
    // Found again by a read and by a scrub: still one range, counted once.
    let report = wal.scrub_now().await.unwrap();
    assert_eq!((report.records, report.new_ranges), (29 + 5, 0));
    assert_eq!(wal.corruption().len(), 1);
    assert_eq!(metrics.corruption_detected.with_label_values(&["read"]).get(), 0);

    // Repair: truncate to first_bad - 1, append the replica's copy.
    wal.truncate_suffix(1, 16).await.unwrap();
    assert!(wal.corruption().is_empty());
    assert_eq!(metrics.corrupt_records.with_label_values(&["1"]).get(), 0);
    wal.append_frames(1, (17..=31).map(frame).collect()).await.unwrap();
    assert_eq!(seqnos(&store.read(1, 1, 31, usize::MAX).unwrap()), (1..=31).collect::<Vec<_>>());
}

/// After a clean shutdown the start-up check is skipped (and the marker
/// is consumed); the scrubber finds the damage, and a read in the
/// middle of it is typed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_clean_shutdown_the_scrubber_finds_the_damage() {
    let dir = tempfile::tempdir().unwrap();
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    store.create_shard(3).unwrap();
    append(&store, 3, 1, 20);
    store.mark_clean_shutdown().unwrap();
    drop(store);
    assert!(dir.path().join(CLEAN_SHUTDOWN_FILE).exists());
    let file = only_log_file(dir.path());
    flip(&file, 8, 64);

    let store = Arc::new(EngineStore::open(dir.path(), &Default::default()).unwrap());
    assert!(!dir.path().join(CLEAN_SHUTDOWN_FILE).exists(), "an open consumes the marker");
    assert!(store.startup_damage().is_empty(), "no tail check after a clean shutdown");
    let metrics = WalMetrics::unregistered();
    let wal = Wal::start(store, no_scrub(), metrics.clone()).unwrap();
    assert!(wal.corruption().is_empty());
    let report = wal.scrub_now().await.unwrap();
    assert_eq!((report.records, report.new_ranges), (19, 1));
    let range = &wal.corruption()[0];
    assert_eq!((range.shard, range.first_bad_seqno, range.last_bad_seqno, range.how), (3, 8, 8, Detection::Scrub));
    assert_eq!(range.file.as_deref(), Some(file.as_path()));
    assert_eq!(metrics.scrubbed_bytes.get(), 19 * frame(1).len() as u64);
    assert!(metrics.scrub_last_pass.get() > 0);
    assert_eq!(wal.read(3, 8, 8, 1).await.unwrap_err().corrupt_range(), Some((3, 8, 8)));
    // Compacting past it clears it too.
    wal.compact_prefix(3, 9).await.unwrap();
    assert!(wal.corruption().is_empty());
    assert_eq!(seqnos(&wal.read(3, 9, 20, usize::MAX).await.unwrap()), (9..=20).collect::<Vec<_>>());
}

fn prefilled() -> EngineStoreConfig {
    EngineStoreConfig { target_file_bytes: 4 << 20, prefill: true, ..Default::default() }
}

/// A crash leaves the zeros behind the last batch: raft-engine's
/// recovery cuts them, which is a torn tail, not corruption; the tail
/// check finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_copy_reports_a_torn_tail_and_no_corruption() {
    let _ = crate::recovery_log::install();
    let dir = tempfile::tempdir().unwrap();
    let store = EngineStore::open(dir.path(), &prefilled()).unwrap();
    store.create_shard(1).unwrap();
    append(&store, 1, 1, 40);
    let copy = crate::conformance::crash_copy(dir.path());
    drop(store);

    let crashed = Arc::new(EngineStore::open(copy.path(), &prefilled()).unwrap());
    let findings = crashed.recovery_findings().to_vec();
    assert!(matches!(findings.as_slice(), [RecoveryFinding::TornTail { .. }]), "{findings:?}");
    assert!(crashed.startup_damage().is_empty());
    let wal = Wal::start(crashed, no_scrub(), WalMetrics::unregistered()).unwrap();
    assert!(wal.corruption().is_empty());
    assert_eq!(seqnos(&wal.read(1, 1, 40, usize::MAX).await.unwrap()), (1..=40).collect::<Vec<_>>());
    let report = wal.scrub_now().await.unwrap();
    assert_eq!((report.records, report.new_ranges), (40, 0));
}

/// A node exits after its clean shutdown without dropping raft-engine's
/// `Engine`, so its newest log file goes on past the written end (the zeros
/// of `fallocate`, or of a prefill): a copy of the files then is what the
/// next start finds. Recovery's cut at the end the marker recorded is not
/// corruption, with either layout, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_leaves_no_corruption_behind_the_end_of_the_log() {
    let _ = crate::recovery_log::install();
    for config in [EngineStoreConfig::default(), prefilled()] {
        let dir = tempfile::tempdir().unwrap();
        let store = EngineStore::open(dir.path(), &config).unwrap();
        store.create_shard(1).unwrap();
        append(&store, 1, 1, 30);
        store.mark_clean_shutdown().unwrap();
        let exited = crate::conformance::crash_copy(dir.path());
        drop(store);
        let marker = std::fs::read_to_string(exited.path().join(CLEAN_SHUTDOWN_FILE)).unwrap();
        let end = CleanEnd::parse(&marker).expect("the end recorded");
        let file = only_log_file(exited.path());
        assert_eq!(end.file, file.file_name().unwrap().to_str().unwrap());
        assert!(std::fs::metadata(&file).unwrap().len() > end.end, "space behind the end ({config:?})");

        let store = Arc::new(EngineStore::open(exited.path(), &config).unwrap());
        let findings = store.recovery_findings().to_vec();
        assert!(
            matches!(findings.as_slice(), [RecoveryFinding::CleanEnd { offset, .. }] if *offset == end.end),
            "{findings:?}"
        );
        assert!(store.recovery_cuts().is_empty());
        let wal = Wal::start(store, no_scrub(), WalMetrics::unregistered()).unwrap();
        assert!(wal.corruption().is_empty());
        assert!(!wal.recovery_cut());
        assert_eq!(seqnos(&wal.read(1, 1, 30, usize::MAX).await.unwrap()), (1..=30).collect::<Vec<_>>());
    }
}

/// Behind a clean shutdown's recorded end, the cut must be exactly there:
/// a synced batch lost from the end of the log (its bytes zeros now) is
/// corruption, although nothing but zeros follows the cut. A marker of an
/// earlier build, which records no end, takes a cut followed by zeros for
/// the end of the log.
#[test]
fn a_clean_log_cut_before_its_recorded_end_is_corruption() {
    let _ = crate::recovery_log::install();
    let dir = tempfile::tempdir().unwrap();
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    store.create_shard(1).unwrap();
    append(&store, 1, 1, 30);
    store.mark_clean_shutdown().unwrap();
    let lost_write = crate::conformance::crash_copy(dir.path());
    let old_marker = crate::conformance::crash_copy(dir.path());
    drop(store);

    let marker = std::fs::read_to_string(lost_write.path().join(CLEAN_SHUTDOWN_FILE)).unwrap();
    let end = CleanEnd::parse(&marker).unwrap();
    let file = only_log_file(lost_write.path());
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[end.end as usize - 8..end.end as usize].fill(0);
    std::fs::write(&file, bytes).unwrap();
    let store = EngineStore::open(lost_write.path(), &Default::default()).unwrap();
    let findings = store.recovery_findings().to_vec();
    assert!(
        matches!(findings.as_slice(), [RecoveryFinding::Corruption { offset, .. }] if *offset < end.end),
        "{findings:?}"
    );
    assert_eq!(store.bounds(1).unwrap().last_seqno, 29, "the last batch is gone");

    std::fs::write(old_marker.path().join(CLEAN_SHUTDOWN_FILE), "clean\n").unwrap();
    let store = EngineStore::open(old_marker.path(), &Default::default()).unwrap();
    let findings = store.recovery_findings().to_vec();
    assert!(matches!(findings.as_slice(), [RecoveryFinding::CleanEnd { .. }]), "{findings:?}");
    assert_eq!(store.bounds(1).unwrap().last_seqno, 30);
}

/// Compaction purges log files and later rotations recycle them with their
/// earlier bytes in place, behind the new life's end. A crash then leaves
/// those behind the last batch: a torn tail, not corruption (every crash of
/// a node that had purged files was reported as corruption). A batch of
/// this life dropped behind a damaged one is still corruption.
#[test]
fn a_crash_in_a_recycled_log_file_is_a_torn_tail() {
    let _ = crate::recovery_log::install();
    let dir = tempfile::tempdir().unwrap();
    let config = EngineStoreConfig {
        target_file_bytes: 64 << 10,
        prefill: true,
        spare_bytes: 512 << 10,
        purge_threshold_bytes: 256 << 10,
        ..Default::default()
    };
    let store = EngineStore::open(dir.path(), &config).unwrap();
    store.create_shard(1).unwrap();
    let mut next = 1;
    while log_files(dir.path(), ".raftlog")[0].0 < 3 {
        append(&store, 1, next, next + 99);
        next += 100;
        store.compact_prefix(1, next - 20).unwrap();
        assert!(next < 20_000, "nothing purged: {:?}", log_files(dir.path(), ".raftlog"));
    }
    // Into a file with an earlier life, part way.
    let recycled = log_files(dir.path(), ".raftlog").last().unwrap().1.clone();
    append(&store, 1, next, next + 4);
    let last = next + 4;
    let bytes = std::fs::read(&recycled).unwrap();
    assert!(bytes[bytes.len() / 2..].iter().any(|b| *b != 0), "the newest file holds an earlier life");
    let crashed = crate::conformance::crash_copy(dir.path());
    let damaged = crate::conformance::crash_copy(dir.path());
    drop(store);

    let store = EngineStore::open(crashed.path(), &config).unwrap();
    let findings = store.recovery_findings().to_vec();
    assert!(findings.iter().all(|f| matches!(f, RecoveryFinding::TornTail { .. })), "{findings:?}");
    assert!(store.recovery_cuts().is_empty());
    assert_eq!(store.bounds(1).unwrap().last_seqno, last);

    // The next-to-last record's payload damaged where raft-engine's recovery
    // checks it (its batch's items): the last batch, of this life, is dropped
    // behind it.
    flip(&log_files(damaged.path(), ".raftlog").last().unwrap().1, last - 1, payload(last - 1).len() + 4);
    let store = EngineStore::open(damaged.path(), &config).unwrap();
    let findings = store.recovery_findings().to_vec();
    assert!(findings.iter().any(|f| matches!(f, RecoveryFinding::Corruption { .. })), "{findings:?}");
}

/// Damage to a batch's metadata in a log file older than the newest is
/// damage recovery cannot cut away (newer files continue the same shards):
/// the open fails, naming the file and the offset of the batch.
#[test]
fn an_older_files_damaged_batch_fails_the_open_naming_file_and_offset() {
    let _ = crate::recovery_log::install();
    let dir = tempfile::tempdir().unwrap();
    let config = EngineStoreConfig { target_file_bytes: 16 << 10, ..Default::default() };
    let store = EngineStore::open(dir.path(), &config).unwrap();
    store.create_shard(1).unwrap();
    append(&store, 1, 1, 100);
    drop(store);
    let files = log_files(dir.path(), ".raftlog");
    assert!(files.len() >= 3, "{files:?}");
    flip(&files[0].1, 5, payload(5).len() + 4);
    let Err(error) = EngineStore::open(dir.path(), &config) else { panic!("opened a log it cannot read") };
    let error = error.to_string();
    let named = format!("{} is damaged at offset ", files[0].1.display());
    assert!(error.contains(&named), "{error}");
    let offset: u64 = error[error.find(&named).unwrap() + named.len()..].split(',').next().unwrap().parse().unwrap();
    assert!(offset > 0, "{error}");
}

/// Damage to a batch's metadata in the newest file makes raft-engine's
/// recovery drop the rest of the file: that is reported as corruption
/// (data follows the cut), never as a torn tail.
#[test]
fn a_damaged_batch_followed_by_data_is_corruption_not_a_torn_tail() {
    let _ = crate::recovery_log::install();
    let dir = tempfile::tempdir().unwrap();
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    store.create_shard(1).unwrap();
    append(&store, 1, 1, 30);
    drop(store);
    // Past the payload (the end of the entry) come the entry block's
    // checksum (4 bytes) and the batch's item metadata.
    flip(&only_log_file(dir.path()), 12, payload(12).len() + 4);
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    let findings = store.recovery_findings().to_vec();
    assert!(matches!(findings.as_slice(), [RecoveryFinding::Corruption { .. }]), "{findings:?}");
    assert_eq!(store.bounds(1).unwrap().last_seqno, 11, "raft-engine dropped the rest of the file");
}

#[test]
fn locate_names_the_file_of_an_entry_across_rotations() {
    let dir = tempfile::tempdir().unwrap();
    // Each 20 KiB record is a sealed chunk of its own (none is merged and
    // rewritten into a later file).
    let config = EngineStoreConfig { target_file_bytes: 64 << 10, chunk_bytes: 1 << 10, ..Default::default() };
    let store = EngineStore::open(dir.path(), &config).unwrap();
    store.create_shard(1).unwrap();
    let big = |seqno: u64| {
        let payload = vec![seqno as u8; 20 << 10];
        Frame::encode(RecordFields { seqno, epoch: 1, timestamp_us: 0, key: b"", payload: &payload })
    };
    for seqno in 1..=12 {
        store.append(&[ShardAppend { shard: 1, frames: vec![big(seqno)] }], true).unwrap();
    }
    let files = log_files(dir.path(), ".raftlog");
    assert!(files.len() >= 3, "{files:?}");
    assert_eq!(store.locate(1, 1), Some(files[0].1.clone()));
    assert_eq!(store.locate(1, 12), Some(files.last().unwrap().1.clone()));
    assert_eq!(store.locate(1, 13), None);
    assert_eq!(store.locate(2, 1), None);
}

/// A shard created to start at seqno 100 (a restore of an archive that
/// starts there) takes 100 first, refuses anything else, keeps its start
/// across a reopen and reads back; creating it twice, or at 0, is refused.
#[test]
fn a_shard_can_start_past_seqno_one_and_keeps_its_start_across_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    assert!(store.create_shard_at(5, 0).is_err());
    store.create_shard_at(5, 100).unwrap();
    assert!(store.create_shard_at(5, 100).is_err(), "created twice");
    assert_eq!(store.bounds(5).unwrap(), LogBounds { first_seqno: 100, last_seqno: 99, durable_seqno: 99 });
    assert!(store.append(&[ShardAppend { shard: 5, frames: vec![frame(1)] }], true).is_err(), "seqno 1 taken");
    append(&store, 5, 100, 110);
    store.mark_clean_shutdown().unwrap();
    drop(store);
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    assert_eq!(store.bounds(5).unwrap(), LogBounds { first_seqno: 100, last_seqno: 110, durable_seqno: 110 });
    assert_eq!(seqnos(&store.read(5, 100, 110, usize::MAX).unwrap()), (100..=110).collect::<Vec<_>>());
    append(&store, 5, 111, 111);
    assert_eq!(store.bounds(5).unwrap().last_seqno, 111);
}

/// An append without a sync leaves its shard's records written, not
/// durable; the next synced append, to any shard, makes them durable, and
/// only the shards written since are touched (a sync no longer walks every
/// shard).
#[test]
fn a_sync_makes_every_shard_appended_without_one_durable() {
    let dir = tempfile::tempdir().unwrap();
    let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
    for shard in [1, 2, 3] {
        store.create_shard(shard).unwrap();
    }
    store.append(&[ShardAppend { shard: 1, frames: vec![frame(1), frame(2)] }], false).unwrap();
    store.append(&[ShardAppend { shard: 2, frames: vec![frame(1)] }], false).unwrap();
    let durable = |shard| store.bounds(shard).map(|b| (b.last_seqno, b.durable_seqno)).unwrap();
    assert_eq!((durable(1), durable(2)), ((2, 0), (1, 0)), "written, not durable");
    store.append(&[ShardAppend { shard: 3, frames: vec![frame(1)] }], true).unwrap();
    assert_eq!((durable(1), durable(2), durable(3)), ((2, 2), (1, 1), (1, 1)), "one sync covers them all");
    store.append(&[ShardAppend { shard: 1, frames: vec![frame(3)] }], false).unwrap();
    store.append(&[ShardAppend { shard: 1, frames: vec![frame(4)] }], true).unwrap();
    assert_eq!(durable(1), (4, 4));
}
