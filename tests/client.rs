//! Black-box client behaviour of `walship append/read/tail` against real
//! node processes: bounded waits, moving on past frozen or refusing
//! servers, tails that resume on another replica, failures named by kind
//! with their exit codes (and as JSON), read options and read-your-writes.

mod common;

use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::cli::{CLI_TIMEOUT, describe, json_lines, run, walship};
use common::{Cluster, NodeProcess, http_get, wait_until};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Seqnos of a `--json` read or tail output.
fn seqnos(lines: &[Value]) -> Vec<u64> {
    lines.iter().map(|l| l["seqno"].as_u64().expect("seqno")).collect()
}

/// Asserts `output` failed with `code` and, in text, named `words`.
fn assert_failed(output: &Output, code: i32, words: &str) {
    assert_eq!(output.status.code(), Some(code), "exit code: {}", describe(output));
    assert!(stderr(output).contains(words), "stderr should say {words:?}: {}", describe(output));
}

/// Asserts a `--json` failure: exactly one JSON object on stderr, of `kind`,
/// with the same exit code as the text form.
fn assert_json_error(output: &Output, code: i32, kind: &str, server: Option<&str>) -> Value {
    assert_eq!(output.status.code(), Some(code), "exit code: {}", describe(output));
    let text = stderr(output);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON object on stderr: {}", describe(output));
    let error: Value = serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("stderr not JSON ({e}): {text}"));
    assert_eq!(error["error"]["kind"], kind, "{error}");
    assert_eq!(error["error"]["exit_code"], code, "{error}");
    assert!(error["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{error}");
    if let Some(server) = server {
        assert_eq!(error["error"]["server"], server, "{error}");
    }
    error
}

/// A shard's durable seqno from a node's admin status.
async fn durable(node: &NodeProcess, shard: u64) -> u64 {
    let (code, body) = http_get(&format!("{}/v1/status", node.admin)).await;
    assert_eq!(code, 200, "{body}");
    let status: Value = serde_json::from_str(&body).unwrap();
    status["shards"].as_array().unwrap().iter().find(|s| s["shard_id"] == shard).unwrap()["durable_seqno"]
        .as_u64()
        .unwrap()
}

/// A loopback TCP port that accepts connections and then either says
/// nothing (`banner` None) or writes `banner` and keeps the connection.
async fn fake_server(banner: Option<&'static [u8]>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut socket, _)) = listener.accept().await {
            if let Some(banner) = banner {
                let _ = socket.write_all(banner).await;
            }
            held.push(socket);
        }
    });
    addr
}

fn sigstop(node: &NodeProcess) {
    common::process_signal::send(node.child.id(), libc::SIGSTOP);
}

fn sigcont(node: &NodeProcess) {
    common::process_signal::send(node.child.id(), libc::SIGCONT);
}

