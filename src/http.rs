//! A minimal HTTP/1.1 JSON client for the CLI's admin-API commands (one
//! request per connection; the admin API is on loopback or a trusted
//! network, and plain HTTP like the rest of walship's admin surface).

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Splits `http://host:port` (scheme optional) into `host:port`.
fn authority(base: &str) -> &str {
    base.trim_start_matches("http://").trim_end_matches('/')
}

/// Sends a request; returns (status, body as JSON).
pub async fn request(
    method: &str,
    base: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> Result<(u16, serde_json::Value)> {
    let host = authority(base);
    if base.starts_with("https://") {
        bail!("https admin URLs are not supported; use http://");
    }
    let mut stream = tokio::net::TcpStream::connect(host).await.with_context(|| format!("connecting to {host}"))?;
    let body = body.unwrap_or("");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let (head, payload) = text.split_once("\r\n\r\n").context("malformed HTTP response")?;
    let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).context("malformed HTTP status")?;
    let payload = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(payload)
    } else {
        payload.to_string()
    };
    let json = serde_json::from_str(&payload).unwrap_or(serde_json::Value::String(payload));
    Ok((status, json))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}
