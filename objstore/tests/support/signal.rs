//! Signals to a test's child process that have taken effect when they
//! return.
//!
//! `kill(2)` with SIGSTOP returns once the signal is queued, not once the
//! target has stopped: a thread of a multi-threaded server that is running
//! at that moment stops only on its next way back to user space, and may
//! first answer a request that arrived just after `kill` returned. A test
//! that freezes a server and expects the next request to go unanswered must
//! therefore wait until every thread shows as stopped in `/proc`.

#![allow(dead_code)]

use std::time::{Duration, Instant};

/// Sends `signal` to `pid`; for SIGSTOP, also waits (up to 5 s, else
/// panics) until every thread of `pid` is stopped.
pub fn send(pid: u32, signal: i32) {
    // SAFETY: kill(2) on a child process the calling test spawned.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0, "kill({pid}, {signal})");
    if signal != libc::SIGSTOP {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !all_threads_stopped(pid) {
        assert!(Instant::now() < deadline, "process {pid} not stopped 5 s after SIGSTOP");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether every thread of `pid` is in state `T` (stopped) per
/// `/proc/<pid>/task/<tid>/stat`. A process that is gone counts as stopped.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return true };
    tasks.flatten().all(|task| {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { return true };
        // "<tid> (<comm>) <state> ...": the name may hold spaces and parens.
        stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()).is_some_and(|s| s == 'T')
    })
}
