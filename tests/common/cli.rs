//! Running the `walship` CLI from a test: isolated from the caller's
//! environment and client config, bounded in time, with its output
//! described for assertion messages.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

/// Upper bound on any one CLI invocation; every command a test runs must
/// end well before it by its own deadlines.
pub const CLI_TIMEOUT: Duration = Duration::from_secs(60);

/// `walship <args>`, with no client config, no server or timeouts from the
/// environment, and WARN logs.
pub fn walship(args: &[&str]) -> Command {
    let mut command = Command::new(super::walship_bin());
    command
        .args(args)
        .env("WALSHIP_LOG", "warn")
        .env("WALSHIP_CLIENT_CONFIG", "/nonexistent/walship-client.toml")
        .env_remove("WALSHIP_SERVER")
        .env_remove("WALSHIP_CONNECT_TIMEOUT")
        .env_remove("WALSHIP_REQUEST_TIMEOUT")
        .env_remove("WALSHIP_DEADLINE")
        .env_remove("WALSHIP_IDLE_TIMEOUT");
    command
}

/// Runs `command` to completion, `stdin` fed to it (none: no stdin),
/// within [`CLI_TIMEOUT`]. A command that exits before reading its input
/// (a usage error) is not a failure to write it.
pub async fn run(command: Command, stdin: Option<&str>) -> Output {
    use tokio::io::AsyncWriteExt;
    let mut command = tokio::process::Command::from(command);
    command
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("spawn walship");
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("piped stdin");
        match pipe.write_all(input.as_bytes()).await {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => panic!("write stdin: {e}"),
            _ => {}
        }
        // Dropping the pipe closes it: end of input.
    }
    tokio::time::timeout(CLI_TIMEOUT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("walship did not finish within {CLI_TIMEOUT:?}"))
        .expect("wait for walship")
}

/// Exit status, stdout and stderr, for assertion messages.
pub fn describe(output: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Every stdout line, parsed as one JSON object.
pub fn json_lines(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}")))
        .collect()
}
