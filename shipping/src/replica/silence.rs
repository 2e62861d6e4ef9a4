//! Which unsettled replicas' heartbeat reports need building again.
//!
//! A replica whose leader or follower is silent is never settled, so the
//! heartbeat loop (`heartbeats.rs`) looks at it every tick. Between what
//! happens to it (its activity), its report changes only with its peers'
//! silences, and the coordinator tells those apart only as
//! [`silence_class`] does and, past twice the replication timeout it
//! compares them with, not at all. A tick that would build the same report
//! skips it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::contact::Contact;
use super::shard::ShardReplica;
use super::{ReplicationNode, now_us};
use crate::NodeId;
use crate::core::replica::Role;

/// An unsettled replica's report is built again at least this often while
/// nothing happened to it (its activity did not move) and its silences
/// stayed in their quarter seconds, or past twice the replication timeout
/// (see [`Silences::key`]); otherwise it is built every tick. While a node
/// is down, every shard it shares with this node is unsettled (its leader
/// or a follower silent) and, built every tick, was two thirds of this
/// node's CPU at 10,000 shards.
const LONG_SILENT_REPORT_EVERY: Duration = Duration::from_secs(1);

/// A replica whose report would differ from its last one only in how far
/// its log and its followers got (appends arriving, nothing else changed:
/// [`Standing`] and the silences alike) is reported at most this often;
/// anything else it says is reported at the next tick. Positions are what
/// the coordinator shows and reckons lag with, never what it fails over by
/// (a failover fences the replicas and asks them), and a quarter second is
/// how finely it tells silences apart. Reported every 50 ms tick, 1,000
/// shards under appends were 20,000 shard reports a second from every node
/// (6 % of a leader's CPU, and the coordinator's to read them).
pub(super) const PROGRESS_REPORT_EVERY: Duration = Duration::from_millis(250);

/// What a replica's report says besides its positions and counters: its
/// role, epoch and leader, and its health. A change reports it at the next
/// tick (see [`PROGRESS_REPORT_EVERY`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Standing {
    pub(super) role: Role,
    pub(super) epoch: u64,
    pub(super) needs_new_epoch: bool,
    pub(super) disk_full: bool,
    pub(super) corrupt_from: Option<u64>,
    pub(super) quiet: bool,
}

/// When an unsettled replica's report was last built, and what then: a
/// tick finding the same activity, the same [`Silences::key`] and, past
/// [`PROGRESS_REPORT_EVERY`], the same progress within
/// [`LONG_SILENT_REPORT_EVERY`] would build a report that says the same
/// (what else it says moves only with those), and skips it.
pub(super) struct LastBuild {
    activity: u64,
    /// What the replica has made readable (a leader's commit). A leader's
    /// appends and its followers' acknowledgements move no activity (they
    /// would unsettle it on every write); this is how its progress reaches
    /// the coordinator every quarter second, as a follower's (whose
    /// shipments move its activity) does. Without it, a busy leader's
    /// report was rebuilt about once a second, and a catch-up task could
    /// start from a commit a second old.
    progress: u64,
    standing: Standing,
    silences: u64,
    /// See [`Silences::resting`]: its silences are looked at only every
    /// quarter second.
    resting: bool,
    /// See [`ReplicationNode::dormancy`]: the node contact when it was
    /// found dormant.
    dormant: Option<Contact>,
    at: Instant,
}

impl LastBuild {
    /// A report built now, at `activity` and `progress`, with `silences`.
    pub(super) fn new(
        activity: u64,
        progress: u64,
        standing: Standing,
        silences: &Silences,
        long_ms: u64,
    ) -> LastBuild {
        LastBuild {
            activity,
            progress,
            standing,
            silences: silences.key(long_ms),
            resting: silences.resting(long_ms),
            dormant: None,
            at: Instant::now(),
        }
    }

    /// This build, found dormant (see [`ReplicationNode::dormancy`]) or not.
    pub(super) fn dormant_from(self, dormancy: Option<Contact>) -> LastBuild {
        LastBuild { dormant: dormancy, ..self }
    }

    /// Whether it was found dormant.
    pub(super) fn dormant(&self) -> bool {
        self.dormant.is_some()
    }

    /// Woken: a resting build again, until the next build decides anew.
    pub(super) fn wake(&mut self) {
        self.dormant = None;
    }

