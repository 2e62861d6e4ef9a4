//! PostgreSQL: a primary with two streaming standbys, synchronous commit.
//!
//! # What runs
//!
//! Three servers from the same binaries, each under `dir`: `primary`
//! (created by `initdb`), and standbys `s1` and `s2` (cloned from the
//! primary with `pg_basebackup -X stream -R`). Every server listens on its
//! own loopback TCP port only (`unix_socket_directories = ''`: socket
//! paths are length-limited and the temporary directories are deep).
//!
//! # Durability: the same as walship `QUORUM` on RF=3
//!
//! The primary runs with `fsync = on`, `synchronous_commit = on` and
//! `synchronous_standby_names = 'ANY 1 (s1, s2)'`. A commit is therefore
//! acknowledged only after the primary has flushed its WAL and at least one
//! of the two standbys has flushed it too: two of three copies are on disk,
//! exactly what walship promises for a `QUORUM` append with three replicas.
//! Each benchmark insert runs in autocommit, so every append is one such
//! commit. `wal_sync_method` and `full_page_writes` keep their defaults.
//!
//! # The `application_name` trap
//!
//! `pg_basebackup -R` writes `primary_conninfo` into
//! `postgresql.auto.conf`, which overrides `postgresql.conf`, and that
//! connection string carries no `application_name`. Both standbys then
//! report themselves as `walreceiver`, neither matches `s1`/`s2` in the
//! synchronous list, and every commit waits forever. [`start`] therefore
//! rewrites that line to add `application_name=sN`, and only returns once
//! `pg_stat_replication` on the primary shows both `s1` and `s2` with
//! `sync_state = 'quorum'`.
//!
//! # Fairness decisions
//!
//! * The table is `log (id bigint generated always as identity, payload
//!   bytea not null)` with **no index** (not even a primary key): an
//!   append-only heap is the most favourable shape PostgreSQL has for this
//!   workload, so it is not charged for B-tree maintenance walship does not
//!   do.
//! * `payload` uses `storage external`: values are stored (and TOASTed when
//!   large) uncompressed. The benchmark payloads are random, so pglz would
//!   only burn CPU trying to compress them.
//! * `max_wal_size = 8GB` and `checkpoint_timeout = 30min` keep checkpoints
//!   (and the full-page-image burst after each) out of the short
//!   measurement cells; walship's segment rolls are not comparable work.
//! * `shared_buffers = 256MB`, `max_connections = 300` (the benchmark runs
//!   up to 256 clients, one connection each, since a PostgreSQL session
//!   runs one statement at a time).
//!
//! # Rebuilding a standby ([`rebuild_standby`], `walship-rebuild`)
//!
//! A lone primary (the settings above, without the synchronous standbys)
//! is loaded with random rows through one binary `COPY`, checkpointed, and
//! cloned with `pg_basebackup -X stream --checkpoint=fast` into a fresh
//! directory: the way a lost standby is rebuilt. The clone is timed from
//! start to exit (`pg_basebackup` fsyncs it before exiting), and its size
//! is the sum of the file sizes it wrote.
//!
//! # Running as root
//!
//! `initdb` refuses to run as root. When the harness is root (as in CI),
//! `initdb`, `postgres` and `pg_basebackup` run as the OS user `postgres`
//! (created by the Debian package), and `dir` is handed to that user.

use std::ffi::{CStr, CString};
use std::os::unix::fs::{MetadataExt, lchown};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use tokio_postgres::{Client, NoTls, Statement};

use crate::proc::{Server, free_port};
use crate::system::{Appender, Cluster};

/// Where Debian installs the server binaries, one directory per major.
const DEBIAN_ROOT: &str = "/usr/lib/postgresql";
/// Appended to every "binaries not found" error.
const INSTALL_HINT: &str = "install the Debian package `postgresql` (apt-get install postgresql), \
     or point bin_dir at a directory holding initdb, postgres and pg_basebackup";
/// The synchronous standbys' names (their `application_name`).
const STANDBYS: [&str; 2] = ["s1", "s2"];
/// How long each server may take to accept queries, and the standbys to
/// become quorum-synchronous.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `initdb` / `pg_basebackup` may run.
const TOOL_TIMEOUT: Duration = Duration::from_secs(180);
/// At most this many client connections are being opened at once.
const MAX_CONCURRENT_CONNECTS: usize = 32;
const INSERT: &str = "insert into log (payload) values ($1)";

