//! The README's "Using it" block, run as printed against a real `walship
//! dev` cluster, so that it cannot rot.
//!
//! The block's first command (`walship dev`) is started by the test itself,
//! as the README says (in a terminal of its own), with `--base-port B` on a
//! free range; every other command runs in one `bash -euo pipefail` script
//! from the directory `walship dev` was started in (its data dir is the
//! default `.walship/dev` there), with the `walship` under test first on
//! PATH. Ports are substituted as the README documents: 74xx becomes B+xx.
//! A command that follows forever (`walship tail`) runs in the background
//! until it has printed the record the block appended, then is stopped.
//! `BROWSER=echo` makes `xdg-open` print the dashboard URL on a machine
//! without a desktop instead of starting a text browser.

mod common;

use std::process::{Command, Stdio};

use common::dev::DevProcess;

/// The commands of the README's "Using it" block, one per line.
fn using_it_block() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme.split("\n## Using it\n").nth(1).expect("a \"## Using it\" section");
    let block = section.split("```sh\n").nth(1).expect("a sh block").split("\n```").next().unwrap();
    block.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect()
}

/// Rewrites every 74xx port (7400..=7499) in `line` to `base + xx`.
fn substitute_ports(line: &str, base: u16) -> String {
    let mut out = String::new();
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let digits = bytes[i..].iter().take_while(|b| b.is_ascii_digit()).count();
        let prior_digit = i > 0 && bytes[i - 1].is_ascii_digit();
        if !prior_digit && digits == 4 && line[i..].starts_with("74") {
            let xx: u16 = line[i + 2..i + 4].parse().unwrap();
            out += &(base + xx).to_string();
            i += 4;
        } else {
            out.push(bytes[i] as char);
            i += 1;
        }
    }
    out
}

/// A base port whose every port dev uses (B+1..=3, B+80..=83, B+90) is free.
fn free_base() -> u16 {
    for _ in 0..200 {
        let base = 20_000 + (rand_u16() % 20_000) / 100 * 100;
        let offsets = [1u16, 2, 3, 80, 81, 82, 83, 90];
        if offsets.iter().all(|o| std::net::TcpListener::bind(("127.0.0.1", base + o)).is_ok()) {
            return base;
        }
    }
    panic!("no free port range for walship dev");
}

fn rand_u16() -> u16 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    (nanos ^ std::process::id()) as u16
}

#[test]
fn substitution_rewrites_only_whole_74xx_ports() {
    assert_eq!(substitute_ports("127.0.0.1:7401 :7480 7403-7499", 30000), "127.0.0.1:30001 :30080 30003-30099");
    assert_eq!(substitute_ports("--volume-mib 64 17401 74010 7500", 30000), "--volume-mib 64 17401 74010 7500");
}

#[test]
fn the_readme_using_it_block_runs_as_printed() {
    let lines = using_it_block();
    assert!(lines[0].starts_with("walship dev "), "the block starts with walship dev: {lines:?}");
    let dir = tempfile::tempdir().unwrap();
    let base = free_base();
    // As printed, from `dir`: the data dir is the default .walship/dev there.
    let data = dir.path().join(".walship/dev");
    let dev = DevProcess::start(&data, &["--base-port", &base.to_string()]);
    assert_eq!(dev.admin, format!("http://127.0.0.1:{}", base + 80), "{}", dev.output());

    let bin_dir = common::walship_bin().parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut script = String::from("set -euo pipefail\n");
    for line in &lines[1..] {
        let command = substitute_ports(line, base);
        script += &format!("echo {} >&2\n", shell_quote(&format!("+ {command}")));
        if command.starts_with("walship tail ") {
            // Follows forever: until it printed the record appended above.
            let command = command.split(" #").next().unwrap();
            script += &format!(
                "{command} > tail.out & TAIL=$!\n\
                 for i in $(seq 600); do grep -q hello tail.out && break; kill -0 $TAIL; sleep 0.1; done\n\
                 grep -q hello tail.out; kill $TAIL; wait $TAIL || true\n"
            );
        } else {
            script += &command;
            script += "\n";
        }
    }
    script += "echo README-BLOCK-DONE >&2\n";
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(dir.path())
        .env("PATH", path)
        .env("WALSHIP_LOG", "warn")
        // xdg-open without a desktop falls back to $BROWSER: print the URL
        // rather than start a text browser.
        .env("BROWSER", "echo")
        .env_remove("WALSHIP_ADMIN")
        .env_remove("WALSHIP_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && stderr.contains("README-BLOCK-DONE"),
        "a command of the README block failed (the last `+` line below):\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    // What the commands printed, roughly: the drills' summaries, the preview.
    assert!(stdout.contains("failover drill") && stdout.contains("catchup drill"), "{stdout}");
    assert!(stdout.contains("\"candidates\""), "the failover preview: {stdout}");
    drop(dev);
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Text files of the repository (what a reader or the build sees), without
/// build output, tools and installed packages.
fn repository_files() -> Vec<std::path::PathBuf> {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.') && !["target", "node_modules", "__pycache__", "tmp"].contains(&name.as_str())
                {
                    walk(&path, out);
                }
            } else if [".md", ".rs", ".toml", ".yaml", ".yml", ".sh", ".service", ".conf", ".env", ".proto", ".json"]
                .iter()
                .any(|ext| name.ends_with(ext))
                && name != "Cargo.lock"
            {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(std::path::Path::new(env!("CARGO_MANIFEST_DIR")), &mut out);
    out
}

/// No file points a reader outside the repository: every `http(s)://` URL
/// names a loopback, private-example or placeholder host, never a web site.
#[test]
fn nothing_in_the_repository_links_outside_it() {
    let mut outside = Vec::new();
    for path in repository_files() {
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        for (n, line) in text.lines().enumerate() {
            for scheme in ["http://", "https://"] {
                for (i, _) in line.match_indices(scheme) {
                    let host: String = line[i + scheme.len()..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-')
                        .collect();
                    // A web site has a dotted name with letters in its last label.
                    let web =
                        host.rsplit_once('.').is_some_and(|(_, tld)| tld.chars().any(|c| c.is_ascii_alphabetic()));
                    if web {
                        outside.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                    }
                }
            }
        }
    }
    assert!(outside.is_empty(), "links outside the repository:\n{}", outside.join("\n"));
}

/// Every relative link in the Markdown files (`[text](path)`) names a file
/// or directory of the repository.
#[test]
fn every_relative_markdown_link_resolves() {
    let mut broken = Vec::new();
    for path in repository_files().into_iter().filter(|p| p.extension().is_some_and(|e| e == "md")) {
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, _) in text.match_indices("](") {
            let target: String = text[i + 2..].chars().take_while(|c| *c != ')').collect();
            let target = target.split('#').next().unwrap();
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            if !path.parent().unwrap().join(target).exists() {
                broken.push(format!("{}: {target}", path.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
