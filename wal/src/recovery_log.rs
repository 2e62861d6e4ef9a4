//! raft-engine's recovery messages, classified: a torn tail is normal, a
//! damaged record is not.
//!
//! raft-engine reports what its recovery truncates through the `log` crate,
//! at WARN, with the word "Corruption" in every case ("Truncating log file
//! due to broken batch (queue=Append,seq=3,offset=4096): Corruption: ...").
//! The common case is harmless: every kill -9 or crash leaves the end of the
//! newest log file unfinished (a batch cut short, or the zeros of
//! `wal.prefill`/`fallocate` behind the last batch, or in a file raft-engine
//! recycled, the bytes of its earlier life), and recovery drops it.
//! A WARN with "Corruption" after every restart teaches operators to ignore
//! the one that matters.
//!
//! [`RecoveryLog`] is the process's `log` logger: it forwards every record
//! to `tracing` as `tracing-log` does, except these truncation messages,
//! which it classifies by looking at the bytes raft-engine is about to cut
//! (it logs before it truncates) and re-emits:
//! * a torn tail at INFO ("torn tail from an unclean stop");
//! * anything else at ERROR with the word "corruption": complete batches that
//!   fail their checksum, or data after the damaged batch. raft-engine drops
//!   the rest of that file on this node; the records it held must come back
//!   from a replica.
//!
//! The classification (see [`is_torn_tail`]) only sees files of stores that
//! are opening ([`watch`]); a message about another file keeps its WARN. A
//! store whose last shutdown was clean has no torn tail, but its newest file
//! goes on past its written end: the zeros of a prefill or of raft-engine's
//! `fallocate` (only an `Engine` drop cuts those, and a node exits without
//! one), or a recycled file's earlier bytes. Its clean-shutdown marker
//! records that end ([`CleanEnd`]), and recovery's cut exactly there is
//! the end of the log, reported at INFO. Anything else cut in a clean store
//! is corruption. (A marker of an earlier build records no end: there a cut
//! followed by nothing but zeros is taken for the end.)
//!
//! Invariant: every message is emitted exactly once, at a level no lower
//! than INFO, and nothing raft-engine does is changed, only reported.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

impl RecoveryFinding {
    /// The file and offset of damage raft-engine refused to open the log
    /// with.
    pub fn unopenable(&self) -> Option<(&Path, u64)> {
        match self {
            RecoveryFinding::Unopenable { file, offset } => Some((file, *offset)),
            _ => None,
        }
    }
}

/// Where a clean shutdown left the end of the log: the newest log file's
/// name and the offset past its last written byte. The clean-shutdown
/// marker holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanEnd {
    pub file: String,
    pub end: u64,
}

impl CleanEnd {
    /// The clean-shutdown marker's text: `clean`, then the end when known
    /// (`clean\n0000000000000003.raftlog 54330131\n`).
    pub fn marker(end: Option<&CleanEnd>) -> String {
        match end {
            Some(e) => format!("clean\n{} {}\n", e.file, e.end),
            None => "clean\n".to_owned(),
        }
    }

    /// The end a marker's text records; `None` when it records none (a
    /// marker of an earlier build) or cannot be parsed.
    pub fn parse(marker: &str) -> Option<CleanEnd> {
        let (file, end) = marker.lines().nth(1)?.split_once(' ')?;
        if !file.ends_with(".raftlog") || file.contains('/') {
            return None;
        }
        Some(CleanEnd { file: file.to_owned(), end: end.trim().parse().ok()? })
    }
}

/// What a raft-engine recovery truncation was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryFinding {
    /// The unfinished end of the log an unclean stop leaves.
    TornTail { file: PathBuf, offset: u64 },
    /// What lies behind the end of the log a clean shutdown recorded.
    CleanEnd { file: PathBuf, offset: u64 },
    /// Damage raft-engine refuses to open the log with (in a file older
    /// than the newest, or its header): where it is.
    Unopenable { file: PathBuf, offset: u64 },
    /// Damaged bytes recovery cut, with what came after them in the file.
    Corruption { file: PathBuf, offset: u64, detail: String },
}

