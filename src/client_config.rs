//! Defaults for the client commands from a config file:
//! `$WALSHIP_CLIENT_CONFIG`, else `~/.config/walship/client.toml`.
//! Flags and environment variables (`WALSHIP_ADMIN`, `WALSHIP_TOKEN`,
//! `WALSHIP_SERVER`) win over it. The data commands' timeouts come from
//! flags or `WALSHIP_CONNECT_TIMEOUT`, `WALSHIP_REQUEST_TIMEOUT`,
//! `WALSHIP_DEADLINE` and `WALSHIP_IDLE_TIMEOUT` (see `walship read --help`).
//!
//! ```toml
//! admin = "http://10.0.0.10:7380"   # coordinator admin URL
//! token = "..."                     # bearer token for mutating calls
//! server = "10.0.0.1:7400,10.0.0.2:7400,10.0.0.3:7400"  # nodes, for append/read/tail
//! ```

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    pub admin: Option<String>,
    pub token: Option<String>,
    pub server: Option<String>,
}

fn path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("WALSHIP_CLIENT_CONFIG") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".config/walship/client.toml"))
}

/// The config file's values; an absent file gives none, a broken one an error.
pub fn load() -> Result<ClientConfig> {
    let Some(path) = path() else { return Ok(ClientConfig::default()) };
    match std::fs::read_to_string(&path) {
        Ok(text) => toml::from_str(&text).with_context(|| format!("parsing {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ClientConfig::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}