/// Where the PostgreSQL server binaries are (`initdb`, `postgres`,
/// `pg_basebackup`); `None` picks the newest `/usr/lib/postgresql/*/bin`.
#[derive(Debug, Clone, Default)]
pub struct PgOptions {
    pub bin_dir: Option<PathBuf>,
}

/// Starts the three servers under `dir` (fresh) and returns once the
/// primary reports both standbys as quorum-synchronous.
pub async fn start(dir: &Path, opts: &PgOptions) -> Result<Box<dyn Cluster>> {
    Ok(Box::new(start_cluster(dir, opts).await?))
}

/// One running server.
struct Node {
    port: u16,
    log: PathBuf,
    server: Server,
}

/// The primary and its two standbys. Field order matters: dropping stops
/// the standbys first, then the primary (each through `Server`'s `Drop`).
struct PgCluster {
    standbys: Vec<Node>,
    primary: Node,
}

impl PgCluster {
    #[cfg(test)]
    fn pids(&self) -> Vec<u32> {
        self.standbys.iter().chain([&self.primary]).map(|n| n.server.pid()).collect()
    }
}

#[async_trait]
impl Cluster for PgCluster {
    fn copies(&self) -> f64 {
        3.0
    }

    async fn appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
        let port = self.primary.port;
        futures::stream::iter(0..clients)
            .map(|i| async move {
                let client = connect(port).await.with_context(|| format!("connecting client {i} to the primary"))?;
                let insert =
                    client.prepare(INSERT).await.with_context(|| format!("preparing the insert for client {i}"))?;
                Ok::<_, anyhow::Error>(Arc::new(PgAppender { client, insert }) as Arc<dyn Appender>)
            })
            .buffered(MAX_CONCURRENT_CONNECTS)
            .try_collect()
            .await
    }

    async fn stop(self: Box<Self>) -> Result<()> {
        let PgCluster { mut standbys, mut primary } = *self;
        tokio::task::spawn_blocking(move || {
            let mut errors = Vec::new();
            for node in standbys.iter_mut().chain([&mut primary]) {
                if let Err(e) = node.server.stop() {
                    errors.push(format!("{e:#} (log: {})", node.log.display()));
                }
            }
            if errors.is_empty() { Ok(()) } else { bail!("stopping PostgreSQL: {}", errors.join("; ")) }
        })
        .await?
    }
}

/// One client: its own connection and prepared insert. Each `append` is an
/// autocommit insert, acknowledged after the synchronous-commit wait.
struct PgAppender {
    client: Client,
    insert: Statement,
}

#[async_trait]
impl Appender for PgAppender {
    async fn append(&self, payload: Bytes) -> Result<()> {
        let payload: &[u8] = &payload;
        let rows = self.client.execute(&self.insert, &[&payload]).await.context("insert into log")?;
        ensure!(rows == 1, "insert into log reported {rows} rows");
        Ok(())
    }
}

/// The OS user the servers run as when the harness is root.
struct RunAs {
    uid: u32,
    gid: u32,
    home: PathBuf,
}

/// The binaries, the OS user they run as, and the (fresh, canonical) base
/// directory every server and tool of one run works under.
struct PgEnv {
    bin: PathBuf,
    run_as: Option<RunAs>,
    dir: PathBuf,
}

