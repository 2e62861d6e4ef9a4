//! Shared helpers for black-box tests: start `walship node` as a real process
//! on free loopback ports, talk to it over gRPC, wait on conditions.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};
use walship_proto::log::log_client::LogClient;

/// Path of the `walship` binary under test.
pub fn walship_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_walship"))
}

/// A `walship node` child process. Killed (SIGKILL) on drop.
pub struct NodeProcess {
    pub child: Child,
    pub grpc: String,
    pub admin: String,
    pub data_dir: PathBuf,
    pub node_id: u32,
    pub shards: String,
}

impl NodeProcess {
    /// Starts a node hosting `shards` (e.g. "1-4") with its WAL under
    /// `data_dir`, on free ports, and waits for its "listening" line.
    pub fn start(node_id: u32, data_dir: &Path, shards: &str, extra: &[&str]) -> NodeProcess {
        let mut child = Command::new(walship_bin())
            .args(["node", "--node-id", &node_id.to_string(), "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--shards", shards])
            .args(extra)
            .env("WALSHIP_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn walship node");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("read listening line");
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
                .to_string()
        };
        let (grpc, admin) = (field("grpc"), field("admin"));
        NodeProcess { child, grpc, admin, data_dir: data_dir.to_path_buf(), node_id, shards: shards.to_string() }
    }

    /// Restarts the node on the same data dir (new ports).
    pub fn restart(&mut self) {
        self.kill9();
        *self = NodeProcess::start(self.node_id, &self.data_dir.clone(), &self.shards.clone(), &[]);
    }

    /// SIGKILL: no shutdown path runs, exactly like a crash.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub async fn client(&self) -> LogClient<Channel> {
        let channel = Endpoint::from_shared(format!("http://{}", self.grpc)).unwrap().connect().await.unwrap();
        LogClient::new(channel).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Polls `condition` until it holds or `timeout` passes; panics with `what`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Plain HTTP GET over loopback (no client crate needed): status and body.
pub async fn http_get(addr_and_path: &str) -> (u16, String) {
    http_request("GET", addr_and_path, None).await
}

/// Minimal HTTP/1.1 request: `addr_and_path` is `host:port/path`.
pub async fn http_request(method: &str, addr_and_path: &str, body: Option<&str>) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, path) = match addr_and_path.find('/') {
        Some(i) => (&addr_and_path[..i], &addr_and_path[i..]),
        None => (addr_and_path, "/"),
    };
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let text = String::from_utf8_lossy(&response).to_string();
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}