    /// What wakes a dormant build, if anything (the wake counter's label):
    /// the node `contact` moved (a peer it waits on was heard from, or
    /// another went silent), its activity moved, or its `progress` moved
    /// and waited its turn ([`PROGRESS_REPORT_EVERY`]). None: it still says
    /// what a report built now would. Two loads and a comparison: a node
    /// down leaves thousands of them, and this is all a look at one costs.
    /// Unlike a resting build, it has no [`LONG_SILENT_REPORT_EVERY`]: the
    /// only fields that could move without any of these (retention's first
    /// seqno; a disk filling up, as for a settled replica) wait for the next
    /// full report.
    pub(super) fn wakes(&self, activity: u64, progress: u64, contact: Contact) -> Option<&'static str> {
        match () {
            _ if self.dormant != Some(contact) => Some("peer_contact"),
            _ if self.activity != activity => Some("activity"),
            _ if self.progress != progress && self.at.elapsed() >= PROGRESS_REPORT_EVERY => Some("progress"),
            _ => None,
        }
    }

    /// Whether it rests (see [`Silences::resting`]): the heartbeat loop
    /// looks at it again on the next quarter-second tick, or once touched.
    pub(super) fn rests(&self) -> bool {
        self.resting
    }

    /// Whether a report built now would differ from this one only in its
    /// positions, and this one is under [`PROGRESS_REPORT_EVERY`] old: the
    /// same `standing` and silences alike (`now`).
    pub(super) fn only_progress_since<'s>(
        &self,
        standing: Standing,
        long_ms: u64,
        now: impl FnOnce() -> &'s Silences,
    ) -> bool {
        self.standing == standing && self.at.elapsed() < PROGRESS_REPORT_EVERY && self.silences == now().key(long_ms)
    }

    /// Whether a report built now would say the same as this one (or
    /// differ only in progress it reports later): the activity did not
    /// move, nor the `progress` once this one is [`PROGRESS_REPORT_EVERY`]
    /// old, it is under [`LONG_SILENT_REPORT_EVERY`] old, and the silences
    /// (`now`, looked at only on a `resting_look` tick when it rests) are
    /// alike.
    pub(super) fn says_the_same<'s>(
        &self,
        activity: u64,
        progress: u64,
        resting_look: bool,
        long_ms: u64,
        now: impl FnOnce() -> &'s Silences,
    ) -> bool {
        let age = self.at.elapsed();
        self.activity == activity
            && (self.progress == progress || age < PROGRESS_REPORT_EVERY)
            && age < LONG_SILENT_REPORT_EVERY
            && ((self.resting && !resting_look) || self.silences == now().key(long_ms))
    }
}

/// A silence (ms) as the coordinator tells silences apart, `timeout_ms` the
/// replication timeout its liveness rules compare them with
/// (`control/liveness.rs`): in quarter seconds, and on either side of the
/// timeout. A report changes, and goes out at the next tick, when a
/// silence crosses the timeout: in quarter seconds alone, a follower's
/// report that its leader had been silent past the default 600 ms reached
/// the coordinator only once the silence reached 750 ms, a sixth of a
/// second more before a crashed leader's shards failed over.
pub(crate) fn silence_class(ms: u64, timeout_ms: u64) -> u64 {
    ms / 250 * 2 + u64::from(ms > timeout_ms)
}

/// A leader's silence towards one of its followers (ms) as the coordinator
/// tells them apart, `timeout_ms` the replication timeout: within it or
/// past it, nothing finer. No coordinator decision reads a leader's
/// follower silences; its views count a follower stale past the timeout
/// and date its position from the silence plus the report's age, which
/// stays true while the report is not resent. In quarter seconds, every
/// leader of a lost node's followers re-sent its report four times on the
/// way to the timeout (6,666 reports and as many reconcile visits at
/// 10,000 shards), in the middle of the failover.
pub(crate) fn follower_silence_class(ms: u64, timeout_ms: u64) -> u64 {
    u64::from(ms > timeout_ms)
}

