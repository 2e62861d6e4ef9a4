//! One conformance suite for the leadership KV, run against both
//! implementations: [`FileKv`] (a temp dir) and [`NatsKv`] (a fresh
//! `nats-server -js` per test, a bucket named after the test).
//!
//! Every case is a function of a [`Fixture`]: `kv` and `other` are two
//! independent clients of one store (two `FileKv`s on one dir, two NATS
//! connections to one bucket), i.e. two coordinator processes.
//!
//! Where the implementations differ, the case asserts the exact behaviour of
//! each and says so:
//! * watch: NATS delivers every revision; the file KV polls (every 20 ms) and
//!   yields the newest value it finds, so two writes between two polls come
//!   out as one entry (the second). Both yield every revision to a watcher
//!   that keeps up, never a value older than one already yielded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use walship_shipping::control::coordinator::now_ms;
use walship_shipping::control::kv::KvSnapshot;
use walship_shipping::control::state::{
    ClusterState, FAILOVERS_KEY, LEASE_KEY, Lease, LeaseAction, Stored, lease_action, shard_key,
};
use walship_shipping::control::{FileKv, Kv, KvEntry, KvError, NatsKv};
use walship_shipping::{ClusterConfig, NodeSpec};

mod support {
    pub mod nats;
}

use support::nats::NatsServer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    File,
    Nats,
}

/// Keeps the store alive for the test.
#[allow(dead_code)]
enum Guard {
    File(tempfile::TempDir),
    Nats(NatsServer),
}

struct Fixture {
    backend: Backend,
    kv: Arc<dyn Kv>,
    /// A second, independent client of the same store.
    other: Arc<dyn Kv>,
    _guard: Guard,
}

impl Fixture {
    fn file() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let kv = FileKv::open(&dir.path().join("kv")).unwrap();
        let other = FileKv::open(&dir.path().join("kv")).unwrap();
        Fixture { backend: Backend::File, kv: Arc::new(kv), other: Arc::new(other), _guard: Guard::File(dir) }
    }

    async fn nats(case: &str) -> Fixture {
        let server = NatsServer::start();
        let bucket = format!("conformance_{case}_{}", std::process::id());
        let kv = NatsKv::connect(&server.url, &bucket).await.unwrap();
        let other = NatsKv::connect(&server.url, &bucket).await.unwrap();
        assert_eq!(kv.describe(), format!("nats:{}/{bucket}", server.url));
        Fixture { backend: Backend::Nats, kv: Arc::new(kv), other: Arc::new(other), _guard: Guard::Nats(server) }
    }
}

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

async fn value_of(kv: &dyn Kv, key: &str) -> Option<(Bytes, u64)> {
    kv.get(key).await.unwrap().map(|e| (e.value, e.revision))
}

/// Polls `condition` every 5 ms until it holds; panics after `timeout`.
async fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn next_entry(stream: &mut futures::stream::BoxStream<'static, KvEntry>) -> KvEntry {
    tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("watch yielded nothing within 5 s")
        .expect("watch stream ended")
}

// ---- cases -------------------------------------------------------------------

/// get of a missing key is None; create then get returns the value and a
/// revision > 0; create of an existing key is `Exists` and changes nothing.
async fn get_create_exists(f: &Fixture) {
    let kv = f.kv.as_ref();
    assert!(kv.get("k").await.unwrap().is_none());
    let revision = kv.create("k", b("v1")).await.unwrap();
    assert!(revision > 0);
    let entry = kv.get("k").await.unwrap().expect("created key");
    assert_eq!(entry, KvEntry { key: "k".into(), value: b("v1"), revision });
    // The other client sees it too.
    assert_eq!(f.other.get("k").await.unwrap(), Some(entry));

    match kv.create("k", b("v2")).await {
        Err(KvError::Exists(key)) => assert_eq!(key, "k"),
        other => panic!("create of an existing key: expected Exists, got {other:?}"),
    }
    match f.other.create("k", b("v3")).await {
        Err(KvError::Exists(key)) => assert_eq!(key, "k"),
        other => panic!("create of an existing key (other client): expected Exists, got {other:?}"),
    }
    assert_eq!(value_of(kv, "k").await, Some((b("v1"), revision)));
    // Other keys are independent.
    assert!(kv.get("k2").await.unwrap().is_none());
}

