//! The WAL's producer sessions and conditional appends: deduplication
//! through restarts, truncations and compactions, and refusals that write
//! nothing.

use super::*;
use crate::{EngineStore, MemStore};

fn records(n: usize) -> Vec<NewRecord> {
    (0..n).map(|i| NewRecord { key: Bytes::new(), payload: Bytes::from(format!("p{i}")) }).collect()
}

fn as_producer(id: u64, epoch: u64, sequence: u64) -> AppendOptions {
    AppendOptions { producer: Some(ProducerStamp { id, epoch, sequence }), ..AppendOptions::default() }
}

fn config() -> WalConfig {
    // A snapshot every ~1 KiB of frames, so small tests cross several.
    WalConfig { scrub_bytes_per_s: 0, producer_snapshot_bytes: 1024, ..WalConfig::default() }
}

fn start(store: Arc<dyn LogStore>) -> Wal {
    let wal = Wal::start(store, config(), WalMetrics::unregistered()).unwrap();
    wal.create_shard(1).unwrap();
    wal
}

async fn produce(wal: &Wal, id: u64, sequence: u64, n: usize) -> AppendOutcome {
    wal.append_with(1, 1, records(n), as_producer(id, 1, sequence)).await.unwrap()
}

fn last(wal: &Wal) -> u64 {
    wal.positions(1).unwrap().last_seqno
}

#[tokio::test]
async fn a_retry_answers_the_original_seqnos_and_writes_nothing() {
    let wal = start(Arc::new(MemStore::new()));
    let first = produce(&wal, 7, 1, 3).await;
    assert_eq!((first.appended, first.duplicate), (Appended { first_seqno: 1, last_seqno: 3 }, false));
    wal.append(1, 1, records(2)).await.unwrap();
    let retry = produce(&wal, 7, 1, 3).await;
    assert_eq!((retry.appended, retry.duplicate), (Appended { first_seqno: 1, last_seqno: 3 }, true));
    assert_eq!(last(&wal), 5, "the retry wrote nothing");
    let next = produce(&wal, 7, 4, 1).await;
    assert_eq!((next.appended.first_seqno, next.duplicate), (6, false));
    let frames = wal.read(1, 1, 6, usize::MAX).await.unwrap();
    let stamps: Vec<_> = frames.iter().map(|f| f.producer().map(|p| p.sequence)).collect();
    assert_eq!(stamps, vec![Some(1), Some(2), Some(3), None, None, Some(4)]);
}

