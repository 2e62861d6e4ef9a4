//! Storage failures end the process (see the WAL's module docs).

use crate::store::StoreError;

/// Ends the process after a storage failure in `what`: the one place that
/// does (see the WAL's module docs). Logged at ERROR and on stderr, which a
/// supervisor keeps even when the log goes elsewhere; then `abort`, since
/// an orderly shutdown would run more code over a store in an unknown state.
pub(super) fn fatal(what: &str, error: &dyn std::fmt::Display) -> ! {
    tracing::error!(
        what,
        %error,
        "WAL storage failure; stopping the process rather than continue with unknown durability \
         (the coordinator fails its shards over; check the disk)"
    );
    eprintln!("walship: fatal WAL storage failure while {what}: {error}");
    std::process::abort();
}

/// Ends the process if `error` is a storage failure ([`StoreError::is_fatal`]);
/// returns it otherwise (a refusal the caller answers).
pub(super) fn fatal_if(what: &str, error: StoreError) -> StoreError {
    if error.is_fatal() {
        fatal(what, &error);
    }
    error
}

/// Runs a storage call (or a thread's whole loop), ending the process if it
/// panics: raft-engine panics on a failed fsync, and an unwound thread would
/// leave the node running on a WAL that can no longer write. `what` names
/// the call for the log, built only when it panics.
pub(crate) fn fatal_on_panic<T>(what: impl FnOnce() -> String, call: impl FnOnce() -> T) -> T {
    // Unwind safety is moot: nothing observes the state after a panic, the
    // process ends.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(value) => value,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            fatal(&what(), &format!("panicked: {message}"))
        }
    }
}
