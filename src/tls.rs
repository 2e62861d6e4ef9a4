//! TLS for every listener of a node or coordinator (gRPC and admin HTTP),
//! with certificates that reload without a restart.
//!
//! A [`ReloadingTls`] holds the current `rustls` server configuration built
//! from the cluster's `[tls]` files. It is rebuilt on SIGHUP and whenever
//! one of the files changes (checked every [`RELOAD_POLL`]); a rebuild that
//! fails (a half-written file, a key that does not match) is logged and the
//! previous certificate stays in use. Each accepted connection takes the
//! configuration current at its handshake, so a renewed certificate reaches
//! every new connection and existing ones keep theirs.
//!
//! Handshakes run off the accept loop with a deadline
//! ([`HANDSHAKE_TIMEOUT`]), so a client that connects and says nothing
//! holds no other client up.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use walship_shipping::config::{TlsConfig, write_private};

/// How often the certificate files are checked for changes.
pub const RELOAD_POLL: Duration = Duration::from_secs(2);

/// The longest a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted connections waiting for the server to take them.
const ACCEPT_QUEUE: usize = 128;

/// Which listener a configuration is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    /// gRPC: HTTP/2 only; client certificates required when the cluster
    /// asks for mutual TLS.
    Grpc,
    /// Admin HTTP: HTTP/2 or HTTP/1.1; no client certificate asked for
    /// (browsers, curl with a bearer token).
    Admin,
}

/// A server TLS configuration that follows its files.
pub struct ReloadingTls {
    files: TlsConfig,
    listener: Listener,
    current: RwLock<Arc<ServerConfig>>,
    stamps: RwLock<Vec<Option<SystemTime>>>,
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing the certificates in {}", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no certificate", path.display());
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).with_context(|| format!("reading a private key from {}", path.display()))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Builds the server configuration `files` describe for `listener`.
pub fn server_config(files: &TlsConfig, listener: Listener) -> Result<ServerConfig> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = if listener == Listener::Grpc && files.require_client_cert {
        let mut roots = RootCertStore::empty();
        for ca in certs(&files.ca)? {
            roots.add(ca).with_context(|| format!("adding the CA in {}", files.ca.display()))?;
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .context("building the client certificate verifier")?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder
        .with_single_cert(certs(&files.cert)?, key(&files.key)?)
        .with_context(|| format!("{} does not match the key in {}", files.cert.display(), files.key.display()))?;
    config.alpn_protocols = match listener {
        Listener::Grpc => vec![b"h2".to_vec()],
        Listener::Admin => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
    };
    Ok(config)
}

fn stamp(path: &PathBuf) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl ReloadingTls {
    /// Loads `files` now (an error here stops the process from starting).
    pub fn load(files: TlsConfig, listener: Listener) -> Result<Arc<ReloadingTls>> {
        let config = server_config(&files, listener)?;
        let stamps = [&files.ca, &files.cert, &files.key].into_iter().map(stamp).collect();
        Ok(Arc::new(ReloadingTls {
            files,
            listener,
            current: RwLock::new(Arc::new(config)),
            stamps: RwLock::new(stamps),
        }))
    }

    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.read().expect("tls lock").clone())
    }

    /// Rebuilds from the files; keeps the current configuration when that
    /// fails. Answers whether a new one is in use.
    pub fn reload(&self, why: &str) -> bool {
        let stamps: Vec<_> = [&self.files.ca, &self.files.cert, &self.files.key].into_iter().map(stamp).collect();
        match server_config(&self.files, self.listener) {
            Ok(config) => {
                *self.current.write().expect("tls lock") = Arc::new(config);
                *self.stamps.write().expect("tls lock") = stamps;
                tracing::info!(listener = ?self.listener, cert = %self.files.cert.display(), why, "TLS certificate reloaded");
                true
            }
            Err(error) => {
                // Remember the stamps anyway: one error line per change,
                // not one per poll, until the files change again.
                *self.stamps.write().expect("tls lock") = stamps;
                tracing::error!(listener = ?self.listener, why, error = format!("{error:#}"), "TLS reload failed; keeping the previous certificate");
                false
            }
        }
    }

    fn changed(&self) -> bool {
        let now: Vec<_> = [&self.files.ca, &self.files.cert, &self.files.key].into_iter().map(stamp).collect();
        now != *self.stamps.read().expect("tls lock")
    }

    /// Reloads on SIGHUP and on file changes until `stop`.
    pub fn watch(self: &Arc<Self>, stop: CancellationToken) {
        let tls = self.clone();
        tokio::spawn(async move {
            let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(hup) => Some(hup),
                Err(error) => {
                    tracing::warn!(%error, "no SIGHUP handler: certificates reload on file changes only");
                    None
                }
            };
            let mut poll = tokio::time::interval(RELOAD_POLL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let hangup = async {
                    match hup.as_mut() {
                        Some(hup) => hup.recv().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = hangup => { tls.reload("SIGHUP"); }
                    _ = poll.tick() => {
                        if tls.changed() {
                            tls.reload("files changed");
                        }
                    }
                }
            }
        });
    }
}