/// Finds the binaries and the user, and wipes, creates and (as root) hands
/// `dir` to that user.
fn prepare(dir: &Path, opts: &PgOptions) -> Result<PgEnv> {
    let bin = find_bin_dir(opts)?;
    let run_as = run_as()?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("wiping {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = dir.canonicalize()?;
    if let Some(user) = &run_as {
        check_traversable(&dir, user)?;
        lchown(&dir, Some(user.uid), Some(user.gid)).with_context(|| format!("chown {}", dir.display()))?;
    }
    Ok(PgEnv { bin, run_as, dir })
}

impl PgEnv {
    /// `initdb`s `dir/primary`, configures it (the settings the module docs
    /// describe, then `extra_conf`), and starts it on a free port.
    async fn start_primary(&self, extra_conf: &str) -> Result<Node> {
        let primary_dir = self.dir.join("primary");
        let mut initdb = pg_command(&self.bin.join("initdb"), self.run_as.as_ref(), &self.dir);
        initdb.arg("-D").arg(&primary_dir).args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C"]);
        initdb.arg("--no-instructions");
        run_tool(initdb, "initdb").await?;

        let port = free_port()?;
        append_file(
            &primary_dir.join("postgresql.conf"),
            &format!(
                "\n# walship-compare (ops/bench/src/pg.rs)\n\
                 listen_addresses = '127.0.0.1'\n\
                 port = {port}\n\
                 unix_socket_directories = ''\n\
                 fsync = on\n\
                 wal_level = replica\n\
                 max_wal_senders = 10\n\
                 max_replication_slots = 10\n\
                 max_connections = 300\n\
                 shared_buffers = 256MB\n\
                 # Large enough that no checkpoint (and no full-page-write burst after\n\
                 # one) lands inside a short measurement cell.\n\
                 max_wal_size = 8GB\n\
                 checkpoint_timeout = 30min\n\
                 {extra_conf}"
            ),
        )?;
        std::fs::write(
            primary_dir.join("pg_hba.conf"),
            "# walship-compare: loopback TCP only, no passwords.\n\
             host all all 127.0.0.1/32 trust\n\
             host replication all 127.0.0.1/32 trust\n",
        )?;
        start_node(&self.bin, self.run_as.as_ref(), &self.dir, "primary", port).await
    }

    /// `pg_basebackup -X stream --checkpoint=fast` (plus `extra_args`) of
    /// the server on `port` into `dir/name`.
    async fn basebackup(&self, port: u16, name: &str, extra_args: &[&str]) -> Result<PathBuf> {
        let target = self.dir.join(name);
        let mut basebackup = pg_command(&self.bin.join("pg_basebackup"), self.run_as.as_ref(), &self.dir);
        basebackup
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres", "-D"])
            .arg(&target)
            .args(["-X", "stream", "--checkpoint=fast"])
            .args(extra_args);
        run_tool(basebackup, &format!("pg_basebackup for {name}")).await?;
        Ok(target)
    }
}

async fn start_cluster(dir: &Path, opts: &PgOptions) -> Result<PgCluster> {
    let env = prepare(dir, opts)?;
    let primary = env
        .start_primary(&format!(
            "synchronous_commit = on\nsynchronous_standby_names = 'ANY 1 ({})'\n",
            STANDBYS.join(", ")
        ))
        .await?;
    let primary_port = primary.port;

    // Standbys.
    let mut standbys = Vec::new();
    for name in STANDBYS {
        let standby_dir = env.basebackup(primary_port, name, &["-R"]).await?;
        let port = free_port()?;
        set_application_name(&standby_dir.join("postgresql.auto.conf"), name)?;
        append_file(
            &standby_dir.join("postgresql.conf"),
            &format!("\n# walship-compare: standby {name}\nport = {port}\nhot_standby = on\n"),
        )?;
        standbys.push(start_node(&env.bin, env.run_as.as_ref(), &env.dir, name, port).await?);
    }

    let mut cluster = PgCluster { standbys, primary };
    let client = connect(primary_port).await.context("connecting to the primary")?;
    wait_for_quorum(&mut cluster, &client).await?;
    create_log_table(&client).await?;
    Ok(cluster)
}

/// What rebuilding a standby with `pg_basebackup` took ([`rebuild_standby`]).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Basebackup {
    /// Payload bytes loaded into the primary before the backup.
    pub loaded_bytes: u64,
    /// Rows of `record_bytes` each that carried them.
    pub rows: u64,
    /// `pg_total_relation_size('log')` after the load (heap and TOAST).
    pub table_bytes: u64,
    /// The data directory `pg_basebackup` produced: the sum of its
    /// regular files' sizes.
    pub backup_bytes: u64,
    /// Wall time of `pg_basebackup`, from start to exit (it fsyncs the
    /// new directory before exiting).
    pub seconds: f64,
    /// `backup_bytes` MiB ÷ `seconds`.
    pub mib_per_s: f64,
}

