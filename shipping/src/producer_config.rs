//! `[producers]`: how many producer sessions each shard remembers, and for
//! how long (see `walship_wal::producers`).
//!
//! ```toml
//! [producers]
//! max_per_shard = 10000   # a new producer past it evicts the least recently written
//! idle_expiry_s = 86400   # a producer that wrote nothing for this long is forgotten
//! ```
//!
//! A cluster-wide setting: every replica must forget the same producers at
//! the same record, or a new leader would deduplicate differently from the
//! old one. Expiry runs on log time (the leader's record timestamps), not
//! on each node's clock. A retry that arrives after its producer was
//! forgotten is refused as unknown (unless it starts at sequence 1), never
//! written twice silently; a client should keep its retries well inside
//! `idle_expiry_s`.

use walship_wal::ProducerLimits;

#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProducerConfig {
    /// Producers remembered per shard (1..=1,000,000).
    pub max_per_shard: usize,
    /// Seconds of log time after which an idle producer is forgotten
    /// (60 ..= 30 days).
    pub idle_expiry_s: u64,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        let limits = ProducerLimits::default();
        ProducerConfig { max_per_shard: limits.max_producers, idle_expiry_s: limits.idle_expiry_us / 1_000_000 }
    }
}

impl ProducerConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=1_000_000).contains(&self.max_per_shard) {
            return Err(format!("max_per_shard = {} is outside 1..=1000000", self.max_per_shard));
        }
        if !(60..=30 * 86_400).contains(&self.idle_expiry_s) {
            return Err(format!("idle_expiry_s = {} is outside 60..=2592000 (30 days)", self.idle_expiry_s));
        }
        Ok(())
    }

    pub fn limits(&self) -> ProducerLimits {
        ProducerLimits { max_producers: self.max_per_shard, idle_expiry_us: self.idle_expiry_s * 1_000_000 }
    }
}
