//! Unit tests of the raft-engine store's chunks: the index stays small,
//! merges and splits keep every record, a torn chunk write (a merge
//! included) loses only itself, damage is reported per chunk and repaired,
//! and stores written one entry per record convert on open.

use std::path::Path;
use std::sync::atomic::Ordering;

use super::*;
use crate::chunk::CHUNK_INDEX_BYTES;
use crate::record::RecordFields;

fn frame(seqno: u64, epoch: u64, payload_len: usize) -> Frame {
    let payload = format!("{seqno:08}-").repeat(payload_len / 9 + 1);
    Frame::encode(RecordFields {
        seqno,
        epoch,
        timestamp_us: seqno,
        key: b"k",
        payload: &payload.as_bytes()[..payload_len],
    })
}

fn frames(from: u64, to: u64, payload_len: usize) -> Vec<Frame> {
    (from..=to).map(|s| frame(s, 1, payload_len)).collect()
}

fn append(store: &EngineStore, shard: ShardId, frames: Vec<Frame>) {
    store.append(&[ShardAppend { shard, frames }], true).unwrap();
}

fn all(store: &EngineStore, shard: ShardId) -> Vec<Frame> {
    let b = store.bounds(shard).unwrap();
    if b.is_empty() {
        return Vec::new();
    }
    store.read(shard, b.first_seqno, b.last_seqno, usize::MAX).unwrap()
}

fn open(dir: &Path, chunk_bytes: u64) -> EngineStore {
    EngineStore::open(dir, &EngineStoreConfig { chunk_bytes, ..Default::default() }).unwrap()
}

/// 20,000 records of 100 B in batches of 10 (a busy shard's group
/// commits) take a chunk per 64 KiB, not an entry per record.
#[test]
fn small_appends_merge_into_full_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    store.create_shard(1).unwrap();
    let mut want = Vec::new();
    for batch in 0..2_000u64 {
        let batch = frames(batch * 10 + 1, batch * 10 + 10, 100);
        want.extend(batch.iter().cloned());
        append(&store, 1, batch);
    }
    let bytes: usize = want.iter().map(Frame::len).sum();
    let full = bytes.div_ceil(DEFAULT_CHUNK_BYTES as usize);
    let chunks = store.chunk_count(1).unwrap();
    // Sealed chunks of about 64 KiB each, then the tail: the small chunks
    // of the commits since the last merge (a merge's remainder stays in it).
    let (sealed, tail) = {
        let shards = store.shards.lock();
        let chunks = &shards[&1].chunks;
        (chunks.len() - chunks.tail().1, chunks.tail().1)
    };
    let batch_bytes = want[..10].iter().map(Frame::len).sum::<usize>();
    assert!(sealed <= full && sealed + 1 >= full, "{sealed} sealed chunks for {bytes} bytes ({full} full)");
    assert!(tail <= DEFAULT_CHUNK_BYTES as usize / batch_bytes + 1, "{tail} tail chunks");
    assert_eq!(store.index_chunks(), chunks as u64);
    assert_eq!(store.index_bytes(), chunks as u64 * CHUNK_INDEX_BYTES);
    assert_eq!(all(&store, 1), want);
    drop(store);
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    assert_eq!(store.chunk_count(1).unwrap(), chunks, "the directory is rebuilt as it was");
    assert_eq!(all(&store, 1), want);
}