/// A listener whose connections arrive with their TLS handshake done
/// (an `axum::serve` listener; [`TlsListener::into_stream`] for tonic).
pub struct TlsListener {
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Accepts on `listener`, handshaking with `tls`'s current
    /// configuration, until `stop` or until this listener is dropped.
    pub fn new(listener: TcpListener, tls: Arc<ReloadingTls>, stop: CancellationToken) -> io::Result<TlsListener> {
        let local = listener.local_addr()?;
        let (tx, accepted) = mpsc::channel(ACCEPT_QUEUE);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tx.closed() => return,
                    accepted = listener.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(error) => {
                            // EMFILE and friends: back off instead of spinning.
                            tracing::warn!(%error, "accepting a connection");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, tx) = (tls.acceptor(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { accepted, local })
    }

    /// The accepted connections as the stream tonic serves.
    pub fn into_stream(self) -> impl futures::Stream<Item = io::Result<TlsStream<TcpStream>>> {
        futures::stream::unfold(self.accepted, |mut rx| async move {
            let (stream, _) = rx.recv().await?;
            Some((Ok(stream), rx))
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The accept loop stopped (shutdown): nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// A process's own certificate pair, instead of the cluster config's
/// `[tls]` `cert`/`key` (one cluster file, a different pair per machine).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct OwnCertificate {
    /// PEM certificate chain this process serves and presents to peers
    /// (overrides the cluster config's `tls.cert`).
    #[arg(long, env = "WALSHIP_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (overrides `tls.key`).
    #[arg(long, env = "WALSHIP_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl OwnCertificate {
    /// Applies the override to `cluster`'s `[tls]`, which must exist.
    pub fn apply(&self, cluster: &mut walship_shipping::ClusterConfig) -> Result<()> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else { return Ok(()) };
        let Some(tls) = cluster.tls.as_mut() else {
            bail!("--tls-cert/--tls-key need a [tls] section (with the cluster CA) in the cluster config");
        };
        tls.cert = cert.clone();
        tls.key = key.clone();
        Ok(())
    }
}

/// Serves `router` (tonic) on `listener` until `stop`, over TLS when the
/// cluster has it.
pub async fn serve_grpc(
    router: tonic::transport::server::Router,
    listener: TcpListener,
    tls: Option<&TlsConfig>,
    stop: CancellationToken,
) -> Result<()> {
    match tls {
        Some(files) => {
            let tls = ReloadingTls::load(files.clone(), Listener::Grpc)?;
            tls.watch(stop.clone());
            let incoming = TlsListener::new(listener, tls, stop.clone())?.into_stream();
            router.serve_with_incoming_shutdown(incoming, stop.cancelled_owned()).await
        }
        None => {
            // Small request/response RPCs: Nagle plus delayed ACKs would add ~40 ms.
            let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            router.serve_with_incoming_shutdown(incoming, stop.cancelled_owned()).await
        }
    }
    .context("gRPC server")
}

/// Serves the admin `app` on `listener` until `stop`, over TLS when the
/// cluster has it; handlers see the caller's address (`ConnectInfo`).
pub async fn serve_admin(
    app: axum::Router,
    listener: TcpListener,
    tls: Option<&TlsConfig>,
    stop: CancellationToken,
) -> Result<()> {
    use axum::serve::ListenerExt;
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    match tls {
        Some(files) => {
            let tls = ReloadingTls::load(files.clone(), Listener::Admin)?;
            tls.watch(stop.clone());
            let listener = TlsListener::new(listener, tls, stop.clone())?.tap_io(|_| {});
            axum::serve(listener, service).with_graceful_shutdown(stop.cancelled_owned()).await
        }
        None => axum::serve(listener, service).with_graceful_shutdown(stop.cancelled_owned()).await,
    }
    .context("admin server")
}

/// TLS for the client commands (`append`, `read`, `tail`, `status`,
/// `failover`, `drill`), global flags so they read the same on any of them.
/// `--ca` alone: the server is verified and the connection encrypted;
/// `--cert`/`--cert-key` as well: this client presents a certificate, which a
/// cluster with `require_client_cert` asks for on its gRPC ports.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ClientTls {
    /// PEM CA certificate to verify servers with; turns TLS on for the
    /// client commands (gRPC and admin HTTP).
    #[arg(long, global = true, env = "WALSHIP_CA")]
    pub ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS (with --cert-key).
    #[arg(long, global = true, env = "WALSHIP_CERT", requires = "cert_key")]
    pub cert: Option<PathBuf>,
    /// PEM private key of --cert (`--key` is a record's key).
    #[arg(long, global = true, env = "WALSHIP_KEY", requires = "cert")]
    pub cert_key: Option<PathBuf>,
}

static CLIENT_TLS: std::sync::OnceLock<ClientTls> = std::sync::OnceLock::new();

impl ClientTls {
    /// Makes these the settings of this process's client commands.
    pub fn install(self) -> Result<()> {
        if self.ca.is_none() && self.cert.is_some() {
            bail!("--cert/--cert-key need --ca (the CA that signed the servers' certificates)");
        }
        for path in [&self.ca, &self.cert, &self.cert_key].into_iter().flatten() {
            std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
        }
        let _ = CLIENT_TLS.set(self);
        Ok(())
    }

    /// The CLI's settings for `certificates`.
    pub fn for_local(certificates: &LocalCertificates) -> ClientTls {
        ClientTls {
            ca: Some(certificates.ca.clone()),
            cert: Some(certificates.client_cert.clone()),
            cert_key: Some(certificates.client_key.clone()),
        }
    }

    /// This process's client TLS settings, if TLS is on.
    pub fn current() -> Option<&'static ClientTls> {
        CLIENT_TLS.get().filter(|t| t.ca.is_some())
    }

    /// The tonic client TLS settings.
    pub fn grpc(&self) -> Result<tonic::transport::ClientTlsConfig> {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let ca = self.ca.as_ref().context("--ca")?;
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?));
        if let (Some(cert), Some(key)) = (&self.cert, &self.cert_key) {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        Ok(config)
    }