struct Watched {
    dir: PathBuf,
    /// `Some` after a clean shutdown, with the end it recorded if any.
    clean: Option<Option<CleanEnd>>,
    findings: Vec<RecoveryFinding>,
}

static WATCHED: Mutex<Vec<Watched>> = Mutex::new(Vec::new());

/// Classifies raft-engine's truncations of files under `dir` from now on
/// (while the store there opens); `clean` is `Some` when the last shutdown
/// was clean, with the end of the log it recorded.
pub(crate) fn watch(dir: &Path, clean: Option<Option<CleanEnd>>) {
    let mut watched = WATCHED.lock().unwrap_or_else(|e| e.into_inner());
    watched.retain(|w| w.dir != dir);
    watched.push(Watched { dir: dir.to_path_buf(), clean, findings: Vec::new() });
}

/// Stops watching `dir` and returns what was found there.
pub(crate) fn unwatch(dir: &Path) -> Vec<RecoveryFinding> {
    let mut watched = WATCHED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(at) = watched.iter().position(|w| w.dir == dir) else { return Vec::new() };
    watched.remove(at).findings
}

/// raft-engine's log batch header: two big-endian u64s.
const BATCH_HEADER_LEN: usize = 16;
/// The checksum that ends every complete batch.
const BATCH_CHECKSUM_LEN: usize = 4;

/// A log batch header at the start of `bytes`, if it is one that could
/// be: its length (header included) and the offset of its item metadata.
fn batch_header(bytes: &[u8]) -> Option<(usize, usize)> {
    let header = bytes.get(..BATCH_HEADER_LEN)?;
    let len_and_type = u64::from_be_bytes(header[0..8].try_into().expect("8 bytes"));
    let footer = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes")) as usize;
    let len = (len_and_type >> 8) as usize;
    let compression = len_and_type & 0xff;
    let valid = compression <= 1 && len >= BATCH_HEADER_LEN && (BATCH_HEADER_LEN..=len).contains(&footer);
    valid.then_some((len, footer))
}

/// The signature a complete batch at the start of `bytes` was written
/// with (raft-engine signs each batch's item checksum with the low 32 bits
/// of its file's sequence number: checksum = crc32 ^ signature); `None`
/// when no batch ends within `bytes` there.
fn batch_signature(bytes: &[u8]) -> Option<u32> {
    let (len, footer) = batch_header(bytes)?;
    if len > bytes.len() || len < footer + BATCH_CHECKSUM_LEN + 1 {
        return None;
    }
    let items = &bytes[footer..len - BATCH_CHECKSUM_LEN];
    let stored = u32::from_le_bytes(bytes[len - BATCH_CHECKSUM_LEN..len].try_into().expect("4 bytes"));
    Some(stored ^ crc32fast::hash(items))
}