/// Every client command names each connection failure for what it is,
/// exits with its code, prints it as one JSON object with --json, and
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_connection_failure_is_named_with_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1-3", &[]);
    node.wait_healthy().await;
    let refused = format!("127.0.0.1:{}", common::free_port());
    let junk = fake_server(Some(b"SSH-2.0-OpenSSH_9.6\r\nSSH-2.0-OpenSSH_9.6\r\n")).await;
    let silent = fake_server(None).await;
    let cases: [(&str, i32, &str, &str); 6] = [
        (&refused, 6, "connection_refused", "connection refused"),
        ("no-such-host.invalid:7401", 5, "dns_failure", "DNS failure"),
        ("garbage", 4, "invalid_address", "invalid address"),
        (&node.admin, 7, "not_walship", "not a walship server"),
        (&junk, 7, "not_walship", "not a walship server"),
        (&silent, 8, "deadline_exceeded", "deadline exceeded"),
    ];
    for (server, code, kind, words) in cases {
        // Only the silent server is to be given up on by its deadline; the
        // others answer at once, but on a loaded machine (the whole suite
        // running beside) "at once" has taken over a second.
        let bound = if kind == "deadline_exceeded" { "1s" } else { "10s" };
        for command in ["append", "read", "tail"] {
            let args = ["--server", server, "--shard", "1", "--connect-timeout", bound];
            let stdin = (command == "append").then_some("x\n");
            let text = run(walship(&[&[command][..], &args].concat()), stdin).await;
            assert_failed(&text, code, words);
            assert!(text.stdout.is_empty(), "{command} {server}: nothing on stdout: {}", describe(&text));
            let json = run(walship(&[&[command][..], &args, &["--json"]].concat()), stdin).await;
            let server = (kind != "invalid_address").then_some(server);
            assert_json_error(&json, code, kind, server);
        }
    }
    // The timeouts come from the environment when no flag is given; a bad
    // value there is a usage error.
    let mut from_env = walship(&["read", "--server", &silent, "--shard", "1"]);
    from_env.env("WALSHIP_CONNECT_TIMEOUT", "300ms");
    let output = run(from_env, None).await;
    assert_failed(&output, 8, "no answer within 300ms (--connect-timeout)");
    for (variable, value) in [("WALSHIP_CONNECT_TIMEOUT", "soon"), ("WALSHIP_REQUEST_TIMEOUT", "0s")] {
        let mut bad = walship(&["read", "--server", &node.grpc, "--shard", "1"]);
        bad.env(variable, value);
        let output = run(bad, None).await;
        assert_eq!(output.status.code(), Some(2), "{variable}={value}: {}", describe(&output));
        assert!(stderr(&output).contains(value), "names the bad value: {}", describe(&output));
    }

    // A list: the failures are all named, the exit code is the last one's.
    let list = format!("no-such-host.invalid:1,{refused}");
    let both = run(walship(&["append", "--server", &list, "--shard", "1"]), Some("x\n")).await;
    assert_failed(&both, 6, "connection refused");
    assert!(stderr(&both).contains("no-such-host.invalid"), "{}", describe(&both));
    assert_eq!(durable(&node, 1).await, 0, "nothing was written");
}

/// Size limits and refusals: named with the limit, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_and_refused_requests_name_the_limit_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1-3", &[]);
    node.wait_healthy().await;
    let server = node.grpc.as_str();
    // One unary call each (--no-producer): ~36 MB is over the node's
    // max_batch_bytes (32 MiB) but within its message limit; 40 MB is over
    // the message limit; 70 MB is over the client's own 64 MiB, never sent.
    // With a producer (the default), a request over 32 MiB is never put on
    // its stream (one over the node's message limit would break it).
    let cases = [
        ("36", true, "max_batch_bytes"),
        ("40", true, "the limit is"),
        ("70", true, "client's limit"),
        ("36", false, "at most 33554432 bytes in one request of a producer's stream"),
    ];
    for (count, unary, limit) in cases {
        let mut args = vec!["append", "--server", server, "--shard", "2", "--count", count, "--size", "1000000"];
        args.extend(["--batch", count]);
        if unary {
            args.push("--no-producer");
        }
        let output = run(walship(&args), None).await;
        assert_failed(&output, 9, "too large");
        assert!(stderr(&output).contains(limit), "{count} MB (unary {unary}) names {limit:?}: {}", describe(&output));
    }
    let json = run(
        walship(&["append", "--server", server, "--shard", "2", "--count", "2", "--size", "2000000", "--json"]),
        None,
    )
    .await;
    let error = assert_json_error(&json, 9, "too_large", Some(server));
    assert!(error["error"]["message"].as_str().unwrap().contains("max_record_bytes"), "{error}");
    let record =
        run(walship(&["append", "--server", server, "--shard", "2", "--count", "1", "--size", "2000000"]), None).await;
    assert_failed(&record, 9, "max_record_bytes");
    // An unknown shard is a refusal.
    let unknown = run(walship(&["append", "--server", server, "--shard", "9", "--json"]), Some("x\n")).await;
    let error = assert_json_error(&unknown, 10, "rejected", Some(server));
    assert!(error["error"]["message"].as_str().unwrap().contains("NotFound"), "{error}");
    assert_eq!(durable(&node, 2).await, 0, "nothing was written");
}

