//! Fetch tokens: what lets a node fetch a shard's sealed segments from a
//! peer, for one task, until an expiry.
//!
//! A token is `wpt1.<grant>.<mac>`, both parts base64url without padding:
//! the grant is JSON (`task`, `shard`, `expires_unix_ms`), the MAC is
//! HMAC-SHA-256 over `wpt1.<grant>` with a key every member of the cluster
//! derives from the cluster secret ([`TokenKey::derive`]), so a serving node
//! checks a token without asking the coordinator. The coordinator mints
//! them for the tasks it dispatches; a token names its task (the fetch's
//! `query_id`) and its shard, so it fetches nothing else, and it expires
//! (minutes by default). Tokens are never logged: [`Token`]'s `Debug` shows
//! only its grant.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

const PREFIX: &str = "wpt1";

/// The longest token accepted (a grant names a task id of at most 256
/// bytes; anything longer is not one of ours).
pub const MAX_TOKEN_LEN: usize = 1024;

/// The longest task id a grant may name.
pub const MAX_TASK_LEN: usize = 256;

/// The key tokens are signed with.
#[derive(Clone)]
pub struct TokenKey([u8; 32]);

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(<redacted>)")
    }
}

impl TokenKey {
    /// The key derived from `material`: the cluster secret (a cluster
    /// without one, `insecure_no_auth`, passes its config's identity, and
    /// its tokens then only guard against mistakes, not against anyone who
    /// can read that config).
    pub fn derive(material: &[u8]) -> TokenKey {
        let mut hash = Sha256::new();
        hash.update(b"walship peer-exchange fetch tokens v1\0");
        hash.update(material);
        TokenKey(hash.finalize().into())
    }

    fn mac(&self, signed: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(signed);
        mac
    }

    /// A token for `grant`.
    pub fn mint(&self, grant: &Grant) -> Token {
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(grant).expect("plain data"));
        let signed = format!("{PREFIX}.{body}");
        let tag = URL_SAFE_NO_PAD.encode(self.mac(signed.as_bytes()).finalize().into_bytes());
        Token(format!("{signed}.{tag}"))
    }

    /// Checks `token` for a fetch by task `task` at `now_unix_ms`: well
    /// formed, signed with this key, not expired, for this task. Answers
    /// its grant (whose shard the caller checks against the key fetched).
    pub fn verify(&self, token: &str, task: &str, now_unix_ms: u64) -> Result<Grant, TokenError> {
        let grant = self.open(token, now_unix_ms)?;
        if grant.task != task {
            return Err(TokenError::OtherTask);
        }
        Ok(grant)
    }

    /// The grant of a token signed with this key and not expired at
    /// `now_unix_ms`, whatever its task (a node reading a token the
    /// coordinator minted for it, to name the task its fetches belong to).
    pub fn open(&self, token: &str, now_unix_ms: u64) -> Result<Grant, TokenError> {
        if token.is_empty() {
            return Err(TokenError::Missing);
        }
        if token.len() > MAX_TOKEN_LEN {
            return Err(TokenError::Malformed);
        }
        let mut parts = token.split('.');
        let (Some(PREFIX), Some(body), Some(tag), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(TokenError::Malformed);
        };
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| TokenError::Malformed)?;
        // Constant time (`verify_slice`): a forger learns nothing from timing.
        self.mac(format!("{PREFIX}.{body}").as_bytes()).verify_slice(&tag).map_err(|_| TokenError::BadSignature)?;
        let grant: Grant = URL_SAFE_NO_PAD
            .decode(body)
            .ok()
            .and_then(|json| serde_json::from_slice(&json).ok())
            .ok_or(TokenError::Malformed)?;
        if grant.expires_unix_ms <= now_unix_ms {
            return Err(TokenError::Expired { at_unix_ms: grant.expires_unix_ms });
        }
        Ok(grant)
    }
}

/// What a token allows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// The task the fetches belong to: a fetch's `query_id` must be it.
    pub task: String,
    /// The shard whose segments it may fetch.
    pub shard: u32,
    pub expires_unix_ms: u64,
}

/// A minted token. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A token received from elsewhere (the coordinator), to present as is.
impl From<String> for Token {
    fn from(token: String) -> Token {
        Token(token)
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Why a token was refused (each a `PERMISSION_DENIED`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("no fetch token")]
    Missing,
    #[error("the fetch token is not one walship minted")]
    Malformed,
    #[error("the fetch token's signature does not match (minted by another cluster, or altered)")]
    BadSignature,
    #[error("the fetch token expired at unix ms {at_unix_ms}")]
    Expired { at_unix_ms: u64 },
    #[error("the fetch token was minted for another task")]
    OtherTask,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant() -> Grant {
        Grant { task: "catchup-7".into(), shard: 3, expires_unix_ms: 2_000 }
    }

    #[test]
    fn a_minted_token_verifies_for_its_task_until_it_expires() {
        let key = TokenKey::derive(b"secret-of-the-cluster");
        let token = key.mint(&grant());
        assert_eq!(key.verify(token.as_str(), "catchup-7", 1_999), Ok(grant()));
        assert_eq!(key.verify(token.as_str(), "catchup-7", 2_000), Err(TokenError::Expired { at_unix_ms: 2_000 }));
        assert_eq!(key.verify(token.as_str(), "catchup-8", 1_000), Err(TokenError::OtherTask));
        assert!(!format!("{token:?}").contains(token.as_str()), "Debug shows the token");
    }

    #[test]
    fn forged_altered_and_malformed_tokens_are_refused() {
        let key = TokenKey::derive(b"secret-of-the-cluster");
        let token = key.mint(&grant()).as_str().to_string();
        let other = TokenKey::derive(b"another-cluster").mint(&grant());
        assert_eq!(key.verify(other.as_str(), "catchup-7", 1), Err(TokenError::BadSignature));
        // A grant changed (another shard, a later expiry) without the key.
        let mut longer = grant();
        longer.shard = 4;
        longer.expires_unix_ms = u64::MAX;
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&longer).unwrap());
        let tag = token.rsplit('.').next().unwrap();
        assert_eq!(key.verify(&format!("wpt1.{body}.{tag}"), "catchup-7", 1), Err(TokenError::BadSignature));
        assert_eq!(key.verify("", "catchup-7", 1), Err(TokenError::Missing));
        for bad in ["x", "wpt1", "wpt1.a", "wpt1.a.b.c", "wpt2.a.b", "wpt1.!!.??", &"a".repeat(MAX_TOKEN_LEN + 1)] {
            assert_eq!(key.verify(bad, "catchup-7", 1), Err(TokenError::Malformed), "{bad}");
        }
        // A valid MAC over a body that is not a grant.
        let body = URL_SAFE_NO_PAD.encode(b"{\"task\":1}");
        let tag = URL_SAFE_NO_PAD.encode(key.mac(format!("wpt1.{body}").as_bytes()).finalize().into_bytes());
        assert_eq!(key.verify(&format!("wpt1.{body}.{tag}"), "catchup-7", 1), Err(TokenError::Malformed));
    }
}
