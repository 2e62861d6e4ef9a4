//! Authentication of the cluster's own RPCs.
//!
//! `WalShipping` (segments, catch-up, heartbeats) and `Control` (fence,
//! assign, position, drills) change who leads and what a replica holds, so
//! only members of the cluster may call them: every such call carries the
//! cluster secret in the `x-walship-cluster-secret` metadata entry, and a
//! server answers `UNAUTHENTICATED` (before the handler runs, so nothing
//! changes) to a call without it or with a wrong one. The client-facing
//! `Log` service, health and reflection stay open to clients.
//!
//! The secret comes from the cluster config (`secret` or `secret_file`) or
//! `WALSHIP_CLUSTER_SECRET`; it is compared in constant time (over SHA-256
//! digests, so not even its length leaks through timing), marked sensitive
//! in HTTP/2 (never HPACK-indexed), and never printed: its `Debug` shows
//! `<redacted>`. On a network where the secret could be sniffed, run the
//! cluster with TLS (see `tls.rs` in the binary), which also offers mutual
//! TLS so that only holders of a certificate from the cluster CA connect.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The metadata entry a cluster RPC carries its secret in.
pub const SECRET_HEADER: &str = "x-walship-cluster-secret";

/// The shortest secret accepted: 16 characters (a 32-hex-digit secret, as
/// `walship dev` generates, carries 128 bits).
pub const MIN_SECRET_LEN: usize = 16;

/// The environment variable that overrides the config file's secret.
pub const SECRET_ENV: &str = "WALSHIP_CLUSTER_SECRET";

/// The shared secret of a cluster's members. Cheap to clone; never shown.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<str>);

/// Why a secret was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("the cluster secret must be at least {MIN_SECRET_LEN} characters (it has {0})")]
    TooShort(usize),
    #[error("the cluster secret must be printable ASCII without spaces (it is sent as gRPC metadata)")]
    NotPrintable,
}

impl ClusterSecret {
    pub fn new(secret: &str) -> Result<ClusterSecret, SecretError> {
        let secret = secret.trim();
        if !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(SecretError::NotPrintable);
        }
        if secret.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort(secret.len()));
        }
        Ok(ClusterSecret(secret.into()))
    }

    /// A fresh random secret (128 bits, hex), for a cluster whose every
    /// member runs in one process tree (`walship dev`, a single node).
    pub fn random() -> ClusterSecret {
        ClusterSecret(format!("{:032x}", rand::random::<u128>()).into())
    }

    /// The secret itself, to hand to a child process or write to a
    /// private file. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn digest(bytes: &[u8]) -> [u8; 32] {
        Sha256::digest(bytes).into()
    }

    /// Whether `offered` is this secret, in time independent of both.
    pub fn matches(&self, offered: &[u8]) -> bool {
        Self::digest(self.0.as_bytes()).ct_eq(&Self::digest(offered)).into()
    }

    fn header_value(&self) -> AsciiMetadataValue {
        let mut value: AsciiMetadataValue =
            MetadataValue::try_from(self.expose()).expect("a checked secret is printable ASCII");
        value.set_sensitive(true);
        value
    }

    /// The client side: adds the secret to every call.
    pub fn credentials(&self) -> ClusterCredentials {
        ClusterCredentials(Some(self.header_value()))
    }

    /// The server side: refuses calls without the secret.
    pub fn gate(&self) -> RequireClusterSecret {
        RequireClusterSecret(self.clone())
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

impl Serialize for ClusterSecret {
    /// Never written out: a serialized config shows `<redacted>`.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("<redacted>")
    }
}

impl<'de> Deserialize<'de> for ClusterSecret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        ClusterSecret::new(&text).map_err(serde::de::Error::custom)
    }
}

/// Adds the cluster secret to outgoing calls (a tonic interceptor); adds
/// nothing for a cluster that runs without one (`insecure_no_auth`).
#[derive(Clone)]
pub struct ClusterCredentials(Option<AsciiMetadataValue>);

impl ClusterCredentials {
    pub fn of(secret: Option<&ClusterSecret>) -> ClusterCredentials {
        secret.map_or(ClusterCredentials(None), ClusterSecret::credentials)
    }
}

impl Interceptor for ClusterCredentials {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert(SECRET_HEADER, value.clone());
        }
        Ok(request)
    }
}

/// Refuses incoming calls that lack the cluster secret (a tonic
/// interceptor; runs before the handler, so a refused call changes nothing).
#[derive(Clone)]
pub struct RequireClusterSecret(ClusterSecret);

impl Interceptor for RequireClusterSecret {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        match request.metadata().get(SECRET_HEADER) {
            Some(offered) if self.0.matches(offered.as_bytes()) => Ok(request),
            Some(_) => Err(Status::unauthenticated(
                "wrong cluster secret: this RPC is for members of the cluster only (x-walship-cluster-secret)",
            )),
            None => Err(Status::unauthenticated(
                "missing cluster secret: this RPC is for members of the cluster only; clients use walship.v1.Log",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_or_unprintable_secrets_are_refused() {
        assert_eq!(ClusterSecret::new("short"), Err(SecretError::TooShort(5)));
        assert_eq!(ClusterSecret::new("sixteen chars ok"), Err(SecretError::NotPrintable));
        assert_eq!(ClusterSecret::new("sixteen-chars-é!"), Err(SecretError::NotPrintable));
        assert!(
            ClusterSecret::new("  0123456789abcdef\n").is_ok(),
            "surrounding whitespace (a file's newline) is trimmed"
        );
    }

    #[test]
    fn the_gate_admits_the_secret_and_nothing_else() {
        let secret = ClusterSecret::new("0123456789abcdef").unwrap();
        let mut gate = secret.gate();
        let with = |value: Option<&str>| {
            let mut request = Request::new(());
            if let Some(v) = value {
                request.metadata_mut().insert(SECRET_HEADER, v.parse().unwrap());
            }
            request
        };
        assert!(gate.call(with(Some("0123456789abcdef"))).is_ok());
        for refused in [None, Some(""), Some("0123456789abcdeF"), Some("0123456789abcdef0"), Some("0123456789abcde")] {
            let status = gate.call(with(refused)).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{refused:?}");
        }
        let mut credentials = secret.credentials();
        assert!(gate.call(credentials.call(Request::new(())).unwrap()).is_ok());
    }

    #[test]
    fn the_secret_never_shows() {
        let secret = ClusterSecret::new("0123456789abcdef").unwrap();
        assert!(!format!("{secret:?}").contains("0123"));
        assert!(!serde_json::to_string(&secret).unwrap().contains("0123"));
        let value = secret.credentials().0.unwrap();
        assert!(value.is_sensitive());
    }
}