/// `read` of a frozen node ends at its deadline; `tail` of a node that
/// freezes mid-stream notices through missed heartbeats and, with no other
/// replica, ends at its deadline; a healthy quiet tail outlives many idle
/// timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_and_tail_of_a_frozen_node_end_at_their_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1-3", &[]);
    node.wait_healthy().await;
    let server = node.grpc.as_str();
    let first = run(walship(&["append", "--server", server, "--shard", "1"]), Some("one\n")).await;
    assert!(first.status.success(), "{}", describe(&first));

    let mut tail = tokio::process::Command::from(walship(&[
        "tail",
        "--server",
        server,
        "--shard",
        "1",
        "--json",
        "--idle-timeout",
        "1s",
        "--deadline",
        "2s",
    ]))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true)
    .spawn()
    .expect("spawn tail");
    let mut lines = BufReader::new(tail.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(CLI_TIMEOUT, lines.next_line()).await.expect("first tail line").unwrap().unwrap();
    assert!(line.contains("\"one\""), "{line}");
    // Quiet for several idle timeouts: heartbeats keep it going.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let second = run(walship(&["append", "--server", server, "--shard", "1"]), Some("two\n")).await;
    assert!(second.status.success(), "{}", describe(&second));
    let line = tokio::time::timeout(CLI_TIMEOUT, lines.next_line()).await.expect("second tail line").unwrap().unwrap();
    assert!(line.contains("\"two\""), "a quiet healthy tail keeps streaming: {line}");

    sigstop(&node);
    let status = tokio::time::timeout(CLI_TIMEOUT, tail.wait()).await.expect("tail ends by its deadline").unwrap();
    let mut err = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut tail.stderr.take().unwrap(), &mut err).await.unwrap();
    assert_eq!(status.code(), Some(8), "tail of a frozen node: {err}");
    let error: Value = serde_json::from_str(err.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {err}"));
    assert_eq!(error["error"]["kind"], "deadline_exceeded", "{error}");
    assert!(error["error"]["message"].as_str().unwrap().contains("seqno 3"), "names where it stopped: {error}");

    let read = run(walship(&["read", "--server", server, "--shard", "1", "--connect-timeout", "1s"]), None).await;
    assert_failed(&read, 8, "deadline exceeded");
    let tail = run(walship(&["tail", "--server", server, "--shard", "1", "--connect-timeout", "1s"]), None).await;
    assert_failed(&tail, 8, "deadline exceeded");
    sigcont(&node);
}