/// One record per append: the tail is merged into one unsealed chunk every
/// MAX_TAIL_CHUNKS appends, and sealed once full: the tail never holds
/// more than MAX_TAIL_CHUNKS chunks, and the sealed ones are full.
#[test]
fn one_record_appends_are_merged_by_count_and_sealed_full() {
    let dir = tempfile::tempdir().unwrap();
    let chunk_bytes = 16 << 10;
    let store = open(dir.path(), chunk_bytes);
    store.create_shard(1).unwrap();
    let one = frame(1, 1, 20).len();
    // Several count merges per sealed chunk.
    assert!(MAX_TAIL_CHUNKS * one * 2 < chunk_bytes as usize);
    let appends = (chunk_bytes as usize / one * 3 + 50) as u64;
    let mut most_tail = 0;
    for seqno in 1..=appends {
        append(&store, 1, frames(seqno, seqno, 20));
        most_tail = most_tail.max(store.shards.lock()[&1].chunks.tail().1);
    }
    assert!(most_tail <= MAX_TAIL_CHUNKS, "{most_tail} unsealed chunks at once");
    let shards = store.shards.lock();
    let chunks = &shards[&1].chunks;
    let sealed = chunks.len() - chunks.tail().1;
    assert_eq!(sealed, 3, "{} chunks, {} in the tail", chunks.len(), chunks.tail().1);
    for index in chunks.first_index()..chunks.first_index() + sealed as u64 {
        let bytes = chunks.get(index).unwrap().bytes as usize;
        assert!(bytes + one > chunk_bytes as usize && bytes <= chunk_bytes as usize, "chunk {index}: {bytes} B");
    }
    drop(shards);
    assert_eq!(all(&store, 1), frames(1, appends, 20));
}

/// The shards' known tails share one budget: with room for one shard's,
/// the others are read back at their merges, and every shard's log reads
/// the same as with room for all; the count follows what is held, down to
/// nothing once the tails are merged away or compacted.
#[test]
fn known_tails_stay_within_their_budget_and_the_rest_is_read_back() {
    let dir = tempfile::tempdir().unwrap();
    // Room for about one shard's tail of 1 KiB chunks.
    let config = EngineStoreConfig { chunk_bytes: 1 << 10, tail_frames_bytes: 1 << 10, ..Default::default() };
    let store = EngineStore::open(dir.path(), &config).unwrap();
    let shards = 1..=6u32;
    for shard in shards.clone() {
        store.create_shard(shard).unwrap();
    }
    // 200 one-record appends each (40 B payloads): the tails merge every
    // 1 KiB, most of them read back.
    for seqno in 1..=200u64 {
        for shard in shards.clone() {
            append(&store, shard, frames(seqno, seqno, 40));
            assert!(store.tail_frames.used.load(Ordering::Relaxed) <= 1 << 10);
        }
    }
    let known = store.shards.lock().values().filter(|s| s.tail.as_ref().is_some_and(|t| t.bytes > 0)).count();
    assert!((1..6).contains(&known), "{known} shards' tails known");
    let held: usize = store.shards.lock().values().filter_map(|s| s.tail.as_ref()).map(|t| t.bytes).sum();
    assert_eq!(store.tail_frames.used.load(Ordering::Relaxed), held, "the count is what the shards hold");
    for shard in shards.clone() {
        assert_eq!(all(&store, shard), frames(1, 200, 40), "shard {shard}");
        // Sealed chunks of about a KiB, not one per record.
        assert!(store.chunk_count(shard).unwrap() < 40, "shard {shard}");
        store.compact_prefix(shard, 201).unwrap();
    }
    assert_eq!(store.tail_frames.used.load(Ordering::Relaxed), 0, "compacted: no tail known");
}

/// A batch larger than a chunk is split; one record larger than a chunk
/// is a chunk of its own.
#[test]
fn large_batches_split_and_large_records_stand_alone() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 4 << 10);
    store.create_shard(1).unwrap();
    append(&store, 1, frames(1, 100, 200));
    let split = store.chunk_count(1).unwrap();
    assert!(split >= 100 * 236 / (4 << 10), "{split} chunks");
    append(&store, 1, vec![frame(101, 1, 10 << 10)]);
    assert_eq!(store.chunk_count(1).unwrap(), split + 1);
    let mut want = frames(1, 100, 200);
    want.push(frame(101, 1, 10 << 10));
    assert_eq!(all(&store, 1), want);
    assert_eq!(store.read(1, 101, 101, 1).unwrap(), want[100..]);
}

