//! [`LocalDirStore`]: objects as files under one root directory.
//!
//! The key `a/b/c.wseg` is the file `<root>/a/b/c.wseg`. Each file holds a
//! 16-byte header, then the object's bytes:
//!
//! | bytes | what |
//! | --- | --- |
//! | 0..4 | magic `WSO1` |
//! | 4..8 | CRC32C of the object's bytes, little-endian |
//! | 8..16 | length of the object's bytes, little-endian |
//!
//! The checksum travels in the same file as the bytes, so one rename
//! publishes both: concurrent puts of one key end with one whole object
//! and its own checksum, never one's bytes under another's checksum (which
//! a sidecar file could not promise). `list` reports the object's size (the
//! file's less the header).
//!
//! Since keys are paths, one key cannot be both an object and a directory
//! of others: where S3 takes both `a` and `a/b`, this store refuses the
//! second put with [`StoreError::InvalidKey`] (walship's keys,
//! `<dir>/<segment file>`, never nest).
//!
//! A put writes `<name>~tmp-<pid>-<n>` beside the target (`~` is never in a
//! key, so a temp file is never listed nor mistaken for an object), fsyncs
//! it, renames it over the target and fsyncs the directory (and, when the
//! put created directories, each of their parents up to the root).

use std::io::{ErrorKind, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use crate::{ObjectKey, ObjectMeta, ObjectStore, StoreError};

const MAGIC: &[u8; 4] = b"WSO1";
/// Bytes before the object's own in every file.
pub(crate) const HEADER_LEN: usize = 16;
/// Marks temp files; never in a valid key.
const TEMP_MARK: &str = "~tmp-";

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Objects as files under a root directory (the embedded default).
#[derive(Debug, Clone)]
pub struct LocalDirStore {
    root: PathBuf,
}

impl LocalDirStore {
    /// Opens (creating if needed) the store rooted at `root`. Temp files a
    /// crash left behind are removed.
    pub fn open(root: impl AsRef<Path>) -> Result<LocalDirStore, StoreError> {
        let root = root.as_ref();
        std::fs::create_dir_all(root).map_err(|e| io_error("creating", root, e))?;
        let root = root.canonicalize().map_err(|e| io_error("resolving", root, e))?;
        let store = LocalDirStore { root };
        store.remove_stale_temp_files();
        Ok(store)
    }

    /// The (canonical) root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file that holds `key`: `<root>/<key>`. Refuses, besides what
    /// [`ObjectKey::new`] refuses, any path that would resolve outside the
    /// root (a component other than a plain name, or a symlinked directory
    /// leading out).
    pub fn path_of(&self, key: &ObjectKey) -> Result<PathBuf, StoreError> {
        let escape = |why: &str| StoreError::InvalidKey { key: key.as_str().to_string(), reason: why.to_string() };
        let relative = Path::new(key.as_str());
        if !relative.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(escape("does not resolve to a path inside the store"));
        }
        let path = self.root.join(relative);
        if !path.starts_with(&self.root) {
            return Err(escape("resolves outside the store's directory"));
        }
        // The nearest existing ancestor must still be inside the root once
        // symlinks are followed.
        if let Some(existing) = path.ancestors().skip(1).find(|a| a.exists())
            && let Ok(real) = existing.canonicalize()
            && !real.starts_with(&self.root)
        {
            return Err(escape("resolves (through a symlink) outside the store's directory"));
        }
        Ok(path)
    }

    fn remove_stale_temp_files(&self) {
        let mut dirs = vec![self.root.clone()];
        while let Some(dir) = dirs.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                let Ok(kind) = entry.file_type() else { continue };
                if kind.is_dir() {
                    dirs.push(entry.path());
                } else if entry.file_name().to_string_lossy().contains(TEMP_MARK) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }

    fn put_blocking(&self, key: &ObjectKey, bytes: &[u8]) -> Result<(), StoreError> {
        let path = self.path_of(key)?;
        let dir = path.parent().expect("a key's file has a parent").to_path_buf();
        let name = path.file_name().expect("a key names a file").to_string_lossy().into_owned();
        let mut file = Vec::with_capacity(HEADER_LEN + bytes.len());
        file.extend_from_slice(MAGIC);
        file.extend_from_slice(&crate::crc32c(bytes).to_le_bytes());
        file.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        file.extend_from_slice(bytes);
        // A concurrent delete may remove an emptied parent between creating
        // it and creating the temp file in it: try again a few times.
        let mut attempt = 0;
        loop {
            attempt += 1;
            let created_dirs = !dir.is_dir();
            if created_dirs && let Err(e) = std::fs::create_dir_all(&dir) {
                // A file (an object) where a directory must be.
                if dir.ancestors().any(|a| a.starts_with(&self.root) && a.is_file()) {
                    return Err(StoreError::InvalidKey {
                        key: key.as_str().to_string(),
                        reason: "lies under the key of an existing object (a LocalDirStore keeps objects as files)"
                            .to_string(),
                    });
                }
                return Err(io_error("creating", &dir, e));
            }
            let temp = dir.join(format!(
                "{name}{TEMP_MARK}{}-{}",
                std::process::id(),
                TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            match write_synced(&temp, &file) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound && attempt < 5 => continue,
                Err(e) => {
                    let _ = std::fs::remove_file(&temp);
                    return Err(io_error("writing", &temp, e));
                }
            }
            if let Err(e) = std::fs::rename(&temp, &path) {
                let _ = std::fs::remove_file(&temp);
                if e.kind() == ErrorKind::NotFound && attempt < 5 {
                    continue;
                }
                if path.is_dir() {
                    return Err(StoreError::InvalidKey {
                        key: key.as_str().to_string(),
                        reason: "is a prefix of other objects' keys (a LocalDirStore keeps those in a directory)"
                            .to_string(),
                    });
                }
                return Err(io_error("renaming into", &path, e));
            }
            sync_dir(&dir)?;
            if created_dirs {
                for ancestor in dir.ancestors().skip(1) {
                    sync_dir(ancestor)?;
                    if ancestor == self.root {
                        break;
                    }
                }
            }
            return Ok(());
        }
    }

    fn get_blocking(&self, key: &ObjectKey) -> Result<Option<Bytes>, StoreError> {
        let path = self.path_of(key)?;
        let file = match std::fs::read(&path) {
            Ok(file) => file,
            // No file, or a file (another object) where a directory would be.
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => return Ok(None),
            // A directory where the key's file would be: no such object.
            Err(_) if path.is_dir() => return Ok(None),
            Err(e) => return Err(io_error("reading", &path, e)),
        };
        let corrupt = |detail: String| StoreError::Corrupt { key: key.as_str().to_string(), detail };
        if file.len() < HEADER_LEN || &file[0..4] != MAGIC {
            return Err(corrupt(format!("{} has no valid header", path.display())));
        }
        let stored = u32::from_le_bytes(file[4..8].try_into().unwrap());
        let len = u64::from_le_bytes(file[8..16].try_into().unwrap());
        let body = &file[HEADER_LEN..];
        if len != body.len() as u64 {
            return Err(corrupt(format!("{} holds {} bytes, its header says {len}", path.display(), body.len())));
        }
        let actual = crate::crc32c(body);
        if actual != stored {
            return Err(corrupt(format!("CRC32C is {actual:08x}, stored {stored:08x} ({})", path.display())));
        }
        let mut file = Bytes::from(file);
        Ok(Some(file.split_off(HEADER_LEN)))
    }

    fn list_blocking(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        // Only the directories the prefix can reach are walked: the part of
        // the prefix up to its last '/' names a directory.
        let start_rel = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let start = if start_rel.is_empty() {
            self.root.clone()
        } else {
            match ObjectKey::new(start_rel).and_then(|k| self.path_of(&k)) {
                Ok(dir) => dir,
                // No valid key lies under an invalid prefix.
                Err(_) => return Ok(Vec::new()),
            }
        };
        let mut found = Vec::new();
        let mut dirs = vec![start];
        while let Some(dir) = dirs.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == ErrorKind::NotFound || e.kind() == ErrorKind::NotADirectory => continue,
                Err(e) => return Err(io_error("listing", &dir, e)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| io_error("listing", &dir, e))?;
                let path = entry.path();
                let Ok(relative) = path.strip_prefix(&self.root) else { continue };
                let Some(relative) = relative.to_str() else { continue };
                let kind = match entry.file_type() {
                    Ok(kind) => kind,
                    Err(e) if e.kind() == ErrorKind::NotFound => continue,
                    Err(e) => return Err(io_error("listing", &path, e)),
                };
                if kind.is_dir() {
                    // Descend only where keys with this prefix can be.
                    let as_dir = format!("{relative}/");
                    if as_dir.starts_with(prefix) || prefix.starts_with(&as_dir) {
                        dirs.push(path);
                    }
                    continue;
                }
                if !kind.is_file() || !relative.starts_with(prefix) {
                    continue;
                }
                // Temp files (and anything else not a valid key) are not objects.
                let Ok(key) = ObjectKey::new(relative) else { continue };
                let size = match entry.metadata() {
                    Ok(meta) => meta.len().saturating_sub(HEADER_LEN as u64),
                    Err(e) if e.kind() == ErrorKind::NotFound => continue,
                    Err(e) => return Err(io_error("listing", &path, e)),
                };
                found.push(ObjectMeta { key, size });
            }
        }
        found.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(found)
    }

    fn delete_blocking(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let path = self.path_of(key)?;
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => return Ok(()),
            Err(_) if path.is_dir() => return Ok(()),
            Err(e) => return Err(io_error("removing", &path, e)),
        }
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
            // Emptied parents go too (a put racing with this recreates them).
            for ancestor in dir.ancestors() {
                if ancestor == self.root || !ancestor.starts_with(&self.root) || std::fs::remove_dir(ancestor).is_err()
                {
                    break;
                }
            }
        }
        Ok(())
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(LocalDirStore) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || f(store))
            .await
            .map_err(|e| StoreError::Unavailable(format!("local store task failed: {e}")))?
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_error("syncing", dir, e))
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> StoreError {
    StoreError::Unavailable(format!("{what} {}: {e}", path.display()))
}