/// Rebuilds a standby from scratch the way PostgreSQL does it: a primary
/// under `dir` (fresh, no standbys, otherwise configured as in the module
/// docs) is loaded with `bytes` of random payload in rows of
/// `record_bytes` (table `log`, `storage external`, one binary `COPY`),
/// checkpointed, and then `pg_basebackup -X stream --checkpoint=fast`
/// copies it into a fresh directory, timed. Every server it started is
/// stopped before it returns.
pub async fn rebuild_standby(dir: &Path, opts: &PgOptions, bytes: u64, record_bytes: usize) -> Result<Basebackup> {
    ensure!(bytes > 0 && record_bytes > 0, "nothing to load ({bytes} bytes in rows of {record_bytes})");
    let env = prepare(dir, opts)?;
    let mut primary = env.start_primary("").await?;
    let measured = load_and_back_up(&env, primary.port, bytes, record_bytes).await;
    let log = primary.log.clone();
    let stopped = tokio::task::spawn_blocking(move || primary.server.stop()).await?;
    let measured = measured.with_context(|| format!("primary log: {}", log.display()))?;
    stopped.with_context(|| format!("stopping the primary (log: {})", log.display()))?;
    Ok(measured)
}

async fn load_and_back_up(env: &PgEnv, port: u16, bytes: u64, record_bytes: usize) -> Result<Basebackup> {
    use rand::RngCore;
    use tokio_postgres::binary_copy::BinaryCopyInWriter;
    use tokio_postgres::types::Type;

    let client = connect(port).await.context("connecting to the primary")?;
    create_log_table(&client).await?;
    let rows = bytes.div_ceil(record_bytes as u64);
    let sink = client.copy_in("copy log (payload) from stdin binary").await.context("starting copy into log")?;
    let writer = BinaryCopyInWriter::new(sink, &[Type::BYTEA]);
    futures::pin_mut!(writer);
    let mut payload = vec![0u8; record_bytes];
    let mut rng = rand::thread_rng();
    for _ in 0..rows {
        rng.fill_bytes(&mut payload);
        writer.as_mut().write(&[&payload.as_slice()]).await.context("copying rows into log")?;
    }
    let copied = writer.finish().await.context("finishing copy into log")?;
    ensure!(copied == rows, "copy into log stored {copied} of {rows} rows");
    client.batch_execute("checkpoint").await.context("checkpoint")?;
    let table_bytes: i64 =
        client.query_one("select pg_total_relation_size('log')", &[]).await.context("measuring table log")?.get(0);
    drop(client);

    // SAFETY: sync(2) takes no arguments and cannot fail. The backup starts
    // on a quiet disk, not behind the load's writeback.
    tokio::task::spawn_blocking(|| unsafe { libc::sync() }).await?;
    let started = Instant::now();
    let target = env.basebackup(port, "standby", &[]).await?;
    let seconds = started.elapsed().as_secs_f64();
    let backup_bytes = tokio::task::spawn_blocking(move || tree_bytes(&target)).await??;
    Ok(Basebackup {
        loaded_bytes: rows * record_bytes as u64,
        rows,
        table_bytes: table_bytes as u64,
        backup_bytes,
        seconds,
        mib_per_s: backup_bytes as f64 / (1 << 20) as f64 / seconds,
    })
}

/// The sum of the sizes of the regular files under `dir` (symlinks are not
/// followed), as `du --apparent-size` counts them.
pub fn tree_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(at) = pending.pop() {
        for entry in std::fs::read_dir(&at).with_context(|| format!("listing {}", at.display()))? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                pending.push(entry.path());
            } else if meta.is_file() {
                total += meta.len();
            }
        }
    }
    Ok(total)
}

/// The benchmark table (see the module docs: no index, `storage external`).
async fn create_log_table(client: &Client) -> Result<()> {
    client
        .batch_execute(
            "create table log (id bigint generated always as identity, payload bytea not null);
             alter table log alter column payload set storage external;",
        )
        .await
        .context("creating table log")
}