/// update with the current revision succeeds with a larger revision; with a
/// stale one it is `Conflict` and changes nothing.
async fn update_compare_and_set(f: &Fixture) {
    let kv = f.kv.as_ref();
    let r1 = kv.create("k", b("v1")).await.unwrap();
    let r2 = kv.update("k", b("v2"), r1).await.unwrap();
    assert!(r2 > r1, "update returned revision {r2} after {r1}");
    assert_eq!(value_of(kv, "k").await, Some((b("v2"), r2)));

    for (client, stale) in [(kv, r1), (f.other.as_ref(), r1), (kv, r2 + 1), (kv, u64::MAX)] {
        match client.update("k", b("stale"), stale).await {
            Err(KvError::Conflict { key, expected }) => {
                assert_eq!(key, "k");
                assert_eq!(expected, stale);
            }
            other => panic!("update with stale revision {stale}: expected Conflict, got {other:?}"),
        }
        assert_eq!(value_of(kv, "k").await, Some((b("v2"), r2)));
    }
    // The other client, holding the current revision, may write.
    let r3 = f.other.update("k", b("v3"), r2).await.unwrap();
    assert!(r3 > r2);
    assert_eq!(value_of(kv, "k").await, Some((b("v3"), r3)));
}

/// update of a key that does not exist is `Conflict` (both implementations;
/// neither returns `Missing`), whatever revision is given — 0 included — and
/// creates nothing.
async fn update_missing_key(f: &Fixture) {
    let kv = f.kv.as_ref();
    // Make the bucket-wide revision non-trivial first.
    let r = kv.create("other", b("x")).await.unwrap();
    for revision in [0, 1, r, r + 1, 1_000] {
        match kv.update("missing", b("v"), revision).await {
            Err(KvError::Conflict { key, expected }) => {
                assert_eq!(key, "missing");
                assert_eq!(expected, revision);
            }
            other => panic!("{:?}: update of a missing key at revision {revision}: got {other:?}", f.backend),
        }
        assert!(kv.get("missing").await.unwrap().is_none(), "update at revision {revision} created the key");
    }
    // create still works afterwards.
    let created = kv.create("missing", b("now")).await.unwrap();
    assert_eq!(value_of(kv, "missing").await, Some((b("now"), created)));
}

/// Revisions strictly increase across writes of one key, whoever writes and
/// whatever else is written in between.
async fn revisions_strictly_increase(f: &Fixture) {
    let mut revision = f.kv.create("k", b("0")).await.unwrap();
    for i in 1..=20 {
        let writer = if i % 2 == 0 { f.kv.as_ref() } else { f.other.as_ref() };
        if i % 3 == 0 {
            // Writes of another key in between.
            match writer.get("noise").await.unwrap() {
                None => writer.create("noise", b("n")).await.unwrap(),
                Some(e) => writer.update("noise", b("n"), e.revision).await.unwrap(),
            };
        }
        let next = writer.update("k", Bytes::from(i.to_string()), revision).await.unwrap();
        assert!(next > revision, "write {i}: revision {next} after {revision}");
        assert_eq!(value_of(f.kv.as_ref(), "k").await, Some((Bytes::from(i.to_string()), next)));
        revision = next;
    }
}

/// Subscribe, then update twice back to back: NATS yields both new values in
/// order; the file KV yields them in order too but may coalesce them into
/// the second (see the module doc). Neither yields the value from before
/// the subscription.
async fn watch_two_updates(f: &Fixture) {
    let r0 = f.kv.create("k", b("v0")).await.unwrap();
    let mut stream = f.kv.watch("k").await.unwrap();
    let r1 = f.other.update("k", b("v1"), r0).await.unwrap();
    let r2 = f.other.update("k", b("v2"), r1).await.unwrap();
    let mut seen = Vec::new();
    while seen.last().is_none_or(|e: &KvEntry| e.revision < r2) {
        seen.push(next_entry(&mut stream).await);
    }
    let got: Vec<(Bytes, u64)> = seen.iter().map(|e| (e.value.clone(), e.revision)).collect();
    assert!(seen.iter().all(|e| e.key == "k"));
    match f.backend {
        Backend::Nats => assert_eq!(got, vec![(b("v1"), r1), (b("v2"), r2)]),
        Backend::File => {
            assert!(
                got == vec![(b("v1"), r1), (b("v2"), r2)] || got == vec![(b("v2"), r2)],
                "file watch yielded {got:?}"
            );
            if got.len() == 1 {
                eprintln!("file KV watch coalesced v1 into v2 (polling), as documented");
            }
        }
    }
    // A watcher that keeps up sees every revision, in order, on both.
    let r3 = f.other.update("k", b("v3"), r2).await.unwrap();
    let e3 = next_entry(&mut stream).await;
    assert_eq!((e3.value, e3.revision), (b("v3"), r3));
    let r4 = f.kv.update("k", b("v4"), r3).await.unwrap();
    let e4 = next_entry(&mut stream).await;
    assert_eq!((e4.value, e4.revision), (b("v4"), r4));
}

