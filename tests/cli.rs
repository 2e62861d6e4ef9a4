//! Black-box CLI: the real `walship` binary's `append`, `read` and `tail`
//! subcommands against a real `walship node` process.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use base64::Engine as _;
use common::{NodeProcess, http_get};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

/// Upper bound on any one CLI invocation.
const CLI_TIMEOUT: Duration = Duration::from_secs(30);

/// A `walship` client command against `server`.
fn walship(args: &[&str]) -> Command {
    let mut command = Command::new(common::walship_bin());
    command.args(args).env("WALSHIP_LOG", "warn").env_remove("WALSHIP_SERVER");
    command
}

/// Runs `command` to completion (with `stdin` fed to it), within CLI_TIMEOUT.
async fn run(command: Command, stdin: Option<&str>) -> Output {
    let mut command = tokio::process::Command::from(command);
    command
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("spawn walship");
    if let Some(input) = stdin {
        use tokio::io::AsyncWriteExt;
        let mut pipe = child.stdin.take().expect("piped stdin");
        pipe.write_all(input.as_bytes()).await.expect("write stdin");
        // Dropping the pipe closes it: end of input.
    }
    tokio::time::timeout(CLI_TIMEOUT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("walship did not finish within {CLI_TIMEOUT:?}"))
        .expect("wait for walship")
}

fn describe(output: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Parses every stdout line as one JSON object.
fn json_lines(output: &Output) -> Vec<Value> {
    String::from_utf8(output.stdout.clone())
        .expect("utf-8 stdout")
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}")))
        .collect()
}

fn start_node(dir: &tempfile::TempDir) -> NodeProcess {
    NodeProcess::start(1, dir.path(), "1-3", &[])
}