/// Whether the bytes from a truncation point of log file `seq` to the end
/// of the file are a torn tail: a batch that never finished writing,
/// followed by what the file held before (zeros, or a recycled file's
/// earlier life). Writes are sequential and a batch's checksum is its last
/// bytes, so with nothing but zeros behind the cut:
/// * an unreadable header: torn (the zeros of a prefilled or fallocated
///   file, or a header cut short);
/// * a batch running past the end of the file: torn (its write stopped);
/// * a batch within the file: torn only if its trailing checksum was never
///   written (still zeros). A complete batch that fails its checksum is
///   damage.
///
/// raft-engine recycles purged log files without clearing them, so behind
/// this life's end lie the bytes of the file's earlier life. raft-engine
/// signs each batch's checksum with the low 32 bits of its file's sequence
/// number, which tells the lives apart: a batch behind the cut signed with
/// `seq` is this life's data that raft-engine drops, so damage. Without one,
/// the tail is torn when what the cut leaves shows an earlier life: an
/// unreadable header with a batch of an earlier life (signed with a smaller
/// sequence number) somewhere behind it, or such a batch right at the cut.
/// Anything else stays damage: a batch of this life at the cut that fails
/// its checksum cannot be told from a torn one in a recycled file, and
/// damage is the safe call (the node refetches; it does not forget).
pub fn is_torn_tail(rest: &[u8], seq: u64) -> bool {
    let zeros = |bytes: &[u8]| bytes.iter().all(|b| *b == 0);
    if rest.len() < BATCH_HEADER_LEN {
        return true;
    }
    let at_cut = batch_header(rest);
    match at_cut {
        None if zeros(&rest[BATCH_HEADER_LEN..]) => return true,
        Some((len, _)) if len > rest.len() => return true,
        Some((len, _)) if zeros(&rest[len - BATCH_CHECKSUM_LEN..len]) && zeros(&rest[len..]) => return true,
        _ => {}
    }
    let this_life = seq as u32;
    let earlier = |signature: u32| signature != 0 && signature < this_life;
    let mut earlier_life = false;
    for at in 1..rest.len() {
        match batch_signature(&rest[at..]) {
            Some(signature) if signature == this_life => return false,
            Some(signature) if earlier(signature) => earlier_life = true,
            _ => {}
        }
    }
    match at_cut {
        None => earlier_life,
        Some(_) => batch_signature(rest).is_some_and(earlier),
    }
}

/// Whether a cut at `offset` of file `name`, with `rest` behind it, is the
/// end of the log a clean shutdown recorded (`end`): exactly there; or,
/// when the shutdown recorded none, with nothing but zeros behind it.
pub fn is_clean_end(end: Option<&CleanEnd>, name: &str, offset: u64, rest: &[u8]) -> bool {
    match end {
        Some(end) => end.file == name && end.end == offset,
        None => rest.iter().all(|b| *b == 0),
    }
}

/// Parses raft-engine's "Truncating log file due to broken ... (queue=Append,
/// seq=3,offset=4096): ..." into the file name, its sequence number and the
/// offset.
fn parse_truncation(message: &str) -> Option<(String, u64, u64)> {
    parse_broken(message, "Truncating log file due to broken ")
}

/// [`parse_truncation`] for the message that starts with `prefix`.
fn parse_broken(message: &str, prefix: &str) -> Option<(String, u64, u64)> {
    if !message.starts_with(prefix) {
        return None;
    }
    let field = |name: &str| -> Option<&str> {
        let start = message.find(name)? + name.len();
        let end = message[start..].find([',', ')']).map_or(message.len(), |e| start + e);
        Some(&message[start..end])
    };
    let seq: u64 = field("seq=")?.parse().ok()?;
    let suffix = match field("queue=")? {
        "Append" => "raftlog",
        "Rewrite" => "rewrite",
        _ => return None,
    };
    // A broken file header has no offset: the whole file is cut.
    let offset = field("offset=").map_or(Some(0), |o| o.parse().ok())?;
    Some((format!("{seq:016}.{suffix}"), seq, offset))
}