/// The coordinator lease on the KV, exactly as the coordinator does it
/// (one key per shard, the lease its own key, every write a bucket-wide
/// compare-and-set): A bootstraps the state (lease "a", term 1, 300 ms); B
/// reads only the lease key and stands by until it expires, then reads
/// everything and takes over with one write of the lease key (term 2); A's
/// next write against the revision it held — a renewal, or a change of one
/// shard's record, a key B never wrote — is `Conflict` and changes nothing.
async fn lease_expiry_fences_the_old_holder(f: &Fixture) {
    let (a, b_kv) = (f.kv.as_ref(), f.other.as_ref());
    let node = NodeSpec {
        id: 1,
        grpc_addr: "127.0.0.1:1".parse().unwrap(),
        admin_addr: "127.0.0.1:2".parse().unwrap(),
        region: 0,
    };
    let config = ClusterConfig::single_node(node, &[1, 2]);
    let decode = |snapshot: &KvSnapshot| match Stored::decode(&snapshot.entries).unwrap() {
        Stored::Current(state) => state,
        other => panic!("expected the per-key layout, read {other:?}"),
    };

    // A: the first coordinator bootstraps: every key in one write.
    let started = now_ms();
    let state_a = ClusterState::bootstrap(&config, "a", started, 300);
    let expires = state_a.lease.expires_unix_ms;
    assert_eq!(state_a.lease, Lease { holder: "a".into(), term: 1, expires_unix_ms: started + 300 });
    let empty = a.scan().await.unwrap();
    assert_eq!(Stored::decode(&empty.entries).unwrap(), Stored::Empty);
    let revision_a = a.write_batch(empty.revision, state_a.to_entries()).await.unwrap();
    let keys: Vec<String> = state_a.to_entries().into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, [shard_key(1), shard_key(2), FAILOVERS_KEY.to_string(), LEASE_KEY.to_string()]);

    // B reads the lease key: a live lease held by someone else.
    let lease_entry = b_kv.get(LEASE_KEY).await.unwrap().expect("lease written");
    assert_eq!(lease_entry.revision, revision_a, "the lease is the batch's last key");
    let lease: Lease = serde_json::from_slice(&lease_entry.value).unwrap();
    let now = now_ms();
    assert!(now < expires, "test setup took {} ms, longer than the 300 ms lease", now - started);
    assert_eq!(lease_action(&lease, "b", now), LeaseAction::Standby);
    assert_eq!(lease_action(&lease, "a", now), LeaseAction::Renew);

    // A stops renewing; the lease runs out.
    wait_until("A's lease expires", Duration::from_secs(5), || now_ms() >= expires).await;
    let now = now_ms();
    assert_eq!(lease_action(&lease, "b", now), LeaseAction::TakeOver);

    // B reads everything and takes over with the next term: one key.
    let read = b_kv.scan().await.unwrap();
    assert_eq!(read.revision, revision_a);
    let mut state_b = decode(&read);
    assert_eq!(state_b, state_a);
    state_b.lease = Lease { holder: "b".into(), term: state_b.lease.term + 1, expires_unix_ms: now + 10_000 };
    let puts = state_b.changes_from(&state_a);
    assert_eq!(puts.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), [LEASE_KEY], "only the lease changed");
    let revision_b = b_kv.write_batch(read.revision, puts).await.expect("B's takeover");
    assert_eq!(revision_b, revision_a + 1);

    // A wakes up believing it still holds the lease: a renewal, and a
    // change of shard 2 (a key B did not touch), both against the revision
    // A wrote: fenced.
    let mut renewal = state_a.clone();
    renewal.lease.expires_unix_ms = now_ms() + 300;
    let mut failover = state_a.clone();
    failover.shard_mut(2).unwrap().epoch += 1;
    for (what, next) in [("renewal", renewal), ("shard change", failover)] {
        match a.write_batch(revision_a, next.changes_from(&state_a)).await {
            Err(KvError::Conflict { expected, .. }) => assert_eq!(expected, revision_a),
            other => panic!("A's {what} with its stale revision: expected Conflict, got {other:?}"),
        }
    }
    // Nothing changed: the KV still names B, term 2, and shard 2 as it was.
    for client in [a, b_kv] {
        let stored = client.scan().await.unwrap();
        assert_eq!(stored.revision, revision_b);
        let state = decode(&stored);
        assert_eq!(state, state_b);
        assert_eq!((state.lease.holder.as_str(), state.lease.term), ("b", 2));
        assert_eq!(lease_action(&state.lease, "a", now_ms()), LeaseAction::Standby);
    }
}