/// Appends move past a frozen server to the leader; a frozen leader is
/// never sent the append (a deadline, not an unknown outcome); an append
/// sent to the leader that never answers is an unknown outcome (exit 3),
/// and is indeed written once the cluster recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_move_past_frozen_servers_and_report_unknown_only_when_sent() {
    let mut cluster = Cluster::start(3, 1, "");
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let (n1, n2, n3) = (cluster.node(1).grpc.clone(), cluster.node(2).grpc.clone(), cluster.node(3).grpc.clone());

    // A refused, an unresolvable and a follower's address before the
    // leader's: each is passed over.
    let refused = format!("127.0.0.1:{}", common::free_port());
    let servers = format!("{refused},no-such-host.invalid:7401,{n3},{n1}");
    let append = run(walship(&["append", "--server", &servers, "--shard", "1"]), Some("first\n")).await;
    assert!(append.status.success(), "{}", describe(&append));
    assert!(String::from_utf8_lossy(&append.stdout).contains("seqnos 1..=1"), "{}", describe(&append));

    cluster.signal(2, libc::SIGSTOP);
    let servers = format!("{n2},{n1}");
    let append = run(
        walship(&["append", "--server", &servers, "--shard", "1", "--connect-timeout", "1s", "--json"]),
        Some("past the frozen one\n"),
    )
    .await;
    assert!(append.status.success(), "{}", describe(&append));
    assert_eq!(json_lines(&append)[0]["last_seqno"], 2, "{}", describe(&append));
    let read = run(
        walship(&["read", "--server", &format!("{n2},{n3}"), "--shard", "1", "--connect-timeout", "1s", "--json"]),
        None,
    )
    .await;
    assert!(read.status.success(), "{}", describe(&read));
    assert_eq!(seqnos(&json_lines(&read)), vec![1, 2], "{}", describe(&read));

    // Durability ALL with a frozen follower: the leader takes the append
    // and never answers.
    let unknown = run(
        walship(&[
            "append",
            "--server",
            &n1,
            "--shard",
            "1",
            "--durability",
            "all",
            "--request-timeout",
            "1s",
            "--json",
        ]),
        Some("maybe\n"),
    )
    .await;
    assert_eq!(unknown.status.code(), Some(3), "{}", describe(&unknown));
    assert_eq!(json_lines(&unknown)[0]["outcome"], "unknown", "{}", describe(&unknown));
    assert_json_error(&unknown, 3, "outcome_unknown", Some(&n1));
    cluster.signal(2, libc::SIGCONT);
    let leader: &NodeProcess = cluster.node(1);
    wait_until("the unknown-outcome append is committed after all", Duration::from_secs(30), || async move {
        durable(leader, 1).await >= 3
    })
    .await;

    // A frozen leader: followers point at it, it never answers the probe,
    // so the append is never sent; the deadline ends it.
    cluster.signal(1, libc::SIGSTOP);
    let frozen = run(
        walship(&[
            "append",
            "--server",
            &format!("{n2},{n3}"),
            "--shard",
            "1",
            "--connect-timeout",
            "500ms",
            "--deadline",
            "3s",
        ]),
        Some("never\n"),
    )
    .await;
    assert_failed(&frozen, 8, "not written");
    cluster.signal(1, libc::SIGCONT);
    let read = run(walship(&["read", "--server", &n1, "--shard", "1", "--json"]), None).await;
    let lines = json_lines(&read);
    assert_eq!(seqnos(&lines), vec![1, 2, 3], "{}", describe(&read));
    assert_eq!(lines[2]["payload"], "maybe", "{}", describe(&read));
    assert!(lines.iter().all(|l| l["payload"] != "never"), "{}", describe(&read));
}

