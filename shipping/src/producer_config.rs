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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bounds_are_refused() {
        ProducerConfig::default().validate().unwrap();
        for (max, expiry) in [(0, 3600), (1_000_001, 3600), (10, 59), (10, 30 * 86_400 + 1)] {
            let config = ProducerConfig { max_per_shard: max, idle_expiry_s: expiry };
            assert!(config.validate().is_err(), "{config:?}");
        }
        let limits = ProducerConfig { max_per_shard: 5, idle_expiry_s: 60 }.limits();
        assert_eq!((limits.max_producers, limits.idle_expiry_us), (5, 60_000_000));
    }

    #[test]
    fn a_cluster_config_refuses_unknown_keys_and_bad_values() {
        let parse = |table: &str| toml::from_str::<ProducerConfig>(table);
        assert!(parse("max_per_shard = 5\nidle_expiry_s = 120").is_ok());
        assert!(parse("max_producers = 5").is_err(), "unknown keys are refused");
        assert!(parse("max_per_shard = -1").is_err());
    }
}
