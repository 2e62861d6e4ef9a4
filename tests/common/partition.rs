//! Network partitions on loopback for black-box tests: each walship process
//! of a test cluster runs as a Unix user of its own
//! ([`super::ClusterSpec::separate_users`]), and [`Partition`] cuts and heals
//! links between them with nftables rules that drop packets by socket owner
//! (`meta skuid`) and destination port.
//!
//! Why per-uid nftables rather than network namespaces with veth pairs: the
//! harness, the cluster config and every other suite address processes on
//! 127.0.0.1 with free ports, and the test process (the client) must reach
//! every node. Namespaces would need an address per process, a bridge for
//! the test process, a config written for those addresses and a namespace
//! entered before each spawn; per-uid rules keep all of that as it is, need
//! one `Command::uid` per spawn, and change a partition in one atomic
//! `nft -f` transaction. Links are told apart by (sending user, destination
//! port), so concurrent tests (nextest runs each in its own process) never
//! cut each other: their ports differ, and each [`Partition`] owns a table
//! `inet walship_<pid>_<n>` that it alone writes and that its `Drop`
//! deletes (tables left by a test process that died are deleted by the next
//! [`Partition::new`]). Users are shared between tests (`walship-n<id>`,
//! `walship-c<id>`); that is safe for the same reason.
//!
//! Cutting A↔B drops every packet a socket of A's user sends to one of B's
//! listening ports (gRPC and admin) and every packet B's user sends to A's.
//! New connections either way die at the SYN, and established ones lose
//! everything their client side sends. What rules cannot name is the server
//! side of an established connection answering the client's ephemeral port:
//! those packets still arrive, but as the client's acknowledgements are
//! dropped, the server's TCP stops sending new data after one retransmission
//! timeout (200 ms minimum on Linux). So a cut is complete within about
//! 200 ms, as a real partition is, and, as in a real one, TCP's
//! retransmission backoff can delay recovery after a heal by a few seconds.
//!
//! The clients are the test process itself (root): [`Party::Clients`] as
//! one side drops what root sends to the other side's ports. A reply from a
//! node goes to the client's ephemeral port, so that is enough for
//! request/response traffic.
//!
//! Needs root (to create users, run processes as them and change nftables)
//! and `nft` (Debian package nftables; `ops/install.sh` installs it): the
//! helper fails with a message saying so rather than skipping.

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use super::Cluster;

/// One side of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Party {
    /// `walship node` with this id.
    Node(u32),
    /// `walship coord` `c<id>`.
    Coordinator(u32),
    /// The test process (root), as every client of the cluster.
    Clients,
}

/// A Unix user a test process runs as.
#[derive(Clone, Debug)]
pub struct TestUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// The user node `id` runs as, created on first use.
pub fn node_user(id: u32) -> TestUser {
    test_user(&format!("walship-n{id}"))
}

/// The user coordinator `c<c>` runs as, created on first use.
pub fn coordinator_user(c: u32) -> TestUser {
    test_user(&format!("walship-c{c}"))
}

/// Panics with what is missing unless this process can run the partition
/// helper: root, and `nft` on the PATH.
pub fn require_prerequisites() {
    // SAFETY: geteuid(2) has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "partition tests need root: they run each walship process as a Unix user of its own and change \
         nftables rules (CI runs as root); this process runs as uid {euid}"
    );
    let nft = Command::new("nft").arg("--version").output();
    assert!(
        nft.as_ref().is_ok_and(|o| o.status.success()),
        "partition tests need nft (Debian package nftables; `ops/install.sh`'s install_nftables, which \
         ops/test.sh runs, installs it): {nft:?}"
    );
}

