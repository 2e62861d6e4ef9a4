//! Loopback ports a test hands to a process it is about to start.
//!
//! A port probed by binding `127.0.0.1:0` comes from the kernel's
//! ephemeral range, the same range every outgoing connection takes its
//! source port from: with a suite of clusters running side by side, a
//! probed port was sometimes taken by someone's connection before the
//! process bound it ("Address already in use"). These ports come from
//! below (or above) that range instead, where the kernel hands out
//! nothing by itself, and each is claimed for the life of the test
//! process with a file of its own, so two test processes never get the
//! same one.

use std::io::Write;
use std::net::TcpListener;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

/// How many ports the pool spans.
pub const POOL: u16 = 10_000;

/// A free loopback port outside the kernel's ephemeral range, claimed by
/// this process until it exits.
pub fn free_port() -> u16 {
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let pool = pool();
    let span = u32::from(pool.end - pool.start);
    // Processes start at different places so they rarely meet.
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let n = CALLS.fetch_add(1, Ordering::Relaxed);
        let port = pool.start + ((start + n) % span) as u16;
        if claim(port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port left in {pool:?}");
}

/// Ports beside the ephemeral range: below it when there is room, else above.
fn pool() -> Range<u16> {
    let (low, high) = ephemeral_range();
    if low >= 1024 + POOL {
        low - POOL..low
    } else if high <= u16::MAX - POOL {
        high + 1..high + 1 + POOL
    } else {
        // The whole port space is ephemeral: claims still keep tests apart.
        1024..1024 + POOL
    }
}

/// The kernel's ephemeral port range (Linux's default if it cannot be read).
pub fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut parts = text.split_whitespace().map(|p| p.parse::<u16>());
            Some((parts.next()?.ok()?, parts.next()?.ok()?))
        })
        .unwrap_or((32768, 60999))
}

/// Takes `port` for this process: true if it was free to take. A claim
/// left by a process that is gone is taken over.
fn claim(port: u16) -> bool {
    let dir = std::env::temp_dir().join("walship-test-ports");
    std::fs::create_dir_all(&dir).expect("create the test port claim directory");
    let path = dir.join(port.to_string());
    for _ in 0..2 {
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(mut file) => {
                file.write_all(std::process::id().to_string().as_bytes()).expect("write a port claim");
                return true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                if owner_alive(&path) {
                    return false;
                }
                // Two processes may both see the owner gone; create_new picks one.
                let _ = std::fs::remove_file(&path);
            }
            Err(e) => panic!("claim port {port} at {}: {e}", path.display()),
        }
    }
    false
}

/// Whether the process that wrote the claim at `path` still runs. A claim
/// being written (no pid yet) counts as alive.
fn owner_alive(path: &Path) -> bool {
    match std::fs::read_to_string(path) {
        Ok(pid) if pid.is_empty() => true,
        Ok(pid) => pid.trim().parse::<u32>().is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists()),
        Err(_) => false,
    }
}