/// Tails `shard` 1 through `servers` while `count` records are appended one
/// by one to the leader, doing `disrupt` to node 2 (the tailed one) after a
/// third of them; the tail must print exactly 1..=count.
async fn tail_through(disrupt: fn(&mut Cluster)) {
    const COUNT: u64 = 150;
    let mut cluster = Cluster::start(3, 1, "");
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let servers = format!("{},{}", cluster.nodes[1].grpc, cluster.nodes[2].grpc);
    let mut tail = tokio::process::Command::from(walship(&[
        "tail",
        "--server",
        &servers,
        "--shard",
        "1",
        "--from",
        "1",
        "--json",
        "--idle-timeout",
        "1s",
        "--connect-timeout",
        "1s",
    ]))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit())
    .kill_on_drop(true)
    .spawn()
    .expect("spawn tail");
    let printed = Arc::new(Mutex::new(Vec::<Value>::new()));
    let mut lines = BufReader::new(tail.stdout.take().unwrap()).lines();
    let sink = printed.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("tail line not JSON ({e}): {line}"));
            sink.lock().unwrap().push(value);
        }
    });
    let mut leader = cluster.node(1).client().await;
    for i in 1..=COUNT {
        if i == COUNT / 3 {
            let seen = printed.clone();
            wait_until("the tail printing records", Duration::from_secs(30), || {
                let seen = seen.clone();
                async move { !seen.lock().unwrap().is_empty() }
            })
            .await;
            disrupt(&mut cluster);
        }
        let request = AppendRequest {
            shard_id: 1,
            records: vec![AppendRecord { key: Default::default(), payload: format!("r{i}").into() }],
            durability: Durability::Quorum as i32,
            ..Default::default()
        };
        let response = leader.append(request).await.expect("append").into_inner();
        assert_eq!(response.last_seqno, i);
    }
    let seen = printed.clone();
    wait_until("the tail printing every record", Duration::from_secs(45), || {
        let seen = seen.clone();
        async move { seen.lock().unwrap().len() as u64 >= COUNT }
    })
    .await;
    // A little longer: nothing more (no duplicate) may follow.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let printed = printed.lock().unwrap().clone();
    assert_eq!(seqnos(&printed), (1..=COUNT).collect::<Vec<_>>(), "contiguous, no gap, no duplicate");
    for (i, line) in printed.iter().enumerate() {
        assert_eq!(line["payload"], format!("r{}", i + 1), "{line}");
    }
    assert!(tail.try_wait().unwrap().is_none(), "the tail keeps running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_resumes_on_another_replica_when_its_node_is_killed() {
    tail_through(|cluster| cluster.node(2).kill9()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_resumes_on_another_replica_when_its_node_freezes() {
    tail_through(|cluster| cluster.signal(2, libc::SIGSTOP)).await;
}

/// `read` options: from the oldest by default, --last, --limit, --to past
/// the end, --key (with `append --key`); bad values are refused up front.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_options_select_what_is_printed() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1-3", &[]);
    node.wait_healthy().await;
    let server = node.grpc.as_str();
    let a = run(walship(&["append", "--server", server, "--shard", "1", "--key", "a"]), Some("a1\na2\na3\n")).await;
    assert!(a.status.success(), "{}", describe(&a));
    let b = run(walship(&["append", "--server", server, "--shard", "1", "--key", "b"]), Some("b4\nb5\n")).await;
    assert!(b.status.success(), "{}", describe(&b));
    let read = async |extra: &[&str]| -> Vec<Value> {
        let output =
            run(walship(&[&["read", "--server", server, "--shard", "1", "--json"][..], extra].concat()), None).await;
        assert!(output.status.success(), "read {extra:?}: {}", describe(&output));
        json_lines(&output)
    };
    assert_eq!(seqnos(&read(&[]).await), vec![1, 2, 3, 4, 5]);
    assert_eq!(seqnos(&read(&["--from", "oldest"]).await), vec![1, 2, 3, 4, 5]);
    assert_eq!(seqnos(&read(&["--last", "2"]).await), vec![4, 5]);
    assert_eq!(seqnos(&read(&["--last", "50"]).await), vec![1, 2, 3, 4, 5]);
    assert_eq!(seqnos(&read(&["--limit", "2"]).await), vec![1, 2]);
    assert_eq!(seqnos(&read(&["--to", "100"]).await), vec![1, 2, 3, 4, 5]);
    assert_eq!(seqnos(&read(&["--from", "4", "--to", "100"]).await), vec![4, 5]);
    assert_eq!(seqnos(&read(&["--from", "2", "--to", "3"]).await), vec![2, 3]);
    assert_eq!(seqnos(&read(&["--from", "9", "--to", "20"]).await), Vec::<u64>::new());
    let keyed = read(&["--key", "b"]).await;
    assert_eq!(seqnos(&keyed), vec![4, 5]);
    assert!(keyed.iter().all(|l| l["key"] == "b" && l["payload"].as_str().unwrap().starts_with('b')), "{keyed:?}");
    assert_eq!(seqnos(&read(&["--key", "a", "--limit", "2"]).await), vec![1, 2]);
    assert_eq!(seqnos(&read(&["--key", "a", "--last", "3"]).await), vec![3]);
    assert_eq!(seqnos(&read(&["--key", "zzz"]).await), Vec::<u64>::new());
    // An empty shard: nothing, and no error.
    let empty = run(walship(&["read", "--server", server, "--shard", "2", "--last", "3"]), None).await;
    assert!(empty.status.success() && empty.stdout.is_empty(), "{}", describe(&empty));

    for bad in [
        &["--from", "3", "--to", "2"][..],
        &["--from", "0"],
        &["--from", "newest"],
        &["--last", "0"],
        &["--limit", "0"],
        &["--last", "2", "--from", "1"],
        &["--connect-timeout", "0s"],
        &["--request-timeout", "soon"],
    ] {
        let output = run(walship(&[&["read", "--server", server, "--shard", "1"][..], bad].concat()), None).await;
        assert_eq!(output.status.code(), Some(2), "read {bad:?} is a usage error: {}", describe(&output));
        assert!(output.stdout.is_empty(), "{}", describe(&output));
    }
    assert_eq!(durable(&node, 1).await, 5, "nothing changed");
}

/// Read-your-writes on a follower: an append to the leader, then at once a
/// read from a follower with its seqno, always sees it. A seqno nobody has
/// written waits only until the deadline and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_after_write_on_a_follower_sees_the_write() {
    let mut cluster = Cluster::start(3, 1, "");
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let (leader, follower) = (cluster.node(1).grpc.clone(), cluster.node(2).grpc.clone());
    for i in 1..=15u64 {
        let payload = format!("w{i}\n");
        let append = run(walship(&["append", "--server", &leader, "--shard", "1", "--json"]), Some(&payload)).await;
        assert!(append.status.success(), "{}", describe(&append));
        let seqno = json_lines(&append)[0]["last_seqno"].as_u64().unwrap();
        assert_eq!(seqno, i);
        let s = seqno.to_string();
        let read = run(
            walship(&[
                "read",
                "--server",
                &follower,
                "--shard",
                "1",
                "--from",
                &s,
                "--to",
                &s,
                "--after-write",
                &s,
                "--json",
            ]),
            None,
        )
        .await;
        assert!(read.status.success(), "{}", describe(&read));
        let lines = json_lines(&read);
        assert_eq!(seqnos(&lines), vec![seqno], "the follower served the write: {}", describe(&read));
        assert_eq!(lines[0]["payload"], format!("w{i}"));
    }
    let hostile = u64::MAX.to_string();
    let output = run(
        walship(&[
            "read",
            "--server",
            &follower,
            "--shard",
            "1",
            "--after-write",
            &hostile,
            "--request-timeout",
            "1s",
            "--json",
        ]),
        None,
    )
    .await;
    let error = assert_json_error(&output, 11, "unavailable", Some(&follower));
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("committed up to seqno 15"), "names how far the follower is: {error}");
    assert!(output.stdout.is_empty(), "{}", describe(&output));
    let text = run(
        walship(&["read", "--server", &follower, "--shard", "1", "--after-write", &hostile, "--request-timeout", "1s"]),
        None,
    )
    .await;
    assert_failed(&text, 11, "short of min_seqno");
    // Nothing changed.
    let read = run(walship(&["read", "--server", &follower, "--shard", "1", "--json"]), None).await;
    assert_eq!(seqnos(&json_lines(&read)), (1..=15).collect::<Vec<_>>(), "{}", describe(&read));
    assert_eq!(durable(cluster.node(1), 1).await, 15);
}