/// The end of the data written to `file`: raft-engine grows files by
/// `fallocate`, so what follows the last batch reads as zeros.
fn data_end(file: &Path) -> usize {
    let bytes = std::fs::read(file).unwrap();
    bytes.iter().rposition(|&b| b != 0).map_or(0, |at| at + 1)
}

fn newest_log_file(dir: &Path) -> PathBuf {
    log_files(dir, ".raftlog").last().unwrap().1.clone()
}

/// A crash in the middle of a chunk write (here a merge: the tail's small
/// chunks rewritten with new records as one): whatever prefix of the
/// write reached the disk, the store opens with every chunk written
/// before it, as it was, and appends continue.
#[test]
fn a_torn_chunk_write_keeps_every_chunk_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 4 << 10);
    store.create_shard(1).unwrap();
    for batch in 0..8u64 {
        append(&store, 1, frames(batch * 3 + 1, batch * 3 + 3, 100));
    }
    let before = store.chunk_count(1).unwrap();
    assert_eq!(before, 8, "eight small unsealed chunks");
    let file = newest_log_file(dir.path());
    let start = data_end(&file);
    append(&store, 1, frames(25, 40, 100));
    assert!(store.chunk_count(1).unwrap() < before, "the append merged the tail");
    let end = data_end(&file);
    assert_eq!(newest_log_file(dir.path()), file);
    let old = frames(1, 24, 100);
    let mut cuts: Vec<usize> = (0..16).map(|i| start + (end - start) * i / 16).collect();
    cuts.extend([start + 1, end - 1]);
    for cut in cuts {
        let copy = crate::conformance::crash_copy(dir.path());
        let torn = copy.path().join(file.file_name().unwrap());
        let mut bytes = std::fs::read(&torn).unwrap();
        bytes[cut..end].fill(0);
        std::fs::write(&torn, bytes).unwrap();
        let reopened = open(copy.path(), 4 << 10);
        assert_eq!(reopened.bounds(1).unwrap().last_seqno, 24, "cut at {cut} of [{start}, {end})");
        assert_eq!(all(&reopened, 1), old, "cut at {cut}");
        append(&reopened, 1, frames(25, 35, 100));
        drop(reopened);
        let reopened = open(copy.path(), 4 << 10);
        assert_eq!(all(&reopened, 1), frames(1, 35, 100), "cut at {cut}: appends continue");
    }
    // The whole write on disk: the merged log.
    let copy = crate::conformance::crash_copy(dir.path());
    assert_eq!(all(&open(copy.path(), 4 << 10), 1), frames(1, 40, 100));
}

/// Flips bytes of record `seqno`'s payload in every log file holding it.
fn flip(dir: &Path, seqno: u64, payload_len: usize) {
    let pattern = &frame(seqno, 1, payload_len).payload()[..];
    for (_, file) in log_files(dir, ".raftlog") {
        let mut bytes = std::fs::read(&file).unwrap();
        let mut found = false;
        let mut from = 0;
        while let Some(at) = bytes[from..].windows(pattern.len()).position(|w| w == pattern) {
            bytes[from + at + 20] ^= 0x5a;
            from += at + pattern.len();
            found = true;
        }
        if found {
            std::fs::write(&file, bytes).unwrap();
        }
    }
}