/// scan of an empty bucket is empty at revision 0; a batch writes every key
/// at consecutive revisions and returns the last; scan reads them all,
/// sorted by key; a batch, a create or an update moves the bucket revision
/// a stale batch is checked against.
async fn scan_and_write_batch(f: &Fixture) {
    let (kv, other) = (f.kv.as_ref(), f.other.as_ref());
    assert_eq!(kv.scan().await.unwrap(), KvSnapshot { entries: Vec::new(), revision: 0 });
    let puts = vec![("b".to_string(), b("2")), ("a".to_string(), b("1")), ("c".to_string(), b("3"))];
    assert_eq!(kv.write_batch(0, puts).await.unwrap(), 3);
    let expected = vec![
        KvEntry { key: "a".into(), value: b("1"), revision: 2 },
        KvEntry { key: "b".into(), value: b("2"), revision: 1 },
        KvEntry { key: "c".into(), value: b("3"), revision: 3 },
    ];
    assert_eq!(other.scan().await.unwrap(), KvSnapshot { entries: expected.clone(), revision: 3 });
    assert_eq!(other.get("a").await.unwrap(), Some(expected[0].clone()));

    // Stale: nothing written.
    for stale in [0, 2, 4, u64::MAX] {
        match other.write_batch(stale, vec![("a".into(), b("x")), ("d".into(), b("x"))]).await {
            Err(KvError::Conflict { expected, .. }) => assert_eq!(expected, stale),
            got => panic!("batch at stale revision {stale}: expected Conflict, got {got:?}"),
        }
    }
    assert_eq!(kv.scan().await.unwrap(), KvSnapshot { entries: expected, revision: 3 });

    // A single-key write moves the bucket too.
    let r = other.update("a", b("1b"), 2).await.unwrap();
    assert_eq!(r, 4);
    assert!(matches!(kv.write_batch(3, vec![("z".into(), b("z"))]).await, Err(KvError::Conflict { .. })));
    let r = kv.create("d", b("4")).await.unwrap();
    assert!(matches!(kv.write_batch(4, vec![("z".into(), b("z"))]).await, Err(KvError::Conflict { .. })));
    assert_eq!(kv.write_batch(r, vec![("z".into(), b("z"))]).await.unwrap(), r + 1);
    // An empty batch checks the revision and writes nothing.
    assert_eq!(kv.write_batch(r + 1, Vec::new()).await.unwrap(), r + 1);
    assert!(matches!(kv.write_batch(r, Vec::new()).await, Err(KvError::Conflict { .. })));
    let snapshot = kv.scan().await.unwrap();
    assert_eq!(snapshot.revision, r + 1);
    assert_eq!(snapshot.entries.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), ["a", "b", "c", "d", "z"]);
}

