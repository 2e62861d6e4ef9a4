//! A throwaway `s3s-fs` (a real S3-compatible HTTP server keeping objects
//! as plain files) for tests: loopback, a free port, its data in a temp
//! dir, static credentials; killed (by its child PID) on drop.
//!
//! The binary is `$WALSHIP_S3S_FS`, else
//! `<workspace root>/.walship/tools/bin/s3s-fs` (ops/test.sh installs it
//! with `install_s3s_fs`). A missing binary fails the test: it is never
//! skipped.
//!
//! s3s-fs keeps the object `<key>` of bucket `<bucket>` as the file
//! `<data dir>/<bucket>/<key>` (its metadata in hidden JSON files in the
//! data dir), so a test can damage an object's bytes on disk.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use walship_objstore::{S3Credentials, S3Settings};

// Also loaded by `tests/common` in tests that use both.
#[allow(clippy::duplicate_mod)]
#[path = "signal.rs"]
mod signal;

pub const ACCESS_KEY: &str = "walship-test";
pub const SECRET_KEY: &str = "walship-test-secret";

pub struct S3sFs {
    child: Option<Child>,
    pub port: u16,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
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

pub fn s3s_fs_bin() -> PathBuf {
    match std::env::var_os("WALSHIP_S3S_FS") {
        Some(path) => PathBuf::from(path),
        None => workspace_root().join(".walship/tools/bin/s3s-fs"),
    }
}

impl S3sFs {
    /// Starts the server and waits until its port accepts connections.
    pub fn start() -> S3sFs {
        let bin = s3s_fs_bin();
        assert!(
            bin.is_file(),
            "s3s-fs not found at {}: run ops/test.sh (it installs s3s-fs), or point WALSHIP_S3S_FS at one",
            bin.display()
        );
        let dir = tempfile::tempdir().expect("temp dir for s3s-fs");
        std::fs::create_dir_all(dir.path().join("data")).expect("s3s-fs data dir");
        let mut failures = Vec::new();
        // A probed free port can be taken before the server binds it: retry.
        for attempt in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let log_path = dir.path().join(format!("s3s-fs-{attempt}.log"));
            let log = std::fs::File::create(&log_path).expect("s3s-fs log file");
            let mut child = Command::new(&bin)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
                .arg(dir.path().join("data"))
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log file"))
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()));
            match wait_ready(&mut child, port, Duration::from_secs(10)) {
                Ok(()) => {
                    return S3sFs { child: Some(child), port, endpoint: format!("http://127.0.0.1:{port}"), dir };
                }
                Err(why) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    failures.push(format!("port {port}: {why}\n{log}"));
                }
            }
        }
        panic!("s3s-fs did not start:\n{}", failures.join("\n"));
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The data directory: bucket `b`'s object `k` is `data_dir()/b/k`.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Settings for bucket `bucket` on this server with the right
    /// credentials, path-style, and `prefix`.
    pub fn settings(&self, bucket: &str, prefix: Option<&str>) -> S3Settings {
        self.settings_with_secret(bucket, prefix, SECRET_KEY)
    }

    pub fn settings_with_secret(&self, bucket: &str, prefix: Option<&str>, secret: &str) -> S3Settings {
        let credentials =
            S3Credentials::Static { access_key_id: ACCESS_KEY.to_string(), secret_access_key: secret.to_string() };
        let mut settings = S3Settings::new(bucket, credentials);
        settings.endpoint = Some(self.endpoint.clone());
        settings.path_style = true;
        settings.prefix = prefix.map(str::to_string);
        settings
    }

    /// Kills the server (SIGKILL to its PID) now.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` (e.g. `libc::SIGSTOP`, `libc::SIGCONT`) to the
    /// server; a SIGSTOP returns once every server thread is stopped.
    pub fn signal(&self, signal: i32) {
        signal::send(self.pid(), signal);
    }
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

impl Drop for S3sFs {
    fn drop(&mut self) {
        // Child::kill sends SIGKILL to this child's PID (stopped or not).
        self.kill();
    }
}

/// Flips one byte in the middle of a file.
pub fn flip_a_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert!(!bytes.is_empty(), "{} is empty", path.display());
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}
