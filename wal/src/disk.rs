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
    /// 4 KiB `pwrite` + `fdatasync` latency with three writers at once,
    /// each on a file of its own: what each of three replicas sharing this
    /// disk pays for the fsync of one append (a QUORUM acknowledgement on
    /// one machine waits for two of them), microseconds.
    pub fdatasync_4k_three_p50_us: f64,
    pub fdatasync_4k_three_p99_us: f64,
}

/// Measures the disk under `dir` (up to 2,000 synced 4 KiB writes; then
/// three writers at once, up to 1,000 each; then up to 1 GiB of sequential
/// writes; at most about three seconds each). The scratch files are
/// removed afterwards.
pub fn measure(dir: &Path) -> io::Result<DiskBaseline> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("baseline.dat");
    let mut lat_us = synced_writes(&path, 2000, Duration::from_secs(3))?;
    // Three at once: 1,000 each within two seconds.
    let three: Vec<io::Result<Vec<f64>>> = std::thread::scope(|s| {
        let writers: Vec<_> = (0..3)
            .map(|i| {
                let path = dir.join(format!("baseline-{i}.dat"));
                s.spawn(move || synced_writes(&path, 1000, Duration::from_secs(2)))
            })
            .collect();
        writers.into_iter().map(|w| w.join().unwrap_or_else(|_| Err(io::Error::other("writer panicked")))).collect()
    });
    let mut three_us = Vec::new();
    for writer in three {
        three_us.extend(writer?);
    }
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
    Ok(DiskBaseline {
        fdatasync_4k_p50_us: quantile(&mut lat_us, 0.5),
        fdatasync_4k_p99_us: quantile(&mut lat_us, 0.99),
        fdatasync_4k_p999_us: quantile(&mut lat_us, 0.999),
        seq_write_mib_s: written as f64 / (1 << 20) as f64 / seconds,
        fdatasync_4k_three_p50_us: quantile(&mut three_us, 0.5),
        fdatasync_4k_three_p99_us: quantile(&mut three_us, 0.99),
    })
}

/// Up to `count` 4 KiB writes to `path`, each followed by `fdatasync`,
/// within `bound`: each one's latency in microseconds. The file is removed.
fn synced_writes(path: &Path, count: usize, bound: Duration) -> io::Result<Vec<f64>> {
    let file = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(path)?;
    let block = vec![0x5Au8; 4096];
    let mut lat_us: Vec<f64> = Vec::with_capacity(count);
    let started = Instant::now();
    let mut offset = 0u64;
    while lat_us.len() < count && started.elapsed() < bound {
        let t = Instant::now();
        file.write_all_at(&block, offset)?;
        file.sync_data()?;
        lat_us.push(t.elapsed().as_secs_f64() * 1e6);
        offset += 4096;
    }
    drop(file);
    std::fs::remove_file(path)?;
    Ok(lat_us)
}

/// The `q` quantile of `values` (sorted here; 0 when empty).
fn quantile(values: &mut [f64], q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(((values.len().max(1) - 1) as f64 * q).round() as usize).copied().unwrap_or(0.0)
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
        assert!(base.fdatasync_4k_three_p50_us > 0.0);
        assert!(base.fdatasync_4k_three_p50_us <= base.fdatasync_4k_three_p99_us);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "scratch file left behind");
    }
}