/// A shard field from a node's admin status.
async fn status_field(node: &NodeProcess, shard: u64, field: &str) -> u64 {
    let (code, body) = http_get(&format!("{}/v1/status", node.admin)).await;
    assert_eq!(code, 200, "{body}");
    let status: Value = serde_json::from_str(&body).unwrap();
    status["shards"].as_array().unwrap().iter().find(|s| s["shard_id"] == shard).unwrap()[field].as_u64().unwrap()
}

/// After retention compacted the head of the log, `read` starts at the
/// oldest retained record by default, `--last` still gives the newest, and
/// a compacted `--from` is refused naming the oldest retained seqno.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_starts_at_the_oldest_retained_record() {
    let cluster = Cluster::start(1, 1, "retain_bytes = 20000\nretention_interval_ms = 100");
    let node = &cluster.nodes[0];
    node.wait_healthy().await;
    let append = run(
        walship(&[
            "append", "--server", &node.grpc, "--shard", "1", "--count", "800", "--size", "100", "--batch", "100",
        ]),
        None,
    )
    .await;
    assert!(append.status.success(), "{}", describe(&append));
    wait_until("retention to compact the head of shard 1", Duration::from_secs(30), || async {
        status_field(node, 1, "first_seqno").await > 1
    })
    .await;
    let read = run(walship(&["read", "--server", &node.grpc, "--shard", "1", "--json"]), None).await;
    assert!(read.status.success(), "{}", describe(&read));
    let got = seqnos(&json_lines(&read));
    let first = got[0];
    assert!(first > 1, "starts past the compacted head: {first}");
    assert!(first <= status_field(node, 1, "first_seqno").await, "starts at the oldest retained (or was then)");
    assert_eq!(got, (first..=800).collect::<Vec<_>>(), "every retained record, in order");
    let last = run(walship(&["read", "--server", &node.grpc, "--shard", "1", "--json", "--last", "3"]), None).await;
    assert_eq!(seqnos(&json_lines(&last)), vec![798, 799, 800], "{}", describe(&last));
    let compacted = run(walship(&["read", "--server", &node.grpc, "--shard", "1", "--from", "1"]), None).await;
    assert_failed(&compacted, 10, "compacted");
}