fn assert_record(line: &Value, shard: u64, seqno: u64, payload: &str) {
    assert_eq!(line["shard"].as_u64(), Some(shard), "shard of {line}");
    assert_eq!(line["seqno"].as_u64(), Some(seqno), "seqno of {line}");
    assert_eq!(line["payload"].as_str(), Some(payload), "payload of {line}");
    assert_eq!(line["key"].as_str(), Some(""), "stdin lines carry no key: {line}");
    assert!(line["crc32"].is_u64(), "crc32 missing or not a number: {line}");
    assert!(line["epoch"].as_u64().is_some_and(|e| e >= 1), "epoch of {line}");
    assert!(line["timestamp_us"].as_u64().is_some_and(|t| t > 0), "timestamp_us of {line}");
    let b64 = base64::engine::general_purpose::STANDARD;
    assert_eq!(
        b64.decode(line["payload_b64"].as_str().expect("payload_b64")).expect("base64"),
        payload.as_bytes(),
        "payload_b64 of {line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_stdin_lines_then_read_and_tail_them() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_node(&dir);
    node.wait_healthy().await;
    let server = node.grpc.as_str();

    let append = run(
        walship(&["append", "--server", server, "--shard", "1", "--durability", "local"]),
        Some("alpha\nbeta\ngamma\n"),
    )
    .await;
    assert!(append.status.success(), "append failed: {}", describe(&append));
    let text = String::from_utf8_lossy(&append.stdout);
    assert!(text.contains("1..=3"), "append should report seqnos 1..=3: {}", describe(&append));

    let read = run(walship(&["read", "--server", server, "--shard", "1", "--from", "1", "--json"]), None).await;
    assert!(read.status.success(), "read failed: {}", describe(&read));
    let lines = json_lines(&read);
    assert_eq!(lines.len(), 3, "three records: {}", describe(&read));
    for (line, (seqno, payload)) in lines.iter().zip([(1, "alpha"), (2, "beta"), (3, "gamma")]) {
        assert_record(line, 1, seqno, payload);
    }
    // Distinct contents, distinct checksums.
    let crcs: std::collections::BTreeSet<u64> = lines.iter().map(|l| l["crc32"].as_u64().unwrap()).collect();
    assert_eq!(crcs.len(), 3, "crc32s should differ: {lines:?}");

    // A partial range, closed at both ends.
    let read =
        run(walship(&["read", "--server", server, "--shard", "1", "--from", "2", "--to", "2", "--json"]), None).await;
    assert!(read.status.success(), "read 2..=2 failed: {}", describe(&read));
    let partial = json_lines(&read);
    assert_eq!(partial.len(), 1, "{}", describe(&read));
    assert_eq!(partial[0], lines[1], "the same record, whichever way it is read");

    // Tail from 1 prints the 3 records, then follows a new append.
    let mut tail =
        tokio::process::Command::from(walship(&["tail", "--server", server, "--shard", "1", "--from", "1", "--json"]))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn walship tail");
    let mut out = BufReader::new(tail.stdout.take().expect("piped stdout")).lines();
    let mut next_line = async || -> Value {
        let line = tokio::time::timeout(CLI_TIMEOUT, out.next_line())
            .await
            .expect("tail printed no line in time")
            .expect("read tail stdout")
            .expect("tail exited early");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("tail line is not JSON ({e}): {line:?}"))
    };
    for (i, expected) in lines.iter().enumerate() {
        let line = next_line().await;
        assert_eq!(&line, expected, "tail record {}", i + 1);
    }
    let append =
        run(walship(&["append", "--server", server, "--shard", "1", "--durability", "local"]), Some("delta\n")).await;
    assert!(append.status.success(), "second append failed: {}", describe(&append));
    assert_record(&next_line().await, 1, 4, "delta");

    tail.kill().await.expect("kill walship tail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_generated_records_in_batches() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_node(&dir);
    node.wait_healthy().await;
    let server = node.grpc.as_str();

    let append = run(
        walship(&[
            "append", "--server", server, "--count", "250", "--size", "64", "--batch", "100", "--json", "--shard", "2",
        ]),
        None,
    )
    .await;
    assert!(append.status.success(), "append failed: {}", describe(&append));
    let lines = json_lines(&append);
    assert_eq!(lines.len(), 3, "one JSON line per batch of at most 100: {}", describe(&append));
    let mut ranges: Vec<(u64, u64)> = lines
        .iter()
        .map(|l| {
            assert_eq!(l["shard"].as_u64(), Some(2), "shard of {l}");
            assert!(l["epoch"].as_u64().is_some_and(|e| e >= 1), "epoch of {l}");
            (l["first_seqno"].as_u64().expect("first_seqno"), l["last_seqno"].as_u64().expect("last_seqno"))
        })
        .collect();
    ranges.sort();
    let mut next = 1;
    for &(first, last) in &ranges {
        assert_eq!(first, next, "ranges must tile 1..=250 without gaps or overlap: {ranges:?}");
        assert!(last >= first && last - first < 100, "batch of at most 100: {ranges:?}");
        next = last + 1;
    }
    assert_eq!(next, 251, "ranges must end at 250: {ranges:?}");
    assert_eq!(ranges, vec![(1, 100), (101, 200), (201, 250)]);

    // Every generated record reads back: 64-byte payloads, keys 0..250.
    let read = run(walship(&["read", "--server", server, "--shard", "2", "--json"]), None).await;
    assert!(read.status.success(), "read failed: {}", describe(&read));
    let records = json_lines(&read);
    assert_eq!(records.len(), 250, "250 records read back");
    let b64 = base64::engine::general_purpose::STANDARD;
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r["seqno"].as_u64(), Some(i as u64 + 1), "seqno of {r}");
        assert_eq!(r["key"].as_str(), Some(i.to_string().as_str()), "key of {r}");
        let payload = b64.decode(r["payload_b64"].as_str().expect("payload_b64")).expect("base64");
        assert_eq!(payload.len(), 64, "payload size of {r}");
        assert!(r["crc32"].is_u64(), "crc32 of {r}");
    }

    // Shard 1 untouched.
    let (code, body) = http_get(&format!("{}/v1/status", node.admin)).await;
    assert_eq!(code, 200);
    let status: Value = serde_json::from_str(&body).unwrap();
    let shards = status["shards"].as_array().unwrap();
    let durable = |id: u64| shards.iter().find(|s| s["shard_id"] == id).unwrap()["durable_seqno"].as_u64().unwrap();
    assert_eq!((durable(1), durable(2), durable(3)), (0, 250, 0), "{body}");
}