/// Looks `name` up in the user database, creating it as a system user
/// without a home (and its own group) when it is not there.
pub fn test_user(name: &str) -> TestUser {
    require_prerequisites();
    if let Some(user) = lookup(name) {
        return user;
    }
    let out = Command::new("useradd")
        .args(["--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name])
        .output()
        .unwrap_or_else(|e| panic!("useradd {name}: {e}"));
    // Another test process may have created it in between: what counts is
    // that it exists now.
    lookup(name).unwrap_or_else(|| {
        panic!("useradd {name} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim())
    })
}

fn lookup(name: &str) -> Option<TestUser> {
    let c_name = std::ffi::CString::new(name).unwrap();
    // SAFETY: getpwnam(3) with a valid C string; the result is read at once,
    // before any other call could reuse its static buffer (tests that look
    // users up concurrently read the same entries).
    let entry = unsafe { libc::getpwnam(c_name.as_ptr()) };
    // SAFETY: a non-null result points to a valid passwd entry.
    (!entry.is_null())
        .then(|| unsafe { TestUser { name: name.to_string(), uid: (*entry).pw_uid, gid: (*entry).pw_gid } })
}

/// Makes a cluster dir usable by processes of other users: they must read
/// the cluster config in it (a temp dir is 0700) and each writes only its
/// own data dir, which [`run_as`] hands over. Coordinators share one data
/// dir for the file KV, so several coordinators as different users need
/// NATS instead.
pub fn open_cluster_dir(dir: &Path, coordinators: u32, nats: bool) {
    require_prerequisites();
    assert!(
        coordinators <= 1 || nats,
        "separate_users with {coordinators} coordinators needs NATS: the file KV is one dir they would all write"
    );
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Makes `command` run as `user`, owning `dirs` (created when missing, and
/// handed over with everything in them: a restart finds them as it left
/// them).
pub fn run_as(command: &mut Command, user: &TestUser, dirs: &[&Path]) {
    for dir in dirs {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        chown_tree(dir, user);
    }
    // With a uid and no groups set, std drops root's supplementary groups
    // before exec: the process has exactly its own user's rights.
    command.uid(user.uid).gid(user.gid);
}

fn chown_tree(path: &Path, user: &TestUser) {
    std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid))
        .unwrap_or_else(|e| panic!("chown {} to {}: {e}", path.display(), user.name));
    if path.is_dir() && !path.is_symlink() {
        for entry in std::fs::read_dir(path).unwrap() {
            chown_tree(&entry.unwrap().path(), user);
        }
    }
}

/// Cuts and heals links between the processes of one cluster (started with
/// `separate_users`). Every change rewrites the table's rules in one
/// transaction; `Drop` deletes the table, healing everything.
pub struct Partition {
    table: String,
    parties: Vec<(Party, u32, Vec<u16>)>,
    cuts: BTreeSet<(Party, Party)>,
}

static TABLES: AtomicU32 = AtomicU32::new(0);

impl Partition {
    /// A partition helper for `cluster`'s nodes, coordinators and clients,
    /// with every link whole.
    pub fn new(cluster: &Cluster) -> Partition {
        require_prerequisites();
        assert!(cluster.separate_users, "Partition needs a cluster launched with ClusterSpec::separate_users");
        remove_stale_tables();
        let port = |addr: &str| addr.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()).unwrap();
        let mut parties = Vec::new();
        for node in &cluster.nodes {
            parties.push((
                Party::Node(node.node_id),
                node_user(node.node_id).uid,
                vec![port(&node.grpc), port(&node.admin)],
            ));
        }
        for c in &cluster.coordinators {
            parties.push((Party::Coordinator(c.id), coordinator_user(c.id).uid, vec![port(&c.grpc), port(&c.admin)]));
        }
        // SAFETY: geteuid(2) has no preconditions.
        parties.push((Party::Clients, unsafe { libc::geteuid() }, Vec::new()));
        let table = format!("walship_{}_{}", std::process::id(), TABLES.fetch_add(1, Ordering::Relaxed));
        nft(&format!(
            "add table inet {table}\n\
             add chain inet {table} output {{ type filter hook output priority 0; policy accept; }}\n"
        ));
        Partition { table, parties, cuts: BTreeSet::new() }
    }

    /// Cuts the link between `a` and `b`, both ways.
    pub fn cut(&mut self, a: Party, b: Party) {
        assert_ne!(a, b, "a party cannot be cut from itself");
        self.party(a);
        self.party(b);
        self.cuts.insert(ordered(a, b));
        self.apply();
    }

    /// Heals the link between `a` and `b`.
    pub fn heal(&mut self, a: Party, b: Party) {
        self.cuts.remove(&ordered(a, b));
        self.apply();
    }

    /// Heals every link.
    pub fn heal_all(&mut self) {
        self.cuts.clear();
        self.apply();
    }

    /// Cuts `x` from every other party: nodes, coordinators and clients.
    pub fn isolate(&mut self, x: Party) {
        let others: Vec<Party> = self.parties.iter().map(|p| p.0).filter(|&p| p != x).collect();
        for other in others {
            self.cuts.insert(ordered(x, other));
        }
        self.apply();
    }

    /// The links cut now, for a test's log.
    pub fn describe(&self) -> String {
        let links: Vec<String> = self.cuts.iter().map(|(a, b)| format!("{a:?}<->{b:?}")).collect();
        if links.is_empty() { "no cut".into() } else { links.join(", ") }
    }

    fn party(&self, p: Party) -> &(Party, u32, Vec<u16>) {
        self.parties.iter().find(|q| q.0 == p).unwrap_or_else(|| panic!("{p:?} is not part of this cluster"))
    }

    fn apply(&self) {
        let mut script = format!("flush chain inet {} output\n", self.table);
        for &(a, b) in &self.cuts {
            for (from, to) in [(a, b), (b, a)] {
                let (_, uid, _) = self.party(from);
                let (_, _, ports) = self.party(to);
                // Clients listen on no port: what they would receive are
                // replies, which the other direction's rule already stops.
                if ports.is_empty() {
                    continue;
                }
                let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
                script += &format!(
                    "add rule inet {} output oifname \"lo\" meta skuid {uid} tcp dport {{ {} }} drop\n",
                    self.table,
                    ports.join(", ")
                );
            }
        }
        nft(&script);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        if let Err(e) = try_nft(&format!("delete table inet {}\n", self.table)) {
            eprintln!("partition: could not delete nftables table {}: {e}", self.table);
        }
    }
}

fn ordered(a: Party, b: Party) -> (Party, Party) {
    if a <= b { (a, b) } else { (b, a) }
}

fn nft(script: &str) {
    try_nft(script).unwrap_or_else(|e| panic!("{e}"));
}

fn try_nft(script: &str) -> Result<(), String> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("run nft: {e}"))?;
    child.stdin.take().unwrap().write_all(script.as_bytes()).map_err(|e| format!("write to nft: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("wait for nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("nft -f failed ({}) on:\n{script}{}", out.status, String::from_utf8_lossy(&out.stderr)))
    }
}

/// Deletes tables of test processes that died without their `Drop` running
/// (a SIGKILLed test), so their rules cannot outlive them and cut a later
/// test that happens to get the same ports.
fn remove_stale_tables() {
    let Ok(out) = Command::new("nft").args(["list", "tables", "inet"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.trim().strip_prefix("table inet walship_") else { continue };
        let Some(pid) = name.split('_').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            // Another test may be deleting it at the same moment: ignore.
            let _ = try_nft(&format!("delete table inet walship_{name}\n"));
        }
    }
}
