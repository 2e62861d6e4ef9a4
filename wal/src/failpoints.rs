//! Storage fault injection for black-box tests (cargo feature `testing`).
//!
//! A real node process must show what it does when its disk fails: a failed
//! fsync or write ends it, and the coordinator fails its shards over
//! (`tests/storage_failure.rs`). The failures are injected where raft-engine's
//! file IO passes through walship's own file system
//! ([`crate::zero_fill::LogHandle`], [`crate::zero_fill::LogWriter`]):
//!
//! * `wal::sync`: a log file's sync returns an error (raft-engine panics);
//! * `wal::write`: a write to a log file returns an error.
//!
//! `walship node` configures them from the `FAILPOINTS` environment variable
//! at start, in the `fail` crate's syntax, e.g.
//! `FAILPOINTS='wal::sync=50*off->return'` (the first 50 syncs succeed, every
//! later one fails). Without the feature, as in every production build, the
//! failpoints are not compiled in and a set `FAILPOINTS` is only warned about.

/// Configures the failpoints `FAILPOINTS` names (`name=actions;...`) and
/// returns the `name=actions` pairs it set; an unknown action is an error.
/// Without the `testing` feature it sets nothing and returns nothing.
pub fn configure_from_env() -> Result<Vec<String>, String> {
    let Ok(spec) = std::env::var("FAILPOINTS") else { return Ok(Vec::new()) };
    configure(&spec)
}

#[cfg(feature = "testing")]
fn configure(spec: &str) -> Result<Vec<String>, String> {
    let mut set = Vec::new();
    for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let (name, actions) =
            entry.split_once('=').ok_or_else(|| format!("FAILPOINTS entry {entry:?} is not name=actions"))?;
        fail::cfg(name.trim(), actions.trim()).map_err(|e| format!("FAILPOINTS entry {entry:?}: {e}"))?;
        tracing::warn!(failpoint = name.trim(), actions = actions.trim(), "fault injection: failpoint configured");
        set.push(entry.to_string());
    }
    Ok(set)
}

#[cfg(not(feature = "testing"))]
fn configure(spec: &str) -> Result<Vec<String>, String> {
    tracing::warn!(
        FAILPOINTS = spec,
        "FAILPOINTS is set but this build has no failpoints (feature `testing`); ignored"
    );
    Ok(Vec::new())
}

/// The error an injected IO failure returns.
#[cfg(feature = "testing")]
pub(crate) fn injected(failpoint: &str) -> std::io::Error {
    std::io::Error::other(format!("injected by failpoint {failpoint}"))
}