/// The proto additions over plain gRPC: `last` and `min_seqno` reads, and
/// their refusals (which change nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_request_last_and_min_seqno_over_grpc() {
    use walship_proto::log::ReadRequest;
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1-3", &[]);
    node.wait_healthy().await;
    let mut client = node.client().await;
    let request = AppendRequest {
        shard_id: 1,
        records: (1..=5).map(|i| AppendRecord { key: Default::default(), payload: format!("p{i}").into() }).collect(),
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    client.append(request).await.unwrap();
    let read = |r: ReadRequest| {
        let mut client = client.clone();
        async move {
            let mut call = tonic::Request::new(r);
            call.set_timeout(Duration::from_secs(1));
            client.read(call).await.map(|r| r.into_inner())
        }
    };
    let newest = read(ReadRequest { shard_id: 1, last: 2, ..Default::default() }).await.unwrap();
    assert_eq!(newest.records.iter().map(|r| r.seqno).collect::<Vec<_>>(), vec![4, 5]);
    assert_eq!((newest.durable_seqno, newest.first_seqno), (5, 1));
    let capped = read(ReadRequest { shard_id: 1, last: 2, to_seqno: 3, ..Default::default() }).await.unwrap();
    assert_eq!(capped.records.iter().map(|r| r.seqno).collect::<Vec<_>>(), vec![2, 3]);
    let all = read(ReadRequest { shard_id: 1, last: u64::MAX, ..Default::default() }).await.unwrap();
    assert_eq!(all.records.len(), 5);
    let empty = read(ReadRequest { shard_id: 2, last: 3, ..Default::default() }).await.unwrap();
    assert!(empty.records.is_empty(), "an empty shard: no records, no error");
    let waited = read(ReadRequest { shard_id: 1, from_seqno: 5, min_seqno: 5, ..Default::default() }).await.unwrap();
    assert_eq!(waited.records[0].seqno, 5);

    let both = read(ReadRequest { shard_id: 1, from_seqno: 1, last: 2, ..Default::default() }).await.unwrap_err();
    assert_eq!(both.code(), tonic::Code::InvalidArgument, "{both:?}");
    assert!(both.message().contains("from_seqno 0"), "{both:?}");
    let past = read(ReadRequest { shard_id: 1, last: 2, to_seqno: 9, ..Default::default() }).await.unwrap_err();
    assert_eq!(past.code(), tonic::Code::OutOfRange, "{past:?}");
    let unknown =
        read(ReadRequest { shard_id: 9, from_seqno: 1, min_seqno: 1, ..Default::default() }).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    // Refused at once with OUT_OF_RANGE, not UNAVAILABLE after waiting out
    // the call's deadline: the leader has not written seqno 6, and seqno 0
    // is never there.
    let ahead = read(ReadRequest { shard_id: 1, from_seqno: 1, min_seqno: 6, ..Default::default() }).await.unwrap_err();
    assert_eq!(ahead.code(), tonic::Code::OutOfRange, "{ahead:?}");
    assert!(ahead.message().contains("min_seqno 6") && ahead.message().contains("newest seqno 5"), "{ahead:?}");
    let from_zero = read(ReadRequest { shard_id: 1, min_seqno: 5, ..Default::default() }).await.unwrap_err();
    assert_eq!(from_zero.code(), tonic::Code::InvalidArgument, "{from_zero:?}");
    let backwards =
        read(ReadRequest { shard_id: 1, from_seqno: 3, to_seqno: 2, min_seqno: 9, ..Default::default() }).await;
    assert_eq!(backwards.unwrap_err().code(), tonic::Code::InvalidArgument);
    assert_eq!(durable(&node, 1).await, 5, "nothing changed");
}