/// With a producer, batches are pipelined (`--in-flight`) yet answered in
/// input order, one line per batch, their seqnos tiling the shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_batches_are_reported_in_input_order() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_node(&dir);
    node.wait_healthy().await;
    let server = node.grpc.as_str();
    let input: String = (0..2_000).map(|i| format!("line-{i}\n")).collect();
    let append = run(
        walship(&["append", "--server", server, "--shard", "1", "--batch", "10", "--in-flight", "16", "--json"]),
        Some(&input),
    )
    .await;
    assert!(append.status.success(), "{}", describe(&append));
    let lines = json_lines(&append);
    assert_eq!(lines.len(), 200, "one line per batch of 10: {}", describe(&append));
    for (i, line) in lines.iter().enumerate() {
        let first = 10 * i as u64 + 1;
        assert_eq!(line["outcome"], "acknowledged", "{line}");
        assert_eq!(
            (line["first_seqno"].as_u64(), line["last_seqno"].as_u64()),
            (Some(first), Some(first + 9)),
            "{line}"
        );
    }
    let read = run(walship(&["read", "--server", server, "--shard", "1", "--json"]), None).await;
    let payloads: Vec<String> = json_lines(&read).iter().map(|r| r["payload"].as_str().unwrap().to_string()).collect();
    assert_eq!(payloads, input.lines().collect::<Vec<_>>(), "every line once, in order");

    let zero = run(walship(&["append", "--server", server, "--shard", "1", "--in-flight", "0"]), Some("x\n")).await;
    assert_eq!(zero.status.code(), Some(2), "--in-flight 0 is a usage error: {}", describe(&zero));
}