/// How long a replica's peers have been silent: a follower's leader, a
/// leader's followers (those it ever heard from).
pub(super) struct Silences {
    /// A follower's leader (0 on a leader, or with none).
    pub(super) leader: NodeId,
    /// A leader's followers never heard from in its leadership: left out
    /// of its report (nothing to say yet), counted for dormancy.
    pub(super) unheard: Vec<NodeId>,
    pub(super) leader_ms: u64,
    pub(super) followers: BTreeMap<NodeId, u64>,
}

impl Silences {
    /// The silences as the coordinator tells them apart: by
    /// [`silence_class`] and [`follower_silence_class`] (as heartbeat
    /// digests compare them), and all alike once past `long_ms`, twice the
    /// replication timeout the coordinator compares them with. A silence
    /// that ends (the peer heard again) changes it.
    fn key(&self, long_ms: u64) -> u64 {
        use std::hash::{Hash, Hasher};
        let bucket =
            |ms: u64, class: fn(u64, u64) -> u64| if ms >= long_ms { u64::MAX } else { class(ms, long_ms / 2) };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        bucket(self.leader_ms, silence_class).hash(&mut hasher);
        for (id, &ms) in &self.followers {
            (id, bucket(ms, follower_silence_class)).hash(&mut hasher);
        }
        hasher.finish()
    }

    /// A peer has been silent past `long_ms` (down, or cut off), and, on a
    /// follower, not a leader that might be going silent right now (the
    /// coordinator waits for that report to fail the leader over). Such a
    /// replica's report changes only when a silence ends, and a quarter
    /// second late is soon enough for that: while a node is down, looking
    /// at each of its thousands of shards every tick to learn nothing took
    /// a tenth of a core.
    fn resting(&self, long_ms: u64) -> bool {
        let long = |ms: u64| ms >= long_ms;
        long(self.leader_ms) || (self.leader_ms == 0 && self.followers.values().any(|&ms| long(ms)))
    }

    /// The peers silent past `long_ms`: its leader, or its followers.
    fn long_silent(&self, long_ms: u64) -> impl Iterator<Item = NodeId> + '_ {
        let leader = (self.leader != 0 && self.leader_ms >= long_ms).then_some(self.leader);
        leader.into_iter().chain(self.followers.iter().filter(move |(_, ms)| **ms >= long_ms).map(|(&id, _)| id))
    }
}

impl ReplicationNode {
    /// `replica`'s [`Silences`] as of `now` (µs since the epoch).
    pub(super) fn silences(&self, replica: &ShardReplica, now: u64) -> Silences {
        let mut followers = BTreeMap::new();
        let mut unheard = Vec::new();
        if let Some(leader) = replica.leader_state() {
            let quiet = leader.quiet.lock().clone();
            let core = leader.core.lock();
            for (id, progress) in core.followers() {
                // A quiet follower was last heard by its link.
                let link = quiet.get(&id).and_then(|l| l.credit(replica.shard));
                match progress.last_reply_us.max(link) {
                    Some(heard) => _ = followers.insert(id, now.saturating_sub(heard) / 1_000),
                    None => unheard.push(id),
                }
            }
        }
        let (leader, leader_ms) = match replica.view().role {
            Role::Follower { leader } => (leader, now.saturating_sub(self.leader_heard_us(replica)) / 1_000),
            _ => (0, 0),
        };
        Silences { leader, unheard, leader_ms, followers }
    }

    /// Whether `replica`, just reported with `silences` and `at_rest`
    /// (nothing of its own in flight: see the heartbeat loop), is dormant:
    /// some peer is silent past `long_ms` (or, a follower, never heard
    /// from), and every such peer is a node this node has not heard from at
    /// all for as long. Its report can then change only with its activity,
    /// its progress, or the node contact (one of those nodes heard from
    /// again, another node silent past the replication timeout, half of
    /// `long_ms`); answers that contact, to compare with.
    pub(super) fn dormancy(&self, silences: &Silences, long_ms: u64, at_rest: bool) -> Option<Contact> {
        let waits = silences.resting(long_ms) || !silences.unheard.is_empty();
        if !at_rest || !waits {
            return None;
        }
        // Read before awaiting: a return after it moves the count.
        let contact = self.node_contact(long_ms);
        let silent_since = now_us().saturating_sub(long_ms * 1_000);
        let mut peers = silences.long_silent(long_ms).chain(silences.unheard.iter().copied());
        peers.all(|node| self.contact.await_return(node, silent_since)).then_some(contact)
    }