/// Runs `write` on both clients at once (`f.kv` as "one", `f.other` as
/// "two"), each fenced on `revision`: exactly one must succeed and the
/// other must be refused as a conflict at `revision`. The winner's name and
/// the revision its write returned.
async fn race<W, Fut>(f: &Fixture, round: usize, revision: u64, write: W) -> (&'static str, u64)
where
    W: Fn(Arc<dyn Kv>, &'static str) -> Fut,
    Fut: std::future::Future<Output = Result<u64, KvError>> + Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let writes: Vec<_> = [(f.kv.clone(), "one"), (f.other.clone(), "two")]
        .into_iter()
        .map(|(kv, who)| {
            let (barrier, attempt) = (barrier.clone(), write(kv, who));
            tokio::spawn(async move {
                barrier.wait().await;
                (who, attempt.await)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for write in writes {
        match write.await.unwrap() {
            (who, Ok(after)) => winners.push((who, after)),
            (_, Err(KvError::Conflict { expected, .. })) => assert_eq!(expected, revision),
            (_, Err(e)) => panic!("round {round}: unexpected error {e:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
    winners[0]
}

/// Two clients read the same bucket revision and write batches of
/// different keys at once: exactly one batch lands, whole; the loser's keys
/// are absent.
async fn write_batch_race(f: &Fixture) {
    let mut revision = f.kv.write_batch(0, vec![("start".into(), b("s"))]).await.unwrap();
    for round in 0..10 {
        let (winner, after) = race(f, round, revision, move |kv, who| async move {
            let puts = (0..5).map(|i| (format!("{who}-{round}-{i}"), Bytes::from(who))).collect();
            kv.write_batch(revision, puts).await
        })
        .await;
        assert_eq!(after, revision + 5);
        let snapshot = f.kv.scan().await.unwrap();
        assert_eq!(snapshot.revision, after);
        let this_round: Vec<&KvEntry> =
            snapshot.entries.iter().filter(|e| e.key.ends_with(&format!("-{round}-0"))).collect();
        assert_eq!(this_round.len(), 1, "round {round}: {this_round:?}");
        assert!(this_round[0].key.starts_with(winner));
        revision = after;
    }
}

/// A batch larger than one JetStream atomic batch (2,500 keys) lands whole
/// at consecutive revisions, and a stale one of the same size writes
/// nothing.
async fn write_batch_larger_than_one_atomic_run(f: &Fixture) {
    let value = |i: usize, round: &str| Bytes::from(format!("{round}-{i}"));
    let puts = |round: &'static str| (0..2_500).map(move |i| (format!("shard.{i}"), value(i, round))).collect();
    let revision = f.kv.write_batch(0, puts("first")).await.unwrap();
    assert_eq!(revision, 2_500);
    let snapshot = f.other.scan().await.unwrap();
    assert_eq!(snapshot.revision, 2_500);
    assert_eq!(snapshot.entries.len(), 2_500);
    for entry in &snapshot.entries {
        let i: usize = entry.key.strip_prefix("shard.").unwrap().parse().unwrap();
        assert_eq!(entry.value, value(i, "first"));
        assert!((1..=2_500).contains(&entry.revision));
    }
    assert!(matches!(f.other.write_batch(2_499, puts("stale")).await, Err(KvError::Conflict { .. })));
    let after = f.kv.scan().await.unwrap();
    assert_eq!(after, snapshot, "a stale batch wrote something");
    // Rewriting all of it at the right revision works.
    assert_eq!(f.other.write_batch(2_500, puts("second")).await.unwrap(), 5_000);
    let snapshot = f.kv.scan().await.unwrap();
    assert!(snapshot.entries.iter().all(|e| e.value.starts_with(b"second-")));
}

/// Two clients (two processes' view) read the same revision and both
/// update: exactly one wins, and the store holds the winner's value.
async fn cas_race_two_clients(f: &Fixture) {
    let mut revision = f.kv.create("k", b("start")).await.unwrap();
    for round in 0..20 {
        let (seen_1, seen_2) = (f.kv.get("k").await.unwrap().unwrap(), f.other.get("k").await.unwrap().unwrap());
        assert_eq!(seen_1.revision, revision);
        assert_eq!(seen_2.revision, revision);
        let (winner, new_revision) = race(f, round, revision, move |kv, who| async move {
            kv.update("k", Bytes::from(format!("{who}-{round}")), revision).await
        })
        .await;
        assert!(new_revision > revision);
        let value = Bytes::from(format!("{winner}-{round}"));
        assert_eq!(value_of(f.kv.as_ref(), "k").await, Some((value, new_revision)));
        revision = new_revision;
    }
}

/// A scan while another client keeps writing: no key appears twice, and
/// revisions never go back between scans. (On NATS a key rewritten many
/// times during the scan may be missing from it: its value was replaced
/// under the scan's consumer. Such a snapshot is older than the bucket, so
/// a write fenced on its revision fails; once the writes stop, a scan holds
/// every key.)
async fn scan_while_writing(f: &Fixture) {
    let mut revision = f.kv.write_batch(0, vec![("a".into(), b("0")), ("busy".into(), b("0"))]).await.unwrap();
    let writer = {
        let kv = f.other.clone();
        tokio::spawn(async move {
            for i in 1..=150u32 {
                revision = kv.write_batch(revision, vec![("busy".into(), Bytes::from(i.to_string()))]).await.unwrap();
            }
        })
    };
    let mut last_busy = 0;
    while !writer.is_finished() {
        let snapshot = f.kv.scan().await.unwrap();
        let keys: Vec<&str> = snapshot.entries.iter().map(|e| e.key.as_str()).collect();
        assert!(keys == ["a", "busy"] || (f.backend == Backend::Nats && keys == ["a"]), "{keys:?}");
        if let Some(busy) = snapshot.entries.get(1) {
            assert!(busy.revision >= last_busy, "a scan went back: {} after {last_busy}", busy.revision);
            last_busy = busy.revision;
        }
        if keys.len() == 1 {
            assert!(f.kv.write_batch(snapshot.revision, vec![("x".into(), b("x"))]).await.is_err());
        }
    }
    writer.await.unwrap();
    let snapshot = f.kv.scan().await.unwrap();
    let keys: Vec<&str> = snapshot.entries.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["a", "busy"]);
    assert_eq!(snapshot.entries[1].value, b("150"));
}

// ---- both implementations ----------------------------------------------------

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod file {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let fixture = super::Fixture::file();
                    super::$case(&fixture).await;
                }
            )*
        }

        mod nats {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let fixture = super::Fixture::nats(stringify!($case)).await;
                    super::$case(&fixture).await;
                }
            )*
        }
    };
}

conformance!(
    get_create_exists,
    update_compare_and_set,
    update_missing_key,
    revisions_strictly_increase,
    watch_two_updates,
    lease_expiry_fences_the_old_holder,
    cas_race_two_clients,
    scan_and_write_batch,
    write_batch_race,
    write_batch_larger_than_one_atomic_run,
    scan_while_writing,
);

/// Two `FileKv`s on one dir are two processes' views: a write through one is
/// seen by the other, and a CAS race between them, on blocking threads with
/// no shared memory but the file, has exactly one winner.
#[test]
fn file_kv_two_instances_one_dir() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let path = dir.path().join("kv");
    runtime.block_on(async {
        let (one, two) = (FileKv::open(&path).unwrap(), FileKv::open(&path).unwrap());
        assert_eq!(one.describe(), format!("file:{}", path.display()));
        let r = one.create("k", b("v")).await.unwrap();
        assert_eq!(value_of(&two, "k").await, Some((b("v"), r)));
    });
    drop(runtime);
    // Threads, not tasks: each "process" runs its own runtime.
    for round in 0..20 {
        let revision = {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async { FileKv::open(&path).unwrap().get("k").await.unwrap().unwrap().revision })
        };
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let racers: Vec<_> = (0..2)
            .map(|i| {
                let (path, barrier) = (path.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                    let kv = FileKv::open(&path).unwrap();
                    let seen = rt.block_on(kv.get("k")).unwrap().unwrap().revision;
                    assert_eq!(seen, revision);
                    barrier.wait();
                    let value = format!("racer-{i}-{round}");
                    (value.clone(), rt.block_on(kv.update("k", Bytes::from(value), seen)))
                })
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let winners: Vec<_> = results.iter().filter_map(|(v, r)| r.as_ref().ok().map(|rev| (v, *rev))).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        for (_, r) in &results {
            if let Err(e) = r {
                assert!(matches!(e, KvError::Conflict { expected, .. } if *expected == revision), "{e:?}");
            }
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let stored = rt.block_on(value_of(&FileKv::open(&path).unwrap(), "k"));
        assert_eq!(stored, Some((Bytes::from(winners[0].0.clone()), winners[0].1)));
    }
}

/// Without the nats-server binary the NATS half must fail loudly, not skip.
#[test]
fn nats_server_binary_is_installed() {
    let bin = support::nats::nats_server_bin();
    assert!(bin.is_file(), "nats-server not found at {}: run ops/test.sh (it installs nats-server)", bin.display());
}