/// A damaged byte inside a chunk: raft-engine refuses the chunk (its batch
/// checksum), the store salvages it record by record, so a read names
/// exactly the damaged record and the chunk's other records are served;
/// truncating to just before it (keeping the chunk's intact prefix, or,
/// between chunks, reading no record at all) and appending a replica's
/// copy repairs it.
#[test]
fn damage_inside_a_chunk_names_the_chunk_and_a_truncation_repairs_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    store.create_shard(1).unwrap();
    // Four appends, four chunks, each in a raft-engine batch of its own.
    for (from, to) in [(1, 20), (21, 40), (41, 60), (61, 70)] {
        append(&store, 1, frames(from, to, 100));
    }
    assert_eq!(store.chunk_count(1).unwrap(), 4);
    drop(store);
    flip(dir.path(), 30, 100);
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    let err = store.read(1, 25, 35, usize::MAX).unwrap_err();
    assert_eq!(err.corrupt_range(), Some((1, 30, 30)), "exactly the damaged record: {err}");
    assert!(err.to_string().contains("corruption"), "{err}");
    // The chunk's other records are served (each has its own crc32).
    assert_eq!(store.read(1, 1, 29, usize::MAX).unwrap(), frames(1, 29, 100));
    assert_eq!(store.read(1, 31, 70, usize::MAX).unwrap(), frames(31, 70, 100));
    // The repair keeps the damaged chunk's intact records before the cut.
    store.truncate_suffix(1, 29).unwrap();
    append(&store, 1, frames(30, 70, 100));
    assert_eq!(all(&store, 1), frames(1, 70, 100));
    drop(store);
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    assert_eq!(all(&store, 1), frames(1, 70, 100));
    drop(store);

    // Damage on both sides of a cut between chunks.
    flip(dir.path(), 10, 100);
    flip(dir.path(), 30, 100);
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    let err = store.read(1, 1, 70, usize::MAX).unwrap_err();
    assert_eq!(err.corrupt_range(), Some((1, 10, 10)), "{err}");
    store.truncate_suffix(1, 20).unwrap();
    assert_eq!(store.bounds(1).unwrap().last_seqno, 20);
    store.truncate_suffix(1, 0).unwrap();
    append(&store, 1, frames(1, 70, 100));
    drop(store);
    assert_eq!(all(&open(dir.path(), DEFAULT_CHUNK_BYTES), 1), frames(1, 70, 100));
}

/// A damaged chunk is salvaged only from a copy found once: a log file may
/// hold another copy with the same header past its end (a recycled file
/// keeps its previous life's bytes; a truncated tail leaves its old
/// chunk), and which one raft-engine wrote last cannot be told from the
/// bytes. With two, the whole chunk is reported damaged; the old copy's
/// records (another epoch here) are never served.
#[test]
fn a_damaged_chunk_found_twice_is_reported_whole_never_served_from_the_other_copy() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    store.create_shard(1).unwrap();
    for (from, to) in [(1, 20), (21, 40), (41, 60)] {
        append(&store, 1, frames(from, to, 100));
    }
    // A previous life's copy of chunk [21, 40] past the end of the file:
    // the same header (shard, first seqno, count, length), records of
    // epoch 9.
    let old: Vec<Frame> = (21..=40).map(|s| frame(s, 9, 100)).collect();
    let stale = Segment::encode(1, old.clone()).unwrap();
    let (_, file) = log_files(dir.path(), ".raftlog").pop().expect("a log file");
    let mut file_bytes = std::fs::read(&file).unwrap();
    file_bytes.extend_from_slice(stale.encoded());
    // The live copy of record 30 damaged (the stale copy differs in its
    // epoch, so `flip`'s payload pattern finds both: damage the first).
    let live = frame(30, 1, 100);
    let pattern = &live.as_bytes()[..];
    let at = file_bytes.windows(pattern.len()).position(|w| w == pattern).expect("the live copy");
    file_bytes[at + pattern.len() - 10] ^= 0x5a;
    std::fs::write(&file, &file_bytes).unwrap();

    let err = store.read(1, 25, 35, usize::MAX).unwrap_err();
    assert_eq!(err.corrupt_range(), Some((1, 21, 40)), "the whole chunk, not epoch 9's records: {err}");
    // The chunks around it are intact.
    assert_eq!(store.read(1, 1, 20, usize::MAX).unwrap(), frames(1, 20, 100));
    assert_eq!(store.read(1, 41, 60, usize::MAX).unwrap(), frames(41, 60, 100));
}

/// Extracts a WAL directory produced by an earlier release (a
/// `tar.gz` under `tests/fixtures`) into a fresh directory.
fn legacy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let archive = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let status = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(dir.path())
        .arg("--strip-components=1")
        .status()
        .unwrap();
    assert!(status.success(), "extracting {}", archive.display());
    dir
}