/// Rewrites the `primary_conninfo` that `pg_basebackup -R` wrote so the
/// standby reports itself as `name` (see the module docs), and drops any
/// `port` / `hot_standby` line so `postgresql.conf` decides those.
fn set_application_name(auto_conf: &Path, name: &str) -> Result<()> {
    let text = std::fs::read_to_string(auto_conf).with_context(|| format!("reading {}", auto_conf.display()))?;
    let mut out = String::new();
    let mut rewritten = false;
    for line in text.lines() {
        let key = line.split('=').next().unwrap_or("").trim();
        match key {
            "primary_conninfo" => {
                let Some(quote) = line.find('\'') else {
                    bail!("unexpected primary_conninfo line in {}: {line}", auto_conf.display());
                };
                out.push_str(&line[..=quote]);
                out.push_str(&format!("application_name={name} "));
                out.push_str(&line[quote + 1..]);
                out.push('\n');
                rewritten = true;
            }
            "port" | "hot_standby" => {}
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    ensure!(rewritten, "pg_basebackup -R wrote no primary_conninfo into {}", auto_conf.display());
    // Writing into the existing file keeps its owner.
    std::fs::write(auto_conf, out).with_context(|| format!("writing {}", auto_conf.display()))
}

/// Starts `postgres -D dir/name` (log `dir/name.log`) and waits until it
/// answers queries on `port`.
async fn start_node(bin: &Path, run_as: Option<&RunAs>, dir: &Path, name: &str, port: u16) -> Result<Node> {
    let log = dir.join(format!("{name}.log"));
    let mut command = pg_command(&bin.join("postgres"), run_as, dir);
    command.arg("-D").arg(dir.join(name));
    // SIGINT = fast shutdown: abort sessions, write a shutdown checkpoint.
    let server = Server::spawn(&format!("postgres {name}"), command, &log, libc::SIGINT)?;
    let mut node = Node { port, log, server };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let last_error = match connect(port).await {
            Ok(client) => match client.simple_query("select 1").await {
                Ok(_) => return Ok(node),
                Err(e) => anyhow::Error::from(e),
            },
            Err(e) => e,
        };
        node.server.check_running().with_context(|| format!("see {}", node.log.display()))?;
        if Instant::now() > deadline {
            bail!(
                "postgres {name} did not accept queries on 127.0.0.1:{port} within {READY_TIMEOUT:?} \
                 (last error: {last_error:#}); see {}",
                node.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the primary counts both standbys as quorum-synchronous.
async fn wait_for_quorum(cluster: &mut PgCluster, primary: &Client) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let row = primary
            .query_one(
                "select count(*) from pg_stat_replication \
                 where application_name in ('s1', 's2') and sync_state = 'quorum'",
                &[],
            )
            .await
            .context("querying pg_stat_replication")?;
        if row.get::<_, i64>(0) == 2 {
            return Ok(());
        }
        for node in cluster.standbys.iter_mut().chain([&mut cluster.primary]) {
            node.server.check_running().with_context(|| format!("see {}", node.log.display()))?;
        }
        if Instant::now() > deadline {
            let logs: Vec<String> =
                cluster.standbys.iter().chain([&cluster.primary]).map(|n| n.log.display().to_string()).collect();
            bail!(
                "the primary did not report standbys s1 and s2 as quorum-synchronous within {READY_TIMEOUT:?}; \
                 see {}",
                logs.join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A connection to the server on `port` as `postgres` to database
/// `postgres`, its driver running on a spawned task.
async fn connect(port: u16) -> Result<Client> {
    let (client, connection) = tokio_postgres::Config::new()
        .host("127.0.0.1")
        .port(port)
        .user("postgres")
        .dbname("postgres")
        .connect_timeout(Duration::from_secs(5))
        .connect(NoTls)
        .await?;
    tokio::spawn(async move {
        // Ends with an error when the server shuts down; nothing to report.
        let _ = connection.await;
    });
    Ok(client)
}

/// `opts.bin_dir`, or the newest `/usr/lib/postgresql/<major>/bin`, checked
/// to hold the three programs we run.
fn find_bin_dir(opts: &PgOptions) -> Result<PathBuf> {
    let dir = match &opts.bin_dir {
        Some(dir) => dir.clone(),
        None => newest_debian_bin_dir()?,
    };
    for program in ["initdb", "postgres", "pg_basebackup"] {
        let path = dir.join(program);
        if !path.is_file() {
            bail!("PostgreSQL server program {} not found; {INSTALL_HINT}", path.display());
        }
    }
    Ok(dir)
}

fn newest_debian_bin_dir() -> Result<PathBuf> {
    let mut best: Option<(Vec<u32>, PathBuf)> = None;
    if let Ok(entries) = std::fs::read_dir(DEBIAN_ROOT) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Ok(version) = name.split('.').map(str::parse).collect::<Result<Vec<u32>, _>>() else { continue };
            let bin = entry.path().join("bin");
            if bin.join("postgres").is_file() && best.as_ref().is_none_or(|(v, _)| version > *v) {
                best = Some((version, bin));
            }
        }
    }
    match best {
        Some((_, bin)) => Ok(bin),
        None => bail!("no PostgreSQL server binaries under {DEBIAN_ROOT}/*/bin; {INSTALL_HINT}"),
    }
}

/// `None` when the harness is not root (servers run as the current user);
/// otherwise the OS user `postgres`.
fn run_as() -> Result<Option<RunAs>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = CString::new("postgres")?;
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; getpwnam_r fills `pwd`
    // with pointers into `buf`, which outlives their use below.
    let rc = unsafe { libc::getpwnam_r(name.as_ptr(), &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() {
        bail!(
            "running as root, which initdb refuses, and there is no OS user `postgres` to run PostgreSQL as; \
             {INSTALL_HINT} (it creates that user)"
        );
    }
    // SAFETY: pw_dir points at a NUL-terminated string inside `buf`.
    let home = unsafe { CStr::from_ptr(pwd.pw_dir) }.to_string_lossy().into_owned();
    Ok(Some(RunAs { uid: pwd.pw_uid, gid: pwd.pw_gid, home: PathBuf::from(home) }))
}

/// Fails early (instead of deep inside initdb) if `user` cannot reach `dir`.
fn check_traversable(dir: &Path, user: &RunAs) -> Result<()> {
    for ancestor in dir.ancestors().skip(1) {
        let meta = std::fs::metadata(ancestor)?;
        let mode = meta.mode();
        let ok = mode & 0o001 != 0
            || (meta.uid() == user.uid && mode & 0o100 != 0)
            || (meta.gid() == user.gid && mode & 0o010 != 0);
        ensure!(
            ok,
            "{} is not traversable by the OS user `postgres` (uid {}), so PostgreSQL cannot use {}; \
             pick a directory whose parents are world-executable",
            ancestor.display(),
            user.uid,
            dir.display()
        );
    }
    Ok(())
}

/// A command for a PostgreSQL program: as `run_as` if set, in `cwd`,
/// without any inherited `PG*` variables (they would redirect libpq).
fn pg_command(program: &Path, run_as: Option<&RunAs>, cwd: &Path) -> Command {
    let mut command = Command::new(program);
    command.current_dir(cwd).env("LC_ALL", "C");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("PG") {
            command.env_remove(key);
        }
    }
    if let Some(user) = run_as {
        command.uid(user.uid).gid(user.gid).env("HOME", &user.home);
    }
    command
}

/// Runs a one-shot program to completion; fails with its output.
async fn run_tool(command: Command, what: &str) -> Result<()> {
    let mut command = tokio::process::Command::from(command);
    command.kill_on_drop(true);
    let output = tokio::time::timeout(TOOL_TIMEOUT, command.output())
        .await
        .with_context(|| format!("{what} did not finish within {TOOL_TIMEOUT:?}"))?
        .with_context(|| format!("running {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

fn append_file(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    let mut file =
        std::fs::OpenOptions::new().append(true).open(path).with_context(|| format!("opening {}", path.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    use rand::RngCore;

    fn tmp_root() -> PathBuf {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
        std::fs::create_dir_all(&root).unwrap();
        root
    }

    fn gone(pid: u32) -> bool {
        // SAFETY: signal 0 only checks whether the process exists.
        unsafe { libc::kill(pid as i32, 0) != 0 }
    }

    async fn count(port: u16) -> Result<(i64, Option<i64>)> {
        let client = connect(port).await?;
        let row = client.query_one("select count(*), sum(length(payload)) from log", &[]).await?;
        Ok((row.get(0), row.get(1)))
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn replicates_synchronously_and_stops() {
        let tmp = tempfile::tempdir_in(tmp_root()).unwrap();
        let started = Instant::now();
        let cluster = start_cluster(tmp.path(), &PgOptions::default()).await.unwrap();
        eprintln!("cluster started in {:?}", started.elapsed());
        assert_eq!(cluster.copies(), 3.0);
        let pids = cluster.pids();
        assert_eq!(pids.len(), 3);
        assert!(pids.iter().all(|&pid| pid != 0 && !gone(pid)));

        let appenders = cluster.appenders(4).await.unwrap();
        assert_eq!(appenders.len(), 4);
        let started = Instant::now();
        futures::future::try_join_all(appenders.iter().map(|appender| async move {
            for _ in 0..25 {
                let mut payload = vec![0u8; 4096];
                rand::thread_rng().fill_bytes(&mut payload);
                appender.append(Bytes::from(payload)).await?;
            }
            Ok::<_, anyhow::Error>(())
        }))
        .await
        .unwrap();
        eprintln!("100 appends took {:?}", started.elapsed());

        assert_eq!(count(cluster.primary.port).await.unwrap(), (100, Some(409_600)));

        let primary = connect(cluster.primary.port).await.unwrap();
        let rows = primary
            .query("select application_name, state, sync_state from pg_stat_replication order by 1", &[])
            .await
            .unwrap();
        let seen: Vec<(String, String, String)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
        let expected: Vec<(String, String, String)> =
            STANDBYS.iter().map(|name| (name.to_string(), "streaming".to_string(), "quorum".to_string())).collect();
        assert_eq!(seen, expected);

        for (setting, value) in [
            ("fsync", "on"),
            ("synchronous_commit", "on"),
            ("synchronous_standby_names", "ANY 1 (s1, s2)"),
            ("max_connections", "300"),
            ("checkpoint_timeout", "30min"),
            ("max_wal_size", "8GB"),
        ] {
            let row = primary.query_one(&format!("show {setting}"), &[]).await.unwrap();
            assert_eq!(row.get::<_, String>(0), value, "{setting}");
        }
        let storage = primary
            .query_one(
                "select attstorage::text from pg_attribute where attrelid = 'log'::regclass and attname = 'payload'",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(storage.get::<_, String>(0), "e");

        let standby_port = cluster.standbys[0].port;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let seen = count(standby_port).await.unwrap();
            if seen == (100, Some(409_600)) {
                break;
            }
            assert!(Instant::now() < deadline, "standby s1 still sees {seen:?} after 10 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // The benchmark's largest client count connects (max_connections),
        // and stopping with every connection still open is clean.
        let started = Instant::now();
        let many = cluster.appenders(256).await.unwrap();
        eprintln!("256 connections took {:?}", started.elapsed());
        assert_eq!(many.len(), 256);
        many[255].append(Bytes::from_static(b"last")).await.unwrap();

        let logs: Vec<PathBuf> = cluster.standbys.iter().chain([&cluster.primary]).map(|n| n.log.clone()).collect();
        let cluster: Box<dyn Cluster> = Box::new(cluster);
        let started = Instant::now();
        cluster.stop().await.unwrap();
        eprintln!("stop took {:?}", started.elapsed());
        for pid in pids {
            assert!(gone(pid), "postgres pid {pid} still exists after stop");
        }
        for log in logs {
            let text = std::fs::read_to_string(&log).unwrap();
            assert!(text.contains("database system is shut down"), "{}:\n{text}", log.display());
        }
        assert!(many[0].append(Bytes::from_static(b"after stop")).await.is_err());
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn missing_binaries_name_the_package() {
        let tmp = tempfile::tempdir_in(tmp_root()).unwrap();
        let opts = PgOptions { bin_dir: Some(tmp.path().join("no-such-bin")) };
        let err = start(&tmp.path().join("pg"), &opts).await.err().expect("start must fail");
        let message = format!("{err:#}");
        assert!(message.contains("`postgresql`"), "{message}");
        assert!(message.contains("no-such-bin"), "{message}");
    }
}
