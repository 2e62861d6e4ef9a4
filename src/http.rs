//! A minimal HTTP/1.1 JSON client for the CLI's admin-API commands (one
//! request per connection), over TLS for `https://` admin URLs (verified
//! against `--ca`; `--ca` also turns a bare `host:port` into https).

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Splits `http://host:port` (scheme optional) into `host:port`.
fn authority(base: &str) -> &str {
    base.trim_start_matches("http://").trim_start_matches("https://").trim_end_matches('/')
}

/// Sends a request; returns (status, body as JSON).
pub async fn request(
    method: &str,
    base: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> Result<(u16, serde_json::Value)> {
    let (status, payload) = request_raw(method, base, path, body, token).await?;
    let payload = String::from_utf8_lossy(&payload).to_string();
    let json = serde_json::from_str(&payload).unwrap_or(serde_json::Value::String(payload));
    Ok((status, json))
}

/// Sends a request; returns (status, body bytes).
pub async fn request_raw(
    method: &str,
    base: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> Result<(u16, Vec<u8>)> {
    let host = authority(base);
    let tls = crate::tls::ClientTls::current();
    let https = base.starts_with("https://") || (tls.is_some() && !base.starts_with("http://"));
    let tcp = tokio::net::TcpStream::connect(host).await.with_context(|| format!("connecting to {host}"))?;
    let body = body.unwrap_or("");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n",
        body.len()
    );
    let raw = if https {
        let tls = tls.with_context(|| format!("{base}: https needs --ca (or WALSHIP_CA)"))?;
        let name = host.rsplit_once(':').map_or(host, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
        let name = rustls::pki_types::ServerName::try_from(name.to_string())
            .with_context(|| format!("{name:?} is not a host name or IP address"))?;
        let stream = tls.https()?.connect(name, tcp).await.with_context(|| format!("TLS handshake with {host}"))?;
        exchange(stream, &head, body).await?
    } else {
        exchange(tcp, &head, body).await?
    };
    if !raw.starts_with(b"HTTP/") {
        bail!(
            "{base} did not answer in HTTP{}",
            if https { "" } else { " (if it serves TLS, use an https:// URL and --ca)" }
        );
    }
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").context("malformed HTTP response")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let payload = &raw[split + 4..];
    let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).context("malformed HTTP status")?;
    let payload = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(payload)
    } else {
        payload.to_vec()
    };
    Ok((status, payload))
}

/// Writes one request and reads the whole answer (the server closes).
async fn exchange(
    mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    head: &str,
    body: &str,
) -> Result<Vec<u8>> {
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.flush().await?;
    let mut raw = Vec::new();
    // A TLS server may close without close_notify: what was read counts.
    match stream.read_to_end(&mut raw).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e.into()),
    }
    Ok(raw)
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&body[..eol]).to_string();
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        let rest = &body[eol + 2..];
        if n == 0 || rest.len() < n {
            break;
        }
        out.extend_from_slice(&rest[..n]);
        body = rest[n..].strip_prefix(b"\r\n").unwrap_or(&rest[n..]);
    }
    out
}
