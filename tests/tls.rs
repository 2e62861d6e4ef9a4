//! TLS on every listener: `walship dev --tls` (a throwaway CA, mutual TLS
//! between members and on gRPC ports) used through the CLI as an operator
//! would, refusals of callers without the CA or a client certificate, and
//! certificates that reload on SIGHUP and on file changes while the
//! process keeps serving. Real processes over real sockets.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{wait_until, walship_bin};

/// A `walship dev --tls` cluster on free ports.
struct TlsDev {
    child: Child,
    dir: tempfile::TempDir,
    grpc: Vec<String>,
    admin: String,
    export: Vec<(String, String)>,
}

impl Drop for TlsDev {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the child this test spawned; SIGTERM stops its children.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

impl TlsDev {
    fn start() -> TlsDev {
        use std::io::BufRead;
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(walship_bin())
            .args(["dev", "--tls", "--base-port", "0", "--shards", "2", "--data-dir"])
            .arg(dir.path().join("dev"))
            .env("WALSHIP_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let (mut grpc, mut admin, mut export) = (Vec::new(), None, Vec::new());
        for line in stdout.by_ref() {
            let line = line.unwrap();
            let words: Vec<&str> = line.split_whitespace().collect();
            if let Some(i) = words.iter().position(|w| *w == "gRPC")
                && words.first() == Some(&"node")
            {
                grpc.push(words[i + 1].to_string());
            }
            if words.first() == Some(&"coordinator")
                && let Some(url) = words.iter().find(|w| w.starts_with("https://"))
            {
                admin = Some(url.trim_end_matches("/v1/shards").to_string());
            }
            if words.first() == Some(&"export") && line.contains("WALSHIP_CA=") {
                export = words[1..]
                    .iter()
                    .filter_map(|w| w.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
            }
            if line.contains("Ctrl-C stops") {
                break;
            }
        }
        // Keep reading what it prints later (restarts), so its stdout stays open.
        std::thread::spawn(move || stdout.for_each(drop));
        assert_eq!(grpc.len(), 3, "three nodes printed");
        let admin = admin.expect("an https coordinator URL printed");
        assert_eq!(export.len(), 3, "an export line with WALSHIP_CA, WALSHIP_CERT and WALSHIP_KEY");
        TlsDev { child, dir, grpc, admin, export }
    }

    /// Runs a client command with the printed TLS settings, minus `without`.
    fn walship(&self, args: &[&str], without: &[&str]) -> std::process::Output {
        let mut command = Command::new(walship_bin());
        command.args(args).env_remove("WALSHIP_CA").env_remove("WALSHIP_CERT").env_remove("WALSHIP_KEY");
        for (k, v) in &self.export {
            if !without.contains(&k.as_str()) {
                command.env(k, v);
            }
        }
        command.output().unwrap()
    }

    fn tls_file(&self, name: &str) -> PathBuf {
        self.dir.path().join("dev").join("tls").join(name)
    }
}

fn text(output: &[u8]) -> String {
    String::from_utf8_lossy(output).to_string()
}

#[test]
fn a_tls_dev_cluster_serves_the_cli_and_refuses_callers_without_credentials() {
    let dev = TlsDev::start();
    // The throwaway keys are private.
    {
        use std::os::unix::fs::PermissionsExt;
        for key in ["member.key", "client.key"] {
            let mode = std::fs::metadata(dev.tls_file(key)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{key}");
        }
    }
    let server = dev.grpc.join(",");
    // Append through any node (the leader hint is followed over TLS), read
    // back from every replica once committed.
    let appended = dev
        .walship(&["append", "--server", &server, "--shard", "2", "--count", "5", "--size", "32", "--batch", "5"], &[]);
    assert!(appended.status.success(), "append over mutual TLS: {}", text(&appended.stderr));
    let grpc = dev.grpc[2].clone();
    let mut last = String::new();
    for _ in 0..100 {
        let read = dev.walship(&["read", "--server", &grpc, "--shard", "2", "--from", "1", "--json"], &[]);
        assert!(read.status.success(), "read over mutual TLS: {}", text(&read.stderr));
        last = text(&read.stdout);
        if last.lines().count() == 5 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(last.lines().count(), 5, "{last}");
    let status = dev.walship(&["status", "--admin", &dev.admin, "--json"], &[]);
    assert!(status.status.success(), "status over https: {}", text(&status.stderr));
    assert!(text(&status.stdout).contains("\"shard"), "{}", text(&status.stdout));

    // Without a client certificate the gRPC port refuses in the handshake
    // (mutual TLS); the admin API still answers (bearer tokens, browsers).
    let refused =
        dev.walship(&["read", "--server", &grpc, "--shard", "2", "--from", "1"], &["WALSHIP_CERT", "WALSHIP_KEY"]);
    assert_eq!(refused.status.code(), Some(12), "a read without a client certificate: {}", text(&refused.stderr));
    assert!(refused.stdout.is_empty(), "nothing served: {}", text(&refused.stdout));
    assert!(text(&refused.stderr).contains("--cert"), "the refusal says what is missing: {}", text(&refused.stderr));
    let status = dev.walship(&["status", "--admin", &dev.admin], &["WALSHIP_CERT", "WALSHIP_KEY"]);
    assert!(status.status.success(), "admin over TLS without a client certificate: {}", text(&status.stderr));

    // Plaintext to a TLS port: a clear failure, not a hang or a silent death.
    let plain = dev.walship(
        &["read", "--server", &grpc, "--shard", "2", "--from", "1"],
        &["WALSHIP_CA", "WALSHIP_CERT", "WALSHIP_KEY"],
    );
    assert_eq!(plain.status.code(), Some(7), "plaintext to a TLS port: {:?} {}", plain.status, text(&plain.stderr));
    assert!(text(&plain.stderr).starts_with("error: not a walship server"), "{}", text(&plain.stderr));
    assert!(text(&plain.stderr).contains("--ca"), "the failure points at TLS: {}", text(&plain.stderr));
    let plain_admin = dev.admin.replace("https://", "http://");
    let status = dev.walship(&["status", "--admin", &plain_admin], &["WALSHIP_CA", "WALSHIP_CERT", "WALSHIP_KEY"]);
    assert!(!status.status.success(), "plain HTTP to an https admin port answered");
    assert!(text(&status.stderr).contains("https://"), "{}", text(&status.stderr));

    // A CA that did not sign the servers' certificates: refused.
    let other = tempfile::tempdir().unwrap();
    let (other_ca, _, _) = make_leaf(other.path(), "other");
    let mut wrong = Command::new(walship_bin());
    wrong
        .args(["read", "--server", &grpc, "--shard", "2", "--from", "1"])
        .env("WALSHIP_CA", &other_ca)
        .env_remove("WALSHIP_CERT")
        .env_remove("WALSHIP_KEY");
    let wrong = wrong.output().unwrap();
    assert!(!wrong.status.success() && wrong.stdout.is_empty(), "a server not signed by --ca was trusted");
}

/// A CA and a leaf certificate for 127.0.0.1 signed by it, written into
/// `dir` as `<name>-ca.pem`, `<name>.pem`, `<name>.key`.
fn make_leaf(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let (cert, key) = leaf_signed_by(&ca_cert, &ca_key);
    let paths = (dir.join(format!("{name}-ca.pem")), dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
    std::fs::write(&paths.0, ca_cert.pem()).unwrap();
    std::fs::write(&paths.1, cert).unwrap();
    std::fs::write(&paths.2, key).unwrap();
    (paths.0, paths.1, paths.2)
}

fn leaf_signed_by(ca: &rcgen::Certificate, ca_key: &rcgen::KeyPair) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    params.extended_key_usages =
        vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    (params.signed_by(&key, ca, ca_key).unwrap().pem(), key.serialize_pem())
}

/// The certificate `addr` presents now (a fresh TLS connection).
async fn served_certificate(addr: &str, ca: &Path) -> Vec<u8> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let stream = connector.connect(name, tcp).await.unwrap();
    stream.get_ref().1.peer_certificates().unwrap()[0].as_ref().to_vec()
}

fn first_der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap().as_ref().to_vec()
}

/// A node serving TLS picks up a renewed certificate on SIGHUP and when
/// the files change, keeps serving with the old one when the new files are
/// broken, and every new connection gets the current certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_reload_on_sighup_and_on_file_changes() {
    let dir = tempfile::tempdir().unwrap();
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let (ca_path, cert_path, key_path) =
        (dir.path().join("ca.pem"), dir.path().join("node.pem"), dir.path().join("node.key"));
    std::fs::write(&ca_path, ca_cert.pem()).unwrap();
    let install = |(cert, key): &(String, String)| {
        // Write-then-rename, as certificate tools do, so no reader sees half a file.
        for (path, text) in [(&key_path, key), (&cert_path, cert)] {
            let tmp = path.with_extension("new");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, path).unwrap();
        }
    };
    let first = leaf_signed_by(&ca_cert, &ca_key);
    install(&first);
    let (g, a) = (common::free_port(), common::free_port());
    let cluster = dir.path().join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "secret = \"{}\"\n[[nodes]]\nid = 1\ngrpc_addr = \"127.0.0.1:{g}\"\nadmin_addr = \"127.0.0.1:{a}\"\n\
             [[shards]]\nid = 1\nreplicas = [1]\nleader = 1\n\
             [tls]\nca = \"ca.pem\"\ncert = \"node.pem\"\nkey = \"node.key\"\n",
            common::SECRET
        ),
    )
    .unwrap();
    let (mut node, _) = common::spawn_listening(
        Command::new(walship_bin())
            .args(["node", "--node-id", "1", "--wal-prefill", "false", "--cluster"])
            .arg(&cluster)
            .arg("--data-dir")
            .arg(dir.path().join("data")),
        "a TLS node",
    );
    let (grpc, admin) = (format!("127.0.0.1:{g}"), format!("127.0.0.1:{a}"));
    for addr in [&grpc, &admin] {
        assert_eq!(
            served_certificate(addr, &ca_path).await,
            first_der(&first.0),
            "{addr} serves the first certificate"
        );
    }

    // Renewed, then SIGHUP: new connections get the new certificate.
    let second = leaf_signed_by(&ca_cert, &ca_key);
    install(&second);
    // SAFETY: kill(2) on the node this test spawned.
    assert_eq!(unsafe { libc::kill(node.id() as i32, libc::SIGHUP) }, 0);
    for addr in [&grpc, &admin] {
        wait_until("the renewed certificate served after SIGHUP", Duration::from_secs(10), || {
            let (addr, ca, want) = (addr.clone(), ca_path.clone(), first_der(&second.0));
            async move { served_certificate(&addr, &ca).await == want }
        })
        .await;
    }

    // Broken files (a key that does not match): the previous certificate
    // stays in service.
    let third = leaf_signed_by(&ca_cert, &ca_key);
    install(&(third.0.clone(), first.1.clone()));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(node.id() as i32, libc::SIGHUP) }, 0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(matches!(node.try_wait(), Ok(None)), "a broken certificate must not stop the node");
    assert_eq!(served_certificate(&grpc, &ca_path).await, first_der(&second.0), "the previous certificate stays");

    // Fixed files, no signal: the file watch picks them up.
    let fourth = leaf_signed_by(&ca_cert, &ca_key);
    install(&fourth);
    wait_until("the renewed certificate served after a file change", Duration::from_secs(15), || {
        let (addr, ca, want) = (grpc.clone(), ca_path.clone(), first_der(&fourth.0));
        async move { served_certificate(&addr, &ca).await == want }
    })
    .await;
    let _ = node.kill();
    let _ = node.wait();
}

/// The "Trying it" walkthrough of ops/README.md's TLS section runs as
/// printed (with this build's `walship` first on PATH).
#[test]
fn the_tls_walkthrough_in_the_ops_readme_runs_as_printed() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/ops/README.md")).unwrap();
    let from = readme.find("**Trying it.**").expect("the walkthrough");
    let block = readme[from..].split("```sh\n").nth(1).unwrap().split("```").next().unwrap();
    assert!(block.contains("walship dev --tls") && block.contains("kill %1"), "{block}");
    let bin = walship_bin();
    let path = format!("{}:{}", bin.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
    let _ = std::fs::remove_dir_all("/tmp/walship-tls");
    let output =
        Command::new("bash").args(["-e", "-c", block]).env("PATH", path).env("WALSHIP_LOG", "warn").output().unwrap();
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "the walkthrough failed:\n{stdout}\n{}", text(&output.stderr));
    assert!(stdout.contains("appended shard 1"), "{stdout}");
    assert!(stdout.contains("\"node_id\":1"), "curl over https reached node 1's status: {stdout}");
    let _ = std::fs::remove_dir_all("/tmp/walship-tls");
}