/// A batch refused for itself (a record over the node's max_record_bytes)
/// in the middle of a pipelined run: the run fails with its error, and
/// every record the shard holds was reported by a printed line (the
/// batches already on the way behind it may land; none goes unreported).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_mid_pipeline_leaves_nothing_unreported() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_node(&dir);
    node.wait_healthy().await;
    let server = node.grpc.as_str();
    let big = "x".repeat(2_000_000);
    let mut input: Vec<String> = (0..300).map(|i| format!("line-{i}")).collect();
    input[150] = big.clone();
    let stdin = input.iter().map(|l| format!("{l}\n")).collect::<String>();
    let append = run(
        walship(&["append", "--server", server, "--shard", "1", "--batch", "1", "--in-flight", "32", "--json"]),
        Some(&stdin),
    )
    .await;
    assert_eq!(append.status.code(), Some(9), "the refused batch's exit code: {}", describe(&append));
    assert!(String::from_utf8_lossy(&append.stderr).contains("max_record_bytes"), "{}", describe(&append));
    let reported: Vec<u64> = json_lines(&append)
        .iter()
        .map(|l| {
            assert_eq!(l["outcome"], "acknowledged", "{l}");
            l["first_seqno"].as_u64().expect("first_seqno")
        })
        .collect();
    assert!(reported.len() >= 150, "the batches before the refused one: {}", describe(&append));
    assert_eq!(reported, (1..=reported.len() as u64).collect::<Vec<_>>(), "{}", describe(&append));
    let read = run(walship(&["read", "--server", server, "--shard", "1", "--json"]), None).await;
    let payloads: Vec<String> = json_lines(&read).iter().map(|r| r["payload"].as_str().unwrap().to_string()).collect();
    let expected: Vec<String> = input.iter().filter(|l| **l != big).take(reported.len()).cloned().collect();
    assert_eq!(payloads, expected, "exactly the reported records, in input order, without the refused one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_commands_fail_on_an_unknown_shard() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_node(&dir);
    node.wait_healthy().await;
    let server = node.grpc.as_str();

    let read = run(walship(&["read", "--server", server, "--shard", "9", "--from", "1", "--json"]), None).await;
    assert!(!read.status.success(), "read of shard 9 should fail: {}", describe(&read));
    let stderr = String::from_utf8_lossy(&read.stderr);
    assert!(stderr.contains("NotFound"), "stderr should name NotFound: {}", describe(&read));
    assert!(stderr.contains('9'), "stderr should name the shard: {}", describe(&read));
    assert!(read.stdout.is_empty(), "nothing on stdout: {}", describe(&read));

    // A hosted but empty shard: an open-ended read prints nothing and
    // succeeds, and so does a range past the end (it reads what exists).
    let empty = run(walship(&["read", "--server", server, "--shard", "1", "--from", "1"]), None).await;
    assert!(empty.status.success() && empty.stdout.is_empty(), "{}", describe(&empty));
    let past = run(walship(&["read", "--server", server, "--shard", "1", "--from", "1", "--to", "5"]), None).await;
    assert!(past.status.success() && past.stdout.is_empty(), "{}", describe(&past));

    let append = run(walship(&["append", "--server", server, "--shard", "9"]), Some("x\n")).await;
    assert!(!append.status.success(), "append to shard 9 should fail: {}", describe(&append));
    assert!(String::from_utf8_lossy(&append.stderr).contains("NotFound"), "{}", describe(&append));

    let tail = run(walship(&["tail", "--server", server, "--shard", "9", "--from", "1"]), None).await;
    assert!(!tail.status.success(), "tail of shard 9 should fail: {}", describe(&tail));
    assert!(String::from_utf8_lossy(&tail.stderr).contains("NotFound"), "{}", describe(&tail));
}

/// `walship read | head -1` and `walship status | head -1`: the command ends
/// quietly when its reader goes away (SIGPIPE, as Unix tools do), never
/// with a panic about a broken pipe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_output_into_a_closed_pipe_ends_quietly() {
    use std::io::{BufRead, Read};
    use std::os::unix::process::ExitStatusExt;

    let dir = tempfile::tempdir().unwrap();
    let node = start_node(&dir);
    node.wait_healthy().await;
    let server = node.grpc.as_str();
    let append = run(
        walship(&["append", "--server", server, "--count", "3000", "--size", "200", "--batch", "1000", "--shard", "1"]),
        None,
    )
    .await;
    assert!(append.status.success(), "append failed: {}", describe(&append));
    // Far more output than a pipe's buffer holds, so the writer meets the
    // closed pipe while it still has lines to print.
    for args in
        [vec!["read", "--server", server, "--shard", "1", "--json"], vec!["read", "--server", server, "--shard", "1"]]
    {
        let mut child = walship(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut first = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        assert!(!first.is_empty(), "{args:?} printed nothing");
        // The reader is gone (stdout dropped with the BufReader).
        let status = child.wait().unwrap();
        let mut stderr = String::new();
        child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(status.success() || status.signal() == Some(libc::SIGPIPE), "{args:?} ended with {status:?}: {stderr}");
    }
}

/// A node whose stderr is a file (not a terminal) logs plain text: no ANSI
/// colour codes in a log file, a pipe or a journal.
#[test]
fn logs_to_a_file_carry_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("node.log");
    let mut command = Command::new(common::walship_bin());
    command
        .args(["node", "--node-id", "1", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--wal-prefill", "false"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args(["--shards", "1"])
        .env("WALSHIP_LOG", "info")
        .env_remove("NO_COLOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()));
    let mut child = command.spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.contains("listening"), "{line}");
    child.kill().unwrap();
    child.wait().unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("serving"), "the node logged at INFO: {text}");
    assert!(!text.contains('\u{1b}'), "no escape codes: {text:?}");
}
