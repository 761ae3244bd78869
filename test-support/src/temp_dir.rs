//! A directory of a test's own, removed with the value.

use std::path::{Path, PathBuf};

use crate::unique_name;

/// A directory of its own under the system's temporary directory (`<prefix>_<random>`),
/// removed with everything in it when dropped. Hold it in a fixture after the pools and
/// storages on its files, so that they close before it goes.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new, empty directory; panics if it cannot be made.
    #[track_caller]
    pub fn new(prefix: &str) -> TempDir {
        Self::try_new(prefix).unwrap_or_else(|e| panic!("making a temporary directory: {e}"))
    }

    /// A new, empty directory, or the error (naming the path) why it could not be made: for
    /// code that reports errors rather than panics (the benchmarks).
    pub fn try_new(prefix: &str) -> std::io::Result<TempDir> {
        let path = std::env::temp_dir().join(unique_name(prefix));
        match std::fs::create_dir_all(&path) {
            Ok(()) => Ok(TempDir(path)),
            Err(e) => Err(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", path.display()),
            )),
        }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// A path in it.
    pub fn file(&self, name: impl AsRef<Path>) -> PathBuf {
        self.0.join(name)
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