#[tokio::test]
async fn refused_producer_appends_write_nothing() {
    let wal = start(Arc::new(MemStore::new()));
    produce(&wal, 7, 1, 2).await;
    wal.append_with(1, 1, records(1), as_producer(7, 2, 1)).await.unwrap(); // epoch 2 takes over
    let refused = [
        (as_producer(7, 1, 3), "fenced"),
        (as_producer(7, 2, 5), "gap"),
        (as_producer(8, 1, 4), "unknown"),
        (as_producer(0, 1, 1), "invalid"),
        (as_producer(9, 0, 1), "invalid"),
        (as_producer(9, 1, 0), "invalid"),
        (as_producer(9, 1, u64::MAX), "invalid"),
    ];
    for (options, reason) in refused {
        let err = wal.append_with(1, 1, records(2), options).await.unwrap_err();
        let got = match &err {
            WalError::Producer { refusal: ProducerRefusal::Fenced { .. }, .. } => "fenced",
            WalError::Producer { refusal: ProducerRefusal::Gap { .. }, .. } => "gap",
            WalError::Producer { refusal: ProducerRefusal::Unknown { .. }, .. } => "unknown",
            WalError::Producer { refusal: ProducerRefusal::Invalid(_), .. } => "invalid",
            other => panic!("{options:?}: {other}"),
        };
        assert_eq!(got, reason, "{options:?}: {err}");
    }
    assert_eq!(last(&wal), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_racing_conditional_appends_exactly_one_wins() {
    let wal = start(Arc::new(MemStore::new()));
    wal.append(1, 1, records(4)).await.unwrap();
    let mut racers = Vec::new();
    for _ in 0..16 {
        let wal = wal.clone();
        racers.push(tokio::spawn(async move {
            let options = AppendOptions { expected_last: Some(4), ..AppendOptions::default() };
            wal.append_with(1, 1, records(1), options).await
        }));
    }
    let mut won = 0;
    for racer in racers {
        match racer.await.unwrap() {
            Ok(outcome) => {
                won += 1;
                assert_eq!(outcome.appended.first_seqno, 5);
            }
            Err(WalError::ExpectedLast { expected: 4, last: 5, .. }) => {}
            Err(other) => panic!("{other}"),
        }
    }
    assert_eq!((won, last(&wal)), (1, 5));
    let empty = AppendOptions { expected_last: Some(0), ..AppendOptions::default() };
    wal.create_shard(2).unwrap();
    assert!(wal.append_with(2, 1, records(1), empty).await.is_ok(), "0 expects an empty shard");
}

#[tokio::test]
async fn a_conditional_retry_of_a_producer_is_a_duplicate_not_a_mismatch() {
    let wal = start(Arc::new(MemStore::new()));
    let options = AppendOptions { expected_last: Some(0), ..as_producer(7, 1, 1) };
    wal.append_with(1, 1, records(1), options).await.unwrap();
    let retry = wal.append_with(1, 1, records(1), options).await.unwrap();
    assert!(retry.duplicate);
    assert_eq!(retry.appended.first_seqno, 1);
}

#[tokio::test]
async fn a_conditional_retry_of_a_cut_batch_writes_the_rest() {
    let wal = start(Arc::new(MemStore::new()));
    // The first attempt of a 4-record batch expecting an empty shard: a
    // failover left its first 2 records in the log, and others wrote after.
    wal.append_with(1, 1, records(2), AppendOptions { expected_last: Some(0), ..as_producer(7, 1, 1) }).await.unwrap();
    wal.append(1, 1, records(1)).await.unwrap();
    // A retry whose condition did not hold where the prefix went is refused.
    let wrong = AppendOptions { expected_last: Some(1), ..as_producer(7, 1, 1) };
    let refused = wal.append_with(1, 1, records(4), wrong).await.unwrap_err();
    assert!(matches!(refused, WalError::ExpectedLast { expected: 1, last: 3, .. }), "{refused}");
    assert_eq!(last(&wal), 3, "a refused retry writes nothing");
    // The same retry as first sent: the rest is written, and the answer
    // starts at the prefix (before, it was refused as a mismatch though
    // its prefix was in the log).
    let options = AppendOptions { expected_last: Some(0), ..as_producer(7, 1, 1) };
    let retry = wal.append_with(1, 1, records(4), options).await.unwrap();
    assert_eq!((retry.appended, retry.duplicate), (Appended { first_seqno: 1, last_seqno: 5 }, false));
    let frames = wal.read(1, 1, 5, usize::MAX).await.unwrap();
    let stamps: Vec<_> = frames.iter().map(|f| f.producer().map(|p| p.sequence)).collect();
    assert_eq!(stamps, vec![Some(1), Some(2), None, Some(3), Some(4)]);
}

/// Writes producer 7's sequences 1..=40 in batches of 4 between other
/// producers' and plain records, crossing several snapshots; returns where
/// its last batch went.
async fn busy_log(wal: &Wal) -> Appended {
    let mut last = None;
    for batch in 0..10u64 {
        last = Some(produce(wal, 7, 1 + batch * 4, 4).await.appended);
        produce(wal, 100 + batch, 1, 2).await;
        wal.append(1, 1, records(3)).await.unwrap();
    }
    last.expect("ten batches")
}

/// A retry of producer 7's last batch answers where it went, and its next
/// sequence is 41.
async fn producer_7_is_remembered(wal: &Wal, last_batch: Appended) {
    let retry = produce(wal, 7, 37, 4).await;
    assert!(retry.duplicate, "{retry:?}");
    assert_eq!(retry.appended, last_batch);
    assert!(matches!(
        wal.append_with(1, 1, records(1), as_producer(7, 1, 42)).await,
        Err(WalError::Producer { refusal: ProducerRefusal::Gap { expected: 41, .. }, .. })
    ));
}

#[tokio::test]
async fn the_table_survives_a_crash_and_a_restart() {
    let store = Arc::new(MemStore::new());
    let wal = start(store.clone());
    let batch = busy_log(&wal).await;
    assert!(wal.producer_stats(1, now_us()).unwrap().snapshots >= 2, "the test must cross snapshots");
    drop(wal);
    store.crash();
    let wal = start(store);
    producer_7_is_remembered(&wal, batch).await;
    assert_eq!(wal.producer_stats(1, now_us()).unwrap().producers, 11);
}

#[tokio::test]
async fn the_table_survives_compaction_past_the_producers_writes() {
    let store = Arc::new(MemStore::new());
    let wal = start(store.clone());
    let batch = busy_log(&wal).await;
    // Plain records after the producers, past a snapshot.
    for _ in 0..20 {
        wal.append(1, 1, records(10)).await.unwrap();
    }
    let last = last(&wal);
    let first = wal.compact_prefix(1, last + 1).await.unwrap();
    assert!(first > batch.last_seqno + 1, "compaction went past the producers' records (first {first})");
    assert!(first <= last + 1);
    assert_eq!(wal.positions(1).unwrap().first_seqno, first);
    producer_7_is_remembered(&wal, batch).await;
    drop(wal);
    store.crash();
    let wal = start(store);
    producer_7_is_remembered(&wal, batch).await;
}

#[tokio::test]
async fn a_truncation_forgets_what_it_removed() {
    let wal = start(Arc::new(MemStore::new()));
    busy_log(&wal).await;
    let before = last(&wal);
    produce(&wal, 7, 41, 2).await;
    // Divergence repair: the two records of sequences 41..=42 go.
    wal.truncate_suffix(1, before).await.unwrap();
    let again = produce(&wal, 7, 41, 2).await;
    assert!(!again.duplicate, "the truncated records are not in the log, so they are written again");
    assert_eq!(again.appended.first_seqno, before + 1);
    // Deeper than every snapshot but the first.
    wal.truncate_suffix(1, 3).await.unwrap();
    // Sequences 1..=3 survived: a retry of the batch writes only the 4th,
    // and answers from the first.
    let retry = produce(&wal, 7, 1, 4).await;
    assert_eq!((retry.appended, retry.duplicate), (Appended { first_seqno: 1, last_seqno: 4 }, false));
    assert_eq!(last(&wal), 4);
    let frames = wal.read(1, 1, 4, usize::MAX).await.unwrap();
    assert_eq!(frames.iter().map(|f| f.producer().unwrap().sequence).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
}

#[tokio::test]
async fn a_follower_builds_the_same_table_from_shipped_frames() {
    let leader = start(Arc::new(MemStore::new()));
    let batch = busy_log(&leader).await;
    let follower = start(Arc::new(MemStore::new()));
    let frames = leader.read(1, 1, last(&leader), usize::MAX).await.unwrap();
    for chunk in frames.chunks(7) {
        follower.append_frames(1, chunk.to_vec()).await.unwrap();
    }
    producer_7_is_remembered(&follower, batch).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_store_keeps_snapshots_across_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let batch = {
        let wal = start(Arc::new(EngineStore::open(dir.path(), &Default::default()).unwrap()));
        let batch = busy_log(&wal).await;
        for _ in 0..20 {
            wal.append(1, 1, records(10)).await.unwrap();
        }
        let first = wal.compact_prefix(1, last(&wal) + 1).await.unwrap();
        assert!(first > batch.last_seqno + 1, "first {first}");
        batch
    };
    // The persister thread closes the store once the last handle is gone.
    let mut tries = 0;
    let store = loop {
        match EngineStore::open(dir.path(), &Default::default()) {
            Ok(store) => break Arc::new(store),
            Err(e) if tries == 500 => panic!("the store stayed open for 10 s: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
        tries += 1;
    };
    let snapshots = store.producer_snapshots(1).unwrap();
    assert!(!snapshots.is_empty());
    let wal = start(store);
    producer_7_is_remembered(&wal, batch).await;
}

#[tokio::test]
async fn a_corrupt_snapshot_refuses_producer_appends_and_nothing_else() {
    let store = Arc::new(MemStore::new());
    let wal = start(store.clone());
    busy_log(&wal).await;
    let (seqno, _) = store.producer_snapshots(1).unwrap().pop().unwrap();
    let garbage =
        SnapshotChanges { put: vec![(1, seqno, Bytes::from_static(b"WSPT\x01garbage garbage garbage"))], drop: vec![] };
    store.append_with_snapshots(&[], &garbage, true).unwrap();
    drop(wal);
    let wal = start(store);
    assert!(matches!(
        wal.append_with(1, 1, records(1), as_producer(7, 1, 41)).await,
        Err(WalError::ProducersUnavailable { .. })
    ));
    assert!(wal.producer_stats(1, now_us()).unwrap().damaged.is_some());
    wal.append(1, 1, records(1)).await.unwrap();
}

#[tokio::test]
async fn a_small_log_compacts_exactly_by_rebuilding_the_table_where_it_cuts() {
    // Snapshots every 16 MiB: this log only has the one before its first
    // stamped record, so stopping at a snapshot would compact nothing.
    let store = Arc::new(MemStore::new());
    let wal = Wal::start(
        store.clone(),
        WalConfig { scrub_bytes_per_s: 0, ..WalConfig::default() },
        WalMetrics::unregistered(),
    )
    .unwrap();
    wal.create_shard(1).unwrap();
    let batch = busy_log(&wal).await;
    let cut = batch.last_seqno + 2;
    assert_eq!(wal.compact_prefix(1, cut).await.unwrap(), cut, "compacted exactly where asked");
    producer_7_is_remembered(&wal, batch).await;
    for _ in 0..5 {
        wal.append(1, 1, records(3)).await.unwrap();
    }
    let again = last(&wal) - 2;
    assert_eq!(wal.compact_prefix(1, again).await.unwrap(), again);
    drop(wal);
    store.crash();
    let wal = Wal::start(
        store.clone(),
        WalConfig { scrub_bytes_per_s: 0, ..WalConfig::default() },
        WalMetrics::unregistered(),
    )
    .unwrap();
    producer_7_is_remembered(&wal, batch).await;
    assert_eq!(store.producer_snapshots(1).unwrap().len(), 1, "older snapshots go with the records they cover");
}