/// A read that loses its replica between pages goes on from the next
/// seqno on another: every record once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_moves_to_another_replica_between_pages() {
    let mut cluster = Cluster::start(3, 1, "");
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let leader = cluster.nodes[0].grpc.clone();
    // 1 MB records: a read page (4 MiB by default) holds a few of them.
    let append = run(
        walship(&["append", "--server", &leader, "--shard", "1", "--count", "12", "--size", "1000000", "--batch", "4"]),
        None,
    )
    .await;
    assert!(append.status.success(), "{}", describe(&append));
    let servers = format!("{},{}", cluster.nodes[1].grpc, cluster.nodes[2].grpc);
    let mut read = tokio::process::Command::from(walship(&[
        "read",
        "--server",
        &servers,
        "--shard",
        "1",
        "--json",
        "--after-write",
        "12",
        "--request-timeout",
        "2s",
    ]))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true)
    .spawn()
    .expect("spawn read");
    let mut lines = BufReader::new(read.stdout.take().unwrap()).lines();
    let mut got = Vec::new();
    let first = tokio::time::timeout(CLI_TIMEOUT, lines.next_line()).await.expect("first line").unwrap().unwrap();
    got.push(serde_json::from_str::<Value>(&first).unwrap()["seqno"].as_u64().unwrap());
    // The read cannot ask for its next page before its output is drained
    // (each line is far larger than a pipe's buffer): freeze its replica now.
    cluster.signal(2, libc::SIGSTOP);
    while let Some(line) = tokio::time::timeout(CLI_TIMEOUT, lines.next_line()).await.expect("read line").unwrap() {
        got.push(serde_json::from_str::<Value>(&line).unwrap()["seqno"].as_u64().unwrap());
    }
    let status = read.wait().await.unwrap();
    let mut err = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut read.stderr.take().unwrap(), &mut err).await.unwrap();
    assert!(status.success(), "read failed: {err}");
    assert_eq!(got, (1..=12).collect::<Vec<_>>(), "every record once, in order");
    cluster.signal(2, libc::SIGCONT);
}