    /// A connector for HTTPS (HTTP/1.1) to the admin APIs.
    pub fn https(&self) -> Result<tokio_rustls::TlsConnector> {
        let mut roots = RootCertStore::empty();
        for ca in certs(self.ca.as_ref().context("--ca")?)? {
            roots.add(ca).context("adding the CA")?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_root_certificates(roots);
        let mut config = match (&self.cert, &self.cert_key) {
            (Some(cert), Some(key)) => builder.with_client_auth_cert(certs(cert)?, self::key(key)?)?,
            _ => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }
}

/// Throwaway certificates for a local cluster (`walship dev --tls`, tests,
/// `walship bench --tls`): a CA, one server-and-client certificate for
/// `localhost`, 127.0.0.1 and ::1 that every process shares, and a client
/// certificate for the CLI. Written as PEM files into `dir` (keys 0600).
pub struct LocalCertificates {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl LocalCertificates {
    pub fn generate(dir: &Path) -> Result<LocalCertificates> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
        };
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        // Absolute: the cluster config naming them lives in another folder.
        let dir = &std::fs::canonicalize(dir)?;
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "walship local CA (throwaway)");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca.self_signed(&ca_key)?;
        let leaf = |names: Vec<String>, cn: &str, usages: Vec<ExtendedKeyUsagePurpose>| -> Result<(String, String)> {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(names)?;
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = usages;
            Ok((params.signed_by(&key, &ca_cert, &ca_key)?.pem(), key.serialize_pem()))
        };
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
        let both = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let (cert, key) = leaf(names, "walship local member", both)?;
        let (client_cert, client_key) =
            leaf(Vec::new(), "walship local client", vec![ExtendedKeyUsagePurpose::ClientAuth])?;
        let files = LocalCertificates {
            ca: dir.join("ca.pem"),
            cert: dir.join("member.pem"),
            key: dir.join("member.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
        };
        std::fs::write(&files.ca, ca_cert.pem())?;
        std::fs::write(&files.cert, cert)?;
        write_private(&files.key, &key).with_context(|| format!("writing {}", files.key.display()))?;
        std::fs::write(&files.client_cert, client_cert)?;
        write_private(&files.client_key, &client_key)
            .with_context(|| format!("writing {}", files.client_key.display()))?;
        Ok(files)
    }

    /// The cluster `[tls]` section these files make, with mutual TLS.
    pub fn cluster_tls(&self) -> TlsConfig {
        TlsConfig { ca: self.ca.clone(), cert: self.cert.clone(), key: self.key.clone(), require_client_cert: true }
    }

    /// The line that points the CLI at them.
    pub fn export_line(&self) -> String {
        format!(
            "export WALSHIP_CA={} WALSHIP_CERT={} WALSHIP_KEY={}",
            self.ca.display(),
            self.client_cert.display(),
            self.client_key.display()
        )
    }
}

/// What a failed call's error chain (`chain`, its sources joined) says
/// about TLS, in an operator's words: the handshake alert or certificate
/// problem behind a bare "transport error", or a plaintext client talking
/// to a TLS port. `None` when it is not about TLS.
pub fn hint(chain: &str) -> Option<&'static str> {
    let tls = ClientTls::current();
    let dropped = ["broken pipe", "h2 protocol error", "reset", "not ready", "frame with invalid size", "closed"]
        .iter()
        .any(|w| chain.contains(w));
    if chain.contains("CertificateRequired") {
        Some(
            "the server requires a client certificate (mutual TLS): pass --cert and --cert-key (or WALSHIP_CERT/WALSHIP_KEY)",
        )
    } else if chain.contains("UnknownCA") || chain.contains("BadCertificate") || chain.contains("CertificateUnknown") {
        Some("the server refused this client's certificate: it is not signed by the cluster's CA")
    } else if chain.contains("invalid peer certificate") {
        Some("the server's certificate is not valid for --ca and this address")
    } else if chain.contains("InvalidContentType") || chain.contains("corrupt message") {
        Some("the server does not speak TLS here: drop --ca, or use the right port")
    } else if dropped && tls.is_some_and(|t| t.cert.is_none()) {
        Some(
            "the server dropped the connection: if it requires client certificates (mutual TLS), pass --cert and --cert-key",
        )
    } else {
        None
    }
}

/// What to add to a "not a walship server" diagnosis: a TLS port spoken
/// to in plaintext looks just like one.
pub fn plaintext_note() -> &'static str {
    if ClientTls::current().is_none() { "; or a TLS port: then pass --ca (or WALSHIP_CA)" } else { "" }
}