/// Classifies and reports one raft-engine truncation; false if the message
/// is not one, or names no watched file. A file raft-engine refuses to open
/// ("Failed to open log file due to broken ...": damage recovery cannot
/// cut away, in a file older than the newest) is recorded as
/// [`RecoveryFinding::Unopenable`], for the store's error to name it, and
/// the message goes on to the log as it is.
fn intercept(message: &str) -> bool {
    let refused = parse_broken(message, "Failed to open log file due to broken ");
    let Some((name, seq, offset)) = refused.clone().or_else(|| parse_truncation(message)) else { return false };
    let mut watched = WATCHED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(w) = watched.iter_mut().find(|w| w.dir.join(&name).exists()) else { return false };
    let file = w.dir.join(&name);
    if refused.is_some() {
        w.findings.push(RecoveryFinding::Unopenable { file, offset });
        return false;
    }
    let rest = match std::fs::read(&file) {
        Ok(bytes) => bytes.get(offset as usize..).map(<[u8]>::to_vec).unwrap_or_default(),
        Err(_) => return false,
    };
    if let Some(end) = &w.clean
        && is_clean_end(end.as_ref(), &name, offset, &rest)
    {
        tracing::info!(
            file = %file.display(),
            offset,
            bytes = rest.len(),
            "the end of the log a clean shutdown left: WAL recovery cuts the unwritten space behind it"
        );
        w.findings.push(RecoveryFinding::CleanEnd { file, offset });
    } else if w.clean.is_none() && is_torn_tail(&rest, seq) {
        tracing::info!(
            file = %file.display(),
            offset,
            bytes = rest.len(),
            "torn tail from an unclean stop: WAL recovery drops the unfinished write at the end of the log \
             (normal after a crash or kill -9)"
        );
        w.findings.push(RecoveryFinding::TornTail { file, offset });
    } else {
        tracing::error!(
            file = %file.display(),
            offset,
            clean_shutdown = w.clean.is_some(),
            raft_engine = message,
            "corruption: WAL recovery truncates a log file at damaged bytes; the records after them in this file \
             are lost on this node and must come back from a replica"
        );
        w.findings.push(RecoveryFinding::Corruption { file, offset, detail: message.to_owned() });
    }
    true
}

/// The process's `log` logger: raft-engine's recovery truncations are
/// classified (module docs), every other record goes to `tracing`.
pub struct RecoveryLog;

impl log::Log for RecoveryLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        if record.target().starts_with("raft_engine") && intercept(&record.args().to_string()) {
            return;
        }
        let _ = tracing_log::format_trace(record);
    }

    fn flush(&self) {}
}

