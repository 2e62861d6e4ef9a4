//! `walship dev` as a test starts it: on free ports (`--base-port 0`), with
//! a data dir of the test's, its printed lines collected.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::walship_bin;

/// A running `walship dev`; SIGTERM (it stops its own children) on drop.
pub struct DevProcess {
    pub child: Child,
    /// Its data dir: its nodes and coordinator are found by it.
    data: std::path::PathBuf,
    /// Every stdout line so far.
    pub lines: Vec<String>,
    rx: Receiver<String>,
    /// `WALSHIP_ADMIN` and `WALSHIP_TOKEN` of its export line.
    pub admin: String,
    pub token: String,
}

fn command(data: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(walship_bin());
    command.arg("dev");
    if !extra.contains(&"--base-port") {
        command.args(["--base-port", "0"]);
    }
    command
        .arg("--data-dir")
        .arg(data)
        .args(extra)
        .env("WALSHIP_LOG", "warn")
        .env_remove("WALSHIP_TOKEN")
        .env_remove("WALSHIP_ADMIN");
    command
}

/// Runs `walship dev` expecting it to stop by itself (a refused start).
pub fn run_to_end(data: &Path, extra: &[&str]) -> Output {
    command(data, extra).stdin(Stdio::null()).output().expect("run walship dev")
}

impl DevProcess {
    /// Starts it and waits (up to 120 s) for its last start-up line.
    pub fn start(data: &Path, extra: &[&str]) -> DevProcess {
        let mut child = command(data, extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn walship dev");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut dev = DevProcess {
            child,
            data: data.to_path_buf(),
            lines: Vec::new(),
            rx,
            admin: String::new(),
            token: String::new(),
        };
        dev.wait_printed("Ctrl-C stops the cluster", Duration::from_secs(120));
        let export = dev
            .lines
            .iter()
            .find_map(|l| l.trim().strip_prefix("export "))
            .unwrap_or_else(|| panic!("no export line:\n{}", dev.output()))
            .to_string();
        for word in export.split_whitespace() {
            match word.split_once('=') {
                Some(("WALSHIP_ADMIN", v)) => dev.admin = v.to_string(),
                Some(("WALSHIP_TOKEN", v)) => dev.token = v.to_string(),
                _ => panic!("unexpected word {word:?} in the export line {export:?}"),
            }
        }
        assert!(!dev.admin.is_empty() && !dev.token.is_empty(), "export line {export:?}");
        dev
    }

    pub fn output(&self) -> String {
        self.lines.join("\n")
    }

    pub fn printed(&self, text: &str) -> bool {
        self.lines.iter().any(|l| l.contains(text))
    }

    /// Collects lines until one contains `text`; panics after `timeout`.
    pub fn wait_printed(&mut self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.printed(text) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => self.lines.push(line),
                Err(RecvTimeoutError::Timeout) => {
                    panic!("walship dev printed no {text:?} in {timeout:?}:\n{}", self.output())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("walship dev ended before printing {text:?}:\n{}", self.output())
                }
            }
        }
    }

    fn node_line(&self, id: u32) -> &str {
        let prefix = format!("node {id}  ");
        self.lines
            .iter()
            .find(|l| l.trim_start().starts_with(&prefix))
            .unwrap_or_else(|| panic!("no line for node {id}:\n{}", self.output()))
    }

    /// The shards node `id` leads, as printed.
    pub fn leads(&self, id: u32) -> Vec<u32> {
        let line = self.node_line(id);
        let list = line.rsplit_once('[').and_then(|(_, l)| l.strip_suffix(']')).expect("leads shards [...]");
        list.split(',').filter_map(|s| s.trim().parse().ok()).collect()
    }

    /// shard -> leader, as printed.
    pub fn printed_leaders(&self, nodes: u32) -> BTreeMap<u32, u32> {
        (1..=nodes).flat_map(|n| self.leads(n).into_iter().map(move |s| (s, n))).collect()
    }

    /// Node `id`'s gRPC address, as printed.
    pub fn node_grpc(&self, id: u32) -> String {
        let line = self.node_line(id);
        let words: Vec<&str> = line.split_whitespace().collect();
        let i = words.iter().position(|w| *w == "gRPC").expect("gRPC address");
        words[i + 1].to_string()
    }

    /// Node `id`'s admin `/v1/status` URL, as printed.
    pub fn node_admin(&self, id: u32) -> String {
        let line = self.node_line(id);
        line.split_whitespace().find(|w| w.starts_with("http://")).expect("admin URL").to_string()
    }
}

impl Drop for DevProcess {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the child this test spawned; dev stops its
        // nodes and coordinator on SIGTERM.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && !matches!(self.child.try_wait(), Ok(Some(_))) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Whatever it left running (it should have stopped them all).
        for pid in processes_under(&self.data) {
            // SAFETY: kill(2) on a process the dev cluster of this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Pids of the running `walship` processes whose command line names a path
/// under `data`.
pub fn processes_under(data: &Path) -> Vec<i32> {
    let data = data.to_string_lossy().into_owned();
    let mut pids = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return pids };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        if args.first().is_some_and(|a| a.ends_with("/walship")) && args.iter().any(|a| a.starts_with(&data)) {
            pids.push(pid);
        }
    }
    pids
}

/// The pid of the `walship node` process that dev started for node `id`
/// under `data` (found by its command line), if one runs.
pub fn node_pid(data: &Path, id: u32) -> Option<i32> {
    child_pid(data, "node", &format!("node-{id}"))
}

/// The pid of the `walship coord` process that dev started under `data`,
/// if one runs.
pub fn coordinator_pid(data: &Path) -> Option<i32> {
    child_pid(data, "coord", "coord")
}

/// The pid of dev's `walship <subcommand>` child whose data dir is
/// `data/<dir>`, if one runs.
fn child_pid(data: &Path, subcommand: &str, dir: &str) -> Option<i32> {
    let wanted = data.join(dir);
    let wanted = wanted.to_string_lossy();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        if args.iter().any(|a| a == subcommand) && args.iter().any(|a| *a == wanted) {
            // A zombie (killed, not yet reaped) no longer runs.
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            if stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')) {
                continue;
            }
            return Some(pid);
        }
    }
    None
}

/// Bytes the files under `dir` take on disk.
pub fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_usage(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}
