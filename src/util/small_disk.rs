//! A full disk for tests: a tmpfs of a few hundred KiB mounted in a temporary directory
//! (needs root; `.ci/run` runs as root), unmounted when dropped, also when the test fails.

use std::path::{Path, PathBuf};

/// A mounted tmpfs of a fixed size, unmounted (and its directory removed) on drop.
pub struct SmallDisk {
    mnt: PathBuf,
    _parent: tempfile::TempDir,
}

impl SmallDisk {
    /// Mounts a tmpfs of `size` (mount's syntax: `1m`, `160k`). Panics, saying why, when it
    /// cannot (not root): the tests that need it are `#[ignore]`d and run by `.ci/run`.
    pub fn mount(size: &str) -> SmallDisk {
        let parent = tempfile::tempdir().unwrap();
        let mnt = parent.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&mnt)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "cannot mount a tmpfs at {} (not root?): {}",
            mnt.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk {
            mnt,
            _parent: parent,
        }
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mnt
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let ok = std::process::Command::new("umount")
            .arg(&self.mnt)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("could not unmount {}", self.mnt.display());
        }
    }
}