/// The records the fixture's generator wrote (`tests/fixtures/README.md`).
fn legacy_frame(shard: ShardId, seqno: u64, epoch: u64) -> Frame {
    let payload = format!("legacy shard {shard} record {seqno} epoch {epoch}");
    let key = format!("k{seqno}");
    Frame::encode(RecordFields {
        seqno,
        epoch,
        timestamp_us: 1_000_000 + seqno,
        key: key.as_bytes(),
        payload: payload.as_bytes(),
    })
}

fn legacy_frames(shard: ShardId, from: u64, to: u64, epoch: impl Fn(u64) -> u64) -> Vec<Frame> {
    (from..=to).map(|s| legacy_frame(shard, s, epoch(s))).collect()
}

/// What the fixture holds, as the release that wrote it reported it.
fn assert_legacy_contents(store: &EngineStore) {
    assert_eq!(store.shards(), vec![1, 2, 3, 4, 5]);
    let bounds = |shard| {
        let b = store.bounds(shard).unwrap();
        (b.first_seqno, b.last_seqno, b.durable_seqno)
    };
    assert_eq!(bounds(1), (1001, 3000, 3000));
    assert_eq!(all(store, 1), legacy_frames(1, 1001, 3000, |s| if s <= 1500 { 1 } else { 2 }));
    assert_eq!((store.epoch(1).unwrap(), store.log_epoch(1).unwrap()), (3, 2));
    assert_eq!(bounds(2), (1, 400, 400), "the stale tail hidden by the truncation marker stays gone");
    assert_eq!(all(store, 2), legacy_frames(2, 1, 400, |_| 1));
    assert_eq!((store.epoch(2).unwrap(), store.log_epoch(2).unwrap()), (1, 0));
    assert_eq!(bounds(3), (1, 320, 320));
    assert_eq!(all(store, 3), legacy_frames(3, 1, 320, |s| if s <= 250 { 1 } else { 2 }));
    assert_eq!((store.epoch(3).unwrap(), store.log_epoch(3).unwrap()), (2, 2));
    assert_eq!(bounds(4), (1, 0, 0));
    assert_eq!(bounds(5), (101, 100, 100), "a fully compacted shard keeps its position");
}

/// A WAL written one entry per record by the release before chunks
/// (compacted, truncated, re-appended, empty and fully compacted shards)
/// opens with every record, position and epoch, converted to chunks; it
/// takes appends, truncations and compactions, and survives restarts.
#[test]
fn a_wal_of_the_release_before_chunks_converts_on_open() {
    let dir = legacy_fixture("legacy-store-1a8b0ea.tar.gz");
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    assert_legacy_contents(&store);
    assert!(store.chunk_count(1).unwrap() < 10, "2,000 records in a few chunks");
    let legacy_left: Vec<u64> = store
        .engine
        .raft_groups()
        .into_iter()
        .filter(|&g| g < CHUNK_REGION && get_u64(&store.engine, g, FIRST_KEY).is_some())
        .collect();
    assert!(legacy_left.is_empty(), "{legacy_left:?}");
    drop(store);
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    assert_legacy_contents(&store);
    append(&store, 2, legacy_frames(2, 401, 450, |_| 4));
    append(&store, 5, legacy_frames(5, 101, 110, |_| 4));
    store.truncate_suffix(1, 2500).unwrap();
    store.compact_prefix(3, 300).unwrap();
    drop(store);
    let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
    assert_eq!(all(&store, 2)[400..], legacy_frames(2, 401, 450, |_| 4));
    assert_eq!(all(&store, 5), legacy_frames(5, 101, 110, |_| 4));
    assert_eq!(store.bounds(1).unwrap().last_seqno, 2500);
    assert_eq!(all(&store, 3), legacy_frames(3, 300, 320, |_| 2));
}

