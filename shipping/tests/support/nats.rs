//! A throwaway `nats-server -js` for tests: loopback, a free port, its store
//! in a temp dir; killed (by its child PID) on drop.
//!
//! The binary is `$WALSHIP_NATS_SERVER`, else
//! `<workspace root>/.walship/tools/venv/bin/nats-server` (ops/test.sh
//! installs it). A missing binary fails the test: it is never skipped.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct NatsServer {
    child: Child,
    pub port: u16,
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
    dir: tempfile::TempDir,
}

/// The workspace root: the nearest ancestor of this package whose
/// Cargo.toml declares `[workspace]`.
fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|d| std::fs::read_to_string(d.join("Cargo.toml")).is_ok_and(|t| t.contains("[workspace]")))
        .unwrap_or(manifest)
        .to_path_buf()
}

pub fn nats_server_bin() -> PathBuf {
    match std::env::var_os("WALSHIP_NATS_SERVER") {
        Some(path) => PathBuf::from(path),
        None => workspace_root().join(".walship/tools/venv/bin/nats-server"),
    }
}

impl NatsServer {
    /// Starts the server and waits until its port accepts connections
    /// (JetStream is up before the client listener opens).
    pub fn start() -> NatsServer {
        let bin = nats_server_bin();
        assert!(
            bin.is_file(),
            "nats-server not found at {}: run ops/test.sh (it installs nats-server), or point WALSHIP_NATS_SERVER at one",
            bin.display()
        );
        let dir = tempfile::tempdir().expect("temp dir for nats-server");
        let mut failures = Vec::new();
        // A probed free port can be taken before the server binds it: retry.
        for attempt in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let log_path = dir.path().join(format!("nats-server-{attempt}.log"));
            let log = std::fs::File::create(&log_path).expect("nats-server log file");
            let mut child = spawn(port, dir.path(), log);
            match wait_ready(&mut child, port, Duration::from_secs(10)) {
                Ok(()) => return NatsServer { child, port, url: format!("nats://127.0.0.1:{port}"), dir },
                Err(why) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    failures.push(format!("port {port}: {why}\n{log}"));
                }
            }
        }
        panic!("nats-server did not start:\n{}", failures.join("\n"));
    }

    /// SIGKILLs the server (its clients see the connection drop).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again after [`NatsServer::kill`], on the same port
    /// and store (JetStream recovers its streams and KV buckets from it).
    pub fn restart(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("nats-server-restarted.log")).expect("log file");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut child = spawn(self.port, self.dir.path(), log.try_clone().expect("log file"));
            match wait_ready(&mut child, self.port, Duration::from_secs(10)) {
                Ok(()) => {
                    self.child = child;
                    return;
                }
                // The old listener's port may take a moment to free.
                Err(why) if Instant::now() < deadline => {
                    eprintln!("restarting nats-server on {}: {why}; again", self.port);
                    let _ = child.kill();
                    let _ = child.wait();
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(why) => panic!("nats-server did not restart on port {}: {why}", self.port),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }
}

/// Spawns `nats-server -js` on `port` with its store (and pid file) in
/// `dir`, logging to `log`.
fn spawn(port: u16, dir: &Path, log: std::fs::File) -> Child {
    let bin = nats_server_bin();
    Command::new(&bin)
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string()])
        .arg("-sd")
        .arg(dir.join("store"))
        .arg("-P")
        .arg(dir.join("nats-server.pid"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()))
}

/// Polls until `port` accepts a TCP connection, the child exits, or
/// `timeout` passes.
fn wait_ready(child: &mut Child, port: u16, timeout: Duration) -> Result<(), String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("exited with {status}"));
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("port not accepting connections after {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        // Child::kill sends SIGKILL to this child's PID.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
