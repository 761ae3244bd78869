//! File systems of a test's own, so that a full disk or a read-only file system is real and
//! not simulated: a small tmpfs ([`Mount::tmpfs`]) that a [`Filler`] fills to the last
//! byte, and a read-only view of a directory ([`Mount::read_only_view`]: a bind mount
//! remounted read-only, which stops root too, where file permissions would not).
//!
//! Needs root (the suites run as root); without it the mount fails with a message that says
//! so. Every mount is unmounted when its value is dropped, during a panic's unwinding too.
//! Shared by `full_disk.rs`, `refused_access.rs` and the binary's `tests/cli/access.rs`
//! (through `#[path]`), hence a directory module: Cargo does not take it for a test.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A file system mounted on a directory of its own under the system's temporary directory;
/// unmounted, and its directory removed, when dropped.
pub struct Mount {
    /// Where it is mounted.
    pub path: PathBuf,
}

fn mount(args: &[&str], what: &str) {
    let out = Command::new("mount")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `mount` to {what}: {e}"));
    assert!(
        out.status.success(),
        "`mount {}` failed ({what}): {}. These tests make file systems of their own and must \
         run as root, with mount(8) available",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

impl Mount {
    /// A tmpfs of `bytes` (rounded up to whole pages by the kernel), empty.
    pub fn tmpfs(bytes: u64) -> Mount {
        let path = std::env::temp_dir().join(outbox_tests::unique_name("outbox-tmpfs"));
        std::fs::create_dir_all(&path).expect("a directory to mount on");
        let options = format!("size={bytes},mode=0755");
        let target = path.to_string_lossy().into_owned();
        mount(
            &["-t", "tmpfs", "-o", &options, "outbox-test", &target],
            "make a small file system",
        );
        Mount { path }
    }

    /// `source`, seen through a read-only bind mount: every write below the returned path
    /// fails with `EROFS`, for root as well.
    pub fn read_only_view(source: &Path) -> Mount {
        let path = std::env::temp_dir().join(outbox_tests::unique_name("outbox-ro"));
        std::fs::create_dir_all(&path).expect("a directory to mount on");
        let target = path.to_string_lossy().into_owned();
        let source = source.to_string_lossy().into_owned();
        mount(&["--bind", &source, &target], "bind a directory");
        let mounted = Mount { path };
        mount(
            &["-o", "remount,ro,bind", &target],
            "make the bind mount read-only",
        );
        mounted
    }

    /// A path in it.
    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let target = self.path.to_string_lossy().into_owned();
        // A file still open (a pool being dropped on another thread) makes a plain unmount
        // busy for a moment: try for a while, then detach it lazily.
        let mut unmounted = false;
        for _ in 0..50 {
            let status = Command::new("umount").arg(&target).output();
            if status.is_ok_and(|s| s.status.success()) {
                unmounted = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        if !unmounted {
            let _ = Command::new("umount").args(["-l", &target]).output();
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// A file that takes every free byte of a file system, until [`Filler::free`] (or drop).
pub struct Filler {
    path: PathBuf,
    /// Bytes it took.
    pub bytes: u64,
}

impl Filler {
    /// Writes `path` until the file system has no byte left (`ENOSPC`), in ever smaller
    /// pieces down to one byte, and syncs it.
    pub fn fill(path: &Path) -> Filler {
        let mut file = std::fs::File::create(path).expect("create the filler file");
        let mut bytes = 0u64;
        let mut piece = 1usize << 20;
        let block = vec![0x5au8; piece];
        while piece > 0 {
            match file.write(&block[..piece]) {
                Ok(0) => piece /= 2,
                Ok(n) => bytes += n as u64,
                Err(e) if e.raw_os_error() == Some(28) => piece /= 2, // ENOSPC
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
        let _ = file.sync_all();
        Filler {
            path: path.to_path_buf(),
            bytes,
        }
    }

    /// Removes the file: the space is free again.
    pub fn free(self) {}
}

impl Drop for Filler {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Free bytes of the file system holding `path`, as `df` reports them.
pub fn free_bytes(path: &Path) -> u64 {
    let out = Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(path)
        .output()
        .expect("run df");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|line| line.trim().parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "df {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            )
        })
}