#[async_trait::async_trait]
impl ObjectStore for LocalDirStore {
    async fn put(&self, key: &ObjectKey, bytes: Bytes) -> Result<(), StoreError> {
        let key = key.clone();
        self.blocking(move |store| store.put_blocking(&key, &bytes)).await
    }

    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, StoreError> {
        let key = key.clone();
        self.blocking(move |store| store.get_blocking(&key)).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        let prefix = prefix.to_string();
        self.blocking(move |store| store.list_blocking(&prefix)).await
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let key = key.clone();
        self.blocking(move |store| store.delete_blocking(&key)).await
    }

    fn describe(&self) -> String {
        format!("dir:{}", self.root.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symlink_out_of_the_root_is_refused() {
        let outside = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDirStore::open(dir.path()).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).unwrap();
        let err = store.path_of(&ObjectKey::new("out/x").unwrap()).unwrap_err();
        assert!(matches!(err, StoreError::InvalidKey { .. }), "{err}");
        assert!(store.path_of(&ObjectKey::new("in/x").unwrap()).unwrap().starts_with(store.root()));
    }

    #[tokio::test]
    async fn a_key_cannot_be_both_an_object_and_a_directory_of_objects() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDirStore::open(dir.path()).unwrap();
        let key = |k: &str| ObjectKey::new(k).unwrap();
        store.put(&key("a"), Bytes::from_static(b"1")).await.unwrap();
        let err = store.put(&key("a/b"), Bytes::from_static(b"2")).await.unwrap_err();
        assert!(matches!(&err, StoreError::InvalidKey { reason, .. } if reason.contains("existing object")), "{err}");
        store.put(&key("c/d"), Bytes::from_static(b"3")).await.unwrap();
        let err = store.put(&key("c"), Bytes::from_static(b"4")).await.unwrap_err();
        assert!(matches!(&err, StoreError::InvalidKey { reason, .. } if reason.contains("prefix")), "{err}");
        assert!(store.get(&key("c")).await.unwrap().is_none());
        store.delete(&key("c")).await.unwrap();
        assert_eq!(store.get(&key("c/d")).await.unwrap().unwrap(), Bytes::from_static(b"3"));
        assert!(store.get(&key("a/b")).await.unwrap().is_none());
    }

    #[test]
    fn stale_temp_files_are_removed_on_open_and_never_listed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a")).unwrap();
        std::fs::write(dir.path().join("a/x~tmp-1-2"), b"partial").unwrap();
        let store = LocalDirStore::open(dir.path()).unwrap();
        assert!(!dir.path().join("a/x~tmp-1-2").exists());
        std::fs::write(dir.path().join("a/y~tmp-1-3"), b"partial").unwrap();
        assert!(store.list_blocking("").unwrap().is_empty());
    }
}