/// A conversion interrupted after any of its steps (a crash: nothing of
/// the step after it reached the disk) resumes on the next open and ends
/// with the same log.
#[test]
fn an_interrupted_conversion_resumes() {
    for steps in 0..4 {
        let dir = legacy_fixture("legacy-store-1a8b0ea.tar.gz");
        legacy::STOP_AFTER_STEPS.with(|s| s.set(Some(steps)));
        let interrupted = EngineStore::open(dir.path(), &Default::default());
        legacy::STOP_AFTER_STEPS.with(|s| s.set(None));
        assert!(matches!(interrupted, Err(StoreError::Io(ref e)) if e.contains("stopped")), "steps {steps}");
        drop(interrupted);
        let store = open(dir.path(), DEFAULT_CHUNK_BYTES);
        assert_legacy_contents(&store);
    }
}

/// Reads racing appends that merge and split the chunks they look up: every
/// read of a range inside the log returns exactly its records (a read that
/// finds its chunk replaced looks it up again), never an error.
#[test]
fn reads_racing_merges_return_exactly_their_records() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open(dir.path(), 2 << 10));
    store.create_shard(1).unwrap();
    append(&store, 1, frames(1, 5, 60));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            let mut next = 6;
            for batch in 0..1_500u64 {
                let count = 1 + batch % 7;
                append(&store, 1, frames(next, next + count - 1, 60));
                next += count;
            }
            done.store(true, std::sync::atomic::Ordering::Release);
        })
    };
    let mut reads = 0u64;
    let mut seed = 7u64;
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        let last = store.bounds(1).unwrap().last_seqno;
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let from = 1 + (seed >> 33) % last;
        let to = (from + (seed >> 20) % 40).min(last);
        let got = store.read(1, from, to, usize::MAX).unwrap_or_else(|e| panic!("read [{from}, {to}] of {last}: {e}"));
        assert_eq!(got, frames(from, to, 60), "read [{from}, {to}]");
        reads += 1;
    }
    writer.join().unwrap();
    assert!(reads > 100, "{reads} reads raced the appends");
}

/// Random appends, truncations of the newest records (as divergence repair
/// does), compactions and reads, against the in-memory store as the model.
#[test]
fn random_operations_match_the_model() {
    use crate::MemStore;
    for chunk_bytes in [512u64, 4 << 10, DEFAULT_CHUNK_BYTES] {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), chunk_bytes);
        let model = MemStore::new();
        store.create_shard(1).unwrap();
        model.create_shard(1).unwrap();
        let mut seed = chunk_bytes;
        let mut next_rand = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for step in 0..3_000 {
            let b = model.bounds(1).unwrap();
            match next_rand(10) {
                0..=5 => {
                    let count = 1 + next_rand(12);
                    let epoch = 1 + step / 500;
                    let frames: Vec<Frame> = (b.last_seqno + 1..=b.last_seqno + count)
                        .map(|s| frame(s, epoch, 50 + (s % 300) as usize))
                        .collect();
                    model.append(&[ShardAppend { shard: 1, frames: frames.clone() }], true).unwrap();
                    append(&store, 1, frames);
                }
                6 | 7 if !b.is_empty() => {
                    let keep = b.last_seqno.saturating_sub(next_rand(20)).max(b.first_seqno - 1);
                    model.truncate_suffix(1, keep).unwrap();
                    store.truncate_suffix(1, keep).unwrap();
                }
                8 if !b.is_empty() && next_rand(4) == 0 => {
                    let first = b.first_seqno + next_rand(b.last_seqno - b.first_seqno + 2).min(30);
                    model.compact_prefix(1, first).unwrap();
                    store.compact_prefix(1, first).unwrap();
                }
                _ if !b.is_empty() => {
                    let from = b.first_seqno + next_rand(b.last_seqno - b.first_seqno + 1);
                    let to = (from + next_rand(50)).min(b.last_seqno);
                    let max = 1 + next_rand(20_000) as usize;
                    assert_eq!(
                        store.read(1, from, to, max).unwrap(),
                        model.read(1, from, to, max).unwrap(),
                        "step {step}"
                    );
                }
                _ => {}
            }
            let (sb, mb) = (store.bounds(1).unwrap(), model.bounds(1).unwrap());
            assert_eq!((sb.first_seqno, sb.last_seqno), (mb.first_seqno, mb.last_seqno), "step {step}");
        }
        drop(store);
        let store = open(dir.path(), chunk_bytes);
        assert_eq!(all(&store, 1), {
            let b = model.bounds(1).unwrap();
            if b.is_empty() { Vec::new() } else { model.read(1, b.first_seqno, b.last_seqno, usize::MAX).unwrap() }
        });
    }
}