    /// The node contact dormant replicas compare, `long_ms` twice the
    /// replication timeout.
    pub(super) fn node_contact(&self, long_ms: u64) -> Contact {
        self.contact.contact(now_us().saturating_sub(long_ms / 2 * 1_000))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A follower's silences: its leader, node 2, silent `leader_ms`.
    fn follower(leader_ms: u64) -> Silences {
        Silences { leader: 2, unheard: vec![], leader_ms, followers: BTreeMap::new() }
    }

    /// A leader's silences: each follower's (node, ms).
    fn leader(followers: &[(NodeId, u64)]) -> Silences {
        Silences { leader: 0, unheard: vec![], leader_ms: 0, followers: followers.iter().copied().collect() }
    }

    #[test]
    fn silences_differ_in_quarter_seconds_or_at_the_timeout_until_long_then_only_when_one_ends() {
        let silences = |leader_ms: u64, followers: &[(u32, u64)]| Silences {
            followers: followers.iter().copied().collect(),
            ..follower(leader_ms)
        };
        let long = 1_200;
        let key = |s: Silences| s.key(long);
        assert_eq!(key(silences(10, &[])), key(silences(240, &[])));
        assert_ne!(key(silences(240, &[])), key(silences(250, &[])));
        // Crossing the replication timeout (half of `long`) within a
        // quarter second counts too: the coordinator compares with it.
        assert_eq!(key(silences(500, &[])), key(silences(600, &[])));
        assert_ne!(key(silences(600, &[])), key(silences(601, &[])));
        assert_ne!(key(silences(0, &[(2, 600)])), key(silences(0, &[(2, 601)])));
        // A follower's silence counts only on either side of the timeout.
        assert_eq!(key(silences(0, &[(2, 10)])), key(silences(0, &[(2, 600)])));
        assert_eq!(key(silences(0, &[(2, 601)])), key(silences(0, &[(2, 1_199)])));
        // Past `long` all alike, until the peer is heard again.
        assert_eq!(key(silences(1_200, &[])), key(silences(90_000, &[])));
        assert_ne!(key(silences(90_000, &[])), key(silences(0, &[])));
        assert_eq!(key(silences(0, &[(2, 5_000), (3, 10)])), key(silences(0, &[(2, 60_000), (3, 200)])));
        assert_ne!(key(silences(0, &[(2, 60_000), (3, 200)])), key(silences(0, &[(2, 100), (3, 200)])));
        // Resting: a silence past `long`, but never a follower whose leader
        // might be going silent now.
        assert!(silences(5_000, &[]).resting(long));
        assert!(silences(0, &[(2, 5_000), (3, 10)]).resting(long));
        assert!(!silences(700, &[]).resting(long));
        assert!(!silences(0, &[(2, 100), (3, 10)]).resting(long));
        assert!(!silences(0, &[]).resting(long));
    }

    fn following() -> Standing {
        Standing {
            role: Role::Follower { leader: 2 },
            epoch: 4,
            needs_new_epoch: false,
            disk_full: false,
            corrupt_from: None,
            quiet: false,
        }
    }

    #[test]
    fn progress_alone_waits_its_turn_and_anything_else_is_reported_at_once() {
        let long = 1_200;
        let heard = follower(10);
        let leader_silent = follower(300);
        let built = LastBuild::new(7, 40, following(), &heard, long);
        assert!(built.only_progress_since(following(), long, || &heard), "appends alone: not yet");
        for changed in [
            Standing { epoch: 5, ..following() },
            Standing { role: Role::Leader, ..following() },
            Standing { role: Role::Follower { leader: 3 }, ..following() },
            Standing { role: Role::Unassigned, ..following() },
            Standing { needs_new_epoch: true, ..following() },
            Standing { disk_full: true, ..following() },
            Standing { corrupt_from: Some(9), ..following() },
            Standing { quiet: true, ..following() },
        ] {
            assert!(!built.only_progress_since(changed, long, || &heard), "{changed:?} is reported at once");
        }
        assert!(
            !built.only_progress_since(following(), long, || &leader_silent),
            "a leader going silent is reported at once"
        );
        let old = LastBuild { at: Instant::now() - PROGRESS_REPORT_EVERY, ..built };
        assert!(!old.only_progress_since(following(), long, || &heard), "progress is reported every quarter second");
    }

    #[test]
    fn a_build_says_the_same_until_its_activity_or_silences_move() {
        let long = 1_200;
        let quiet_follower = follower(100);
        let later = follower(300);
        let built = LastBuild::new(7, 40, following(), &quiet_follower, long);
        assert!(built.says_the_same(7, 40, false, long, || &quiet_follower));
        assert!(!built.says_the_same(8, 40, false, long, || &quiet_follower), "activity moved");
        assert!(!built.says_the_same(7, 40, false, long, || &later));
        // A resting replica's silences are looked at only on a resting look.
        let dead_leader = follower(5_000);
        let long_dead = follower(60_000);
        let resting = LastBuild::new(7, 40, following(), &dead_leader, long);
        assert!(resting.says_the_same(7, 40, false, long, || unreachable!("not looked at between looks")));
        assert!(!resting.says_the_same(7, 40, true, long, || &quiet_follower), "its leader was heard again");
        assert!(resting.says_the_same(7, 40, true, long, || &long_dead));
    }

    /// A dormant build stays so, at any age, until its activity moves, its
    /// progress moves and waited its quarter second, or a peer returns (the
    /// contact's count moved); woken, it is a resting build again.
    #[test]
    fn a_dormant_build_waits_for_its_activity_its_progress_or_a_return() {
        let long = 1_200;
        let seen = Contact { returns: 5, silent: 1 };
        let moved = Contact { returns: 6, silent: 1 };
        let silent = Contact { returns: 5, silent: 2 };
        let dead_follower = leader(&[(2, 10), (3, 60_000)]);
        assert_eq!(dead_follower.long_silent(long).collect::<Vec<_>>(), [3]);
        let dead_leader = follower(5_000);
        assert_eq!(dead_leader.long_silent(long).collect::<Vec<_>>(), [2]);
        let built = LastBuild {
            at: Instant::now() - LONG_SILENT_REPORT_EVERY * 60,
            ..LastBuild::new(7, 40, following(), &dead_follower, long).dormant_from(Some(seen))
        };
        assert!(built.dormant() && built.rests());
        assert_eq!(built.wakes(7, 40, seen), None, "a minute old and nothing moved: no rebuild");
        assert_eq!(built.wakes(8, 40, seen), Some("activity"));
        assert_eq!(built.wakes(7, 41, seen), Some("progress"));
        assert_eq!(built.wakes(7, 40, moved), Some("peer_contact"));
        assert_eq!(built.wakes(8, 40, moved), Some("peer_contact"), "a moved contact is named first");
        assert_eq!(built.wakes(7, 40, silent), Some("peer_contact"), "another node went silent");
        let fresh = LastBuild::new(7, 40, following(), &dead_follower, long).dormant_from(Some(seen));
        assert_eq!(fresh.wakes(7, 41, seen), None, "progress waits its quarter second");
        let mut woken = built;
        woken.wake();
        assert!(!woken.dormant() && woken.rests());
        assert!(!LastBuild::new(7, 40, following(), &dead_follower, long).dormant(), "not found dormant");
    }

    /// A leader's appends and acknowledgements move its commit, not its
    /// activity: its report goes out again once the commit moved and the
    /// last one is a quarter second old, resting or not.
    #[test]
    fn a_moved_commit_is_reported_every_quarter_second() {
        let long = 1_200;
        let heard = leader(&[(2, 10), (3, 20)]);
        let built = LastBuild::new(7, 40, following(), &heard, long);
        assert!(built.says_the_same(7, 90, false, long, || &heard), "under a quarter second: later");
        let old = LastBuild { at: Instant::now() - PROGRESS_REPORT_EVERY, ..built };
        assert!(old.says_the_same(7, 40, false, long, || &heard), "nothing moved");
        assert!(!old.says_the_same(7, 90, false, long, || &heard), "the commit moved");
        assert!(!old.only_progress_since(following(), long, || &heard), "and it is built");
        let dead_follower = leader(&[(2, 10), (3, 60_000)]);
        let resting = LastBuild {
            at: Instant::now() - PROGRESS_REPORT_EVERY,
            ..LastBuild::new(7, 40, following(), &dead_follower, long)
        };
        assert!(!resting.says_the_same(7, 90, false, long, || &dead_follower), "resting, with a follower silent");
    }
}
