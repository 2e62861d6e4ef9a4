//! The raw limits of the disk under a directory: the yardstick every
//! walship benchmark reports its figures against, measured in the same run
//! because these figures swing several-fold between runs on shared machines.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Raw figures of one disk.
#[derive(Debug, Clone, Serialize)]
pub struct DiskBaseline {
    /// 4 KiB `pwrite` + `fdatasync` latency, microseconds.
    pub fdatasync_4k_p50_us: f64,
    pub fdatasync_4k_p99_us: f64,
    pub fdatasync_4k_p999_us: f64,
    /// 1 MiB sequential writes with an `fdatasync` every 8 MiB.
    pub seq_write_mib_s: f64,
}

/// Measures the disk under `dir` (up to 2,000 synced 4 KiB writes, then up
/// to 1 GiB of sequential writes; at most about three seconds each). The
/// scratch file is removed afterwards.
pub fn measure(dir: &Path) -> io::Result<DiskBaseline> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("baseline.dat");
    let file = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path)?;
    let block = vec![0x5Au8; 4096];
    let mut lat_us: Vec<f64> = Vec::with_capacity(2000);
    let started = Instant::now();
    let mut offset = 0u64;
    while lat_us.len() < 2000 && started.elapsed() < Duration::from_secs(3) {
        let t = Instant::now();
        file.write_all_at(&block, offset)?;
        file.sync_data()?;
        lat_us.push(t.elapsed().as_secs_f64() * 1e6);
        offset += 4096;
    }
    drop(file);
    let file = OpenOptions::new().create(true).truncate(true).write(true).open(&path)?;
    let chunk = vec![0xA5u8; 1 << 20];
    let started = Instant::now();
    let mut written = 0u64;
    while written < (1 << 30) && started.elapsed() < Duration::from_secs(3) {
        file.write_all_at(&chunk, written)?;
        written += chunk.len() as u64;
        if written.is_multiple_of(8 << 20) {
            file.sync_data()?;
        }
    }
    file.sync_data()?;
    let seconds = started.elapsed().as_secs_f64();
    drop(file);
    std::fs::remove_file(&path)?;
    lat_us.sort_by(f64::total_cmp);
    let quantile = |q: f64| lat_us[((lat_us.len() - 1) as f64 * q).round() as usize];
    Ok(DiskBaseline {
        fdatasync_4k_p50_us: quantile(0.5),
        fdatasync_4k_p99_us: quantile(0.99),
        fdatasync_4k_p999_us: quantile(0.999),
        seq_write_mib_s: written as f64 / (1 << 20) as f64 / seconds,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn measures_positive_figures_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let base = super::measure(dir.path()).unwrap();
        assert!(base.fdatasync_4k_p50_us > 0.0);
        assert!(base.fdatasync_4k_p50_us <= base.fdatasync_4k_p99_us);
        assert!(base.fdatasync_4k_p99_us <= base.fdatasync_4k_p999_us);
        assert!(base.seq_write_mib_s > 0.0);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "scratch file left behind");
    }
}