/// Installs [`RecoveryLog`] as the `log` logger, passing records at the
/// level `tracing` currently enables, and always WARN and above, where
/// raft-engine's truncation messages are (install it after the subscriber,
/// in place of `tracing-log`'s `LogTracer`).
pub fn install() -> Result<(), log::SetLoggerError> {
    use tracing_log::AsLog;
    log::set_logger(&RecoveryLog)?;
    log::set_max_level(tracing::level_filters::LevelFilter::current().as_log().max(log::LevelFilter::Warn));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(len: u64, footer: u64) -> Vec<u8> {
        let mut bytes = (len << 8).to_be_bytes().to_vec();
        bytes.extend(footer.to_be_bytes());
        bytes
    }

    #[test]
    fn truncation_messages_name_the_file_and_offset() {
        let m = "Truncating log file due to broken batch (queue=Append,seq=3,offset=4096): Corruption: x";
        assert_eq!(parse_truncation(m), Some(("0000000000000003.raftlog".into(), 3, 4096)));
        let m = "Truncating log file due to broken header (queue=Rewrite,seq=12): Corruption: y";
        assert_eq!(parse_truncation(m), Some(("0000000000000012.rewrite".into(), 12, 0)));
        assert_eq!(parse_truncation("Recovering raft logs takes 3ms"), None);
    }

    #[test]
    fn clean_ends_are_recorded_and_recognised() {
        let end = CleanEnd { file: "0000000000000003.raftlog".into(), end: 4096 };
        let marker = CleanEnd::marker(Some(&end));
        assert_eq!(marker, "clean\n0000000000000003.raftlog 4096\n");
        assert_eq!(CleanEnd::parse(&marker), Some(end.clone()));
        for old_or_bad in
            ["clean\n", "", "clean\n0000000000000003.raftlog\n", "clean\n../x.raftlog 1\n", "clean\nx.rewrite 1\n"]
        {
            assert_eq!(CleanEnd::parse(old_or_bad), None, "{old_or_bad:?}");
        }
        let junk = [0x5au8; 64];
        // Exactly at the recorded end, whatever lies behind it (a recycled
        // file's earlier bytes).
        assert!(is_clean_end(Some(&end), "0000000000000003.raftlog", 4096, &junk));
        // Anywhere else, even with zeros behind it: written data is gone.
        assert!(!is_clean_end(Some(&end), "0000000000000003.raftlog", 4000, &[0; 64]));
        assert!(!is_clean_end(Some(&end), "0000000000000003.raftlog", 5000, &[0; 64]));
        assert!(!is_clean_end(Some(&end), "0000000000000002.raftlog", 4096, &[0; 64]));
        // Without a recorded end: zeros only.
        assert!(is_clean_end(None, "0000000000000003.raftlog", 10, &[0; 64]));
        assert!(!is_clean_end(None, "0000000000000003.raftlog", 10, &junk));
    }

    #[test]
    fn torn_tails_and_damage_are_told_apart() {
        assert!(is_torn_tail(&[], 3), "nothing after the cut");
        assert!(is_torn_tail(&[0; 4096], 3), "the zeros of a prefilled file");
        assert!(is_torn_tail(&[1, 2, 3], 3), "a header cut short");
        // A batch of 100 bytes whose write stopped after 40: zeros follow.
        let mut cut = header(100, 80);
        cut.extend([7u8; 24]);
        cut.extend([0u8; 1000]);
        assert!(is_torn_tail(&cut, 3));
        // The same batch running past the end of the file.
        assert!(is_torn_tail(&cut[..60], 3));
        // A complete batch (its checksum written) that failed: damage.
        let mut whole = header(100, 80);
        whole.extend([7u8; 84]);
        whole.extend([0u8; 1000]);
        assert!(!is_torn_tail(&whole, 3));
        // An unfinished-looking batch with data after it: damage.
        let mut followed = cut.clone();
        followed[500] = 9;
        assert!(!is_torn_tail(&followed, 3));
        // A garbage header with data after it: damage.
        let mut garbage = vec![0xffu8; 16];
        garbage.extend([5u8; 100]);
        assert!(!is_torn_tail(&garbage, 3));
    }

    /// A complete batch as raft-engine writes it to file `seq`: header,
    /// entries, item metadata, and the items' crc32 signed with `seq`.
    fn batch(seq: u32, fill: u8) -> Vec<u8> {
        let (entries, items) = (40, 24);
        let len = BATCH_HEADER_LEN + entries + items + BATCH_CHECKSUM_LEN;
        let mut bytes = header(len as u64, (BATCH_HEADER_LEN + entries) as u64);
        bytes.extend(vec![fill; entries]);
        let item_bytes: Vec<u8> = (0..items as u8).map(|i| i ^ fill).collect();
        bytes.extend(&item_bytes);
        bytes.extend((crc32fast::hash(&item_bytes) ^ seq).to_le_bytes());
        bytes
    }

    #[test]
    fn a_recycled_files_earlier_life_is_not_damage_but_this_lifes_data_is() {
        assert_eq!(batch_signature(&batch(2, 7)), Some(2));
        // A crash at rest in file 5, recycled from file 2: the cut falls in
        // the middle of one of file 2's batches, whole ones follow.
        let mut old: Vec<u8> = batch(2, 7)[30..].to_vec();
        old.extend(batch(2, 8));
        old.extend(batch(2, 9));
        assert!(is_torn_tail(&old, 5), "the earlier life behind the end");
        // The cut right at one of file 2's batches.
        assert!(is_torn_tail(&old[old.len() - batch(2, 9).len()..], 5));
        // A batch of this life behind the cut: raft-engine drops it.
        let mut dropped = old.clone();
        dropped.extend(batch(5, 1));
        assert!(!is_torn_tail(&dropped, 5));
        // A batch of this life at the cut that fails its checksum, an
        // earlier life behind it: damage (it may have been synced).
        let mut failed = batch(5, 1);
        failed[BATCH_HEADER_LEN + 3] ^= 0x5a;
        let at = failed.len() - 6;
        failed[at] ^= 0x5a;
        failed.extend(&old);
        assert!(!is_torn_tail(&failed, 5));
        // Non-zero bytes that show no earlier life: damage, as before.
        let mut unknown = vec![0xffu8; 16];
        unknown.extend(batch(9, 1));
        assert!(!is_torn_tail(&unknown, 5), "a batch of a later file is no earlier life");
    }
}