/// With no tails kept in the store, a merge takes the tail's frames from
/// what the caller holds (the WAL's tail cache) when they are exactly the
/// tail, and reads the tail back when they are not (a frame missing or
/// extra, seqnos off, other bytes): every shard's log reads back the same
/// whichever it was.
#[test]
fn a_merge_takes_the_tail_from_the_caller_only_when_it_is_exactly_the_tail() {
    use std::cell::Cell;
    let dir = tempfile::tempdir().unwrap();
    let config = EngineStoreConfig { chunk_bytes: 1 << 10, tail_frames_bytes: 0, ..Default::default() };
    let store = EngineStore::open(dir.path(), &config).unwrap();
    let written = frames(1, 300, 40);
    // How each shard's caller answers for `[from, to]`.
    type Answer = fn(&[Frame], u64, u64) -> Option<Vec<Frame>>;
    let exact: Answer = |w, from, to| Some(w[from as usize - 1..to as usize].to_vec());
    let answers: [(ShardId, Answer); 5] = [
        (1, exact),
        (2, |w, from, to| Some(w[from as usize - 1..to as usize - 1].to_vec())), // one short
        (3, |w, from, to| Some(w[from as usize - 1..=to as usize].to_vec())),    // one extra
        (4, |w, from, to| Some(w[from as usize..=to as usize].to_vec())),        // seqnos off by one
        (5, |_, from, to| Some((from..=to).map(|s| frame(s, 1, 41)).collect())), // other bytes
    ];
    let asked = Cell::new(0);
    for (shard, _) in answers {
        store.create_shard(shard).unwrap();
    }
    for seqno in 1..=300u64 {
        for (shard, answer) in answers {
            let earlier = |s: ShardId, from: u64, to: u64| {
                assert_eq!(s, shard);
                asked.set(asked.get() + 1);
                assert_eq!(to, seqno - 1, "asked for the tail before the append");
                answer(&written, from, to)
            };
            let part = ShardAppend { shard, frames: vec![written[seqno as usize - 1].clone()] };
            store.append_with_earlier(&[part], &SnapshotChanges::default(), true, &earlier).unwrap();
        }
    }
    assert!(asked.get() > 5 * 10, "the tails merged, asked {} times", asked.get());
    for (shard, _) in answers {
        assert_eq!(all(&store, shard), written, "shard {shard}");
    }
    drop(store);
    let store = EngineStore::open(dir.path(), &config).unwrap();
    for (shard, _) in answers {
        assert_eq!(all(&store, shard), written, "shard {shard} after a reopen");
    }
}

#[test]
fn only_the_exact_tail_counts_as_held() {
    let tail = frames(11, 13, 40);
    let bytes: u64 = tail.iter().map(|f| f.len() as u64).sum();
    assert!(holds_tail(&tail, 11, 3, bytes));
    assert!(!holds_tail(&tail, 10, 3, bytes), "starts elsewhere");
    assert!(!holds_tail(&tail[..2], 11, 3, bytes), "one missing");
    assert!(!holds_tail(&tail, 11, 2, bytes), "one extra");
    assert!(!holds_tail(&tail, 11, 3, bytes + 1), "other bytes");
    let gap = vec![tail[0].clone(), tail[2].clone(), frame(14, 1, 40)];
    assert!(!holds_tail(&gap, 11, 3, gap.iter().map(|f| f.len() as u64).sum()), "a gap");
    assert!(holds_tail(&[], 11, 0, 0));
}
