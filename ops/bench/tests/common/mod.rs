//! Helpers the harness smoke tests share.

use std::path::{Path, PathBuf};

/// The `walship` binary cargo built beside `harness` (one of this package's
/// binaries, `env!("CARGO_BIN_EXE_...")`).
pub fn walship_beside(harness: &str) -> PathBuf {
    let walship = Path::new(harness).with_file_name("walship");
    assert!(walship.is_file(), "{} missing: build the workspace (cargo build --workspace)", walship.display());
    walship
}

/// PIDs of processes whose command line mentions `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline"))
            && String::from_utf8_lossy(&cmdline).contains(needle)
        {
            pids.push(pid);
        }
    }
    pids
}
