//! Reading and writing files defensively: only regular files are read (with
//! their size checked against the memory budget first) or replaced; a
//! symlink is written through (the file it points to is replaced, the link
//! stays); writes go through a temporary file next to the target and a rename,
//! and temporaries still open when the process is interrupted are removed by
//! [`remove_live_temps`] (the `deltaref` binary calls it on SIGINT/SIGTERM).

use std::fs::{File, Metadata};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::CaseError;

/// Temporary files being written now; removed on interruption.
static LIVE_TEMPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static TEMP_SERIAL: AtomicU64 = AtomicU64::new(0);

/// Removes every temporary file still being written (called from the
/// SIGINT/SIGTERM handler before the process exits).
pub fn remove_live_temps() {
    let temps = match LIVE_TEMPS.lock() {
        Ok(g) => g.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    for t in temps {
        let _ = std::fs::remove_file(t);
    }
}

/// What a non-regular file is, in words ("directory", "FIFO", …).
pub fn kind(m: &Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_symlink() {
        "symlink"
    } else if t.is_file() {
        "regular file"
    } else {
        "special file"
    }
}

fn write_err(path: &Path, why: impl std::fmt::Display) -> CaseError {
    CaseError::Write {
        path: path.display().to_string(),
        why: why.to_string(),
    }
}

/// The file a write to `path` replaces: `path` itself, or the final target
/// when `path` is a symlink (followed, so the link survives the write).
/// Refuses a destination that exists and is not a regular file.
pub fn destination(path: &Path) -> Result<PathBuf, CaseError> {
    let target = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(path.to_path_buf()),
        Err(e) => return Err(write_err(path, e)),
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).map_err(|e| {
            write_err(
                path,
                format!("is a symlink whose target cannot be resolved ({e}); refusing to replace the link"),
            )
        })?,
        Ok(_) => path.to_path_buf(),
    };
    match std::fs::metadata(&target) {
        Ok(m) if !m.is_file() => Err(write_err(
            path,
            format!(
                "is a {}, not a regular file; refusing to replace it",
                kind(&m)
            ),
        )),
        _ => Ok(target),
    }
}

/// Writes `bytes` to `path` through a temporary file in the target's
/// directory and a rename, so an interrupted or failed write never leaves a
/// partial file. Existing non-regular destinations are refused; symlinks are
/// written through (see [`destination`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CaseError> {
    write_atomic_with(path, |tmp| {
        // `create_new` never follows a link planted at the temporary name.
        let mut f = File::options().write(true).create_new(true).open(tmp)?;
        f.write_all(bytes)
    })
}

/// [`write_atomic`] where `write` creates and fills the temporary file at
/// the path it is given (a writer that streams, e.g. tensor by tensor). It
/// must not follow a link planted there (create it new, or rename onto it).
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Result<(), CaseError> {
    let target = destination(path)?;
    let dir = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| write_err(path, "names no file"))?;
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        TEMP_SERIAL.fetch_add(1, Ordering::Relaxed)
    ));
    register(&tmp);
    let result = (|| {
        write(&tmp)?;
        File::open(&tmp)?.sync_all()?;
        pause_for_tests();
        std::fs::rename(&tmp, &target)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    unregister(&tmp);
    result.map_err(|e| write_err(path, e))
}

fn register(tmp: &Path) {
    if let Ok(mut g) = LIVE_TEMPS.lock() {
        g.push(tmp.to_path_buf());
    }
}

fn unregister(tmp: &Path) {
    if let Ok(mut g) = LIVE_TEMPS.lock() {
        g.retain(|p| p != tmp);
    }
}

/// `DELTAREF_TEST_WRITE_PAUSE_MS`: hold the finished temporary file this
/// long before the rename, so tests can interrupt a write deterministically.
fn pause_for_tests() {
    if let Some(ms) = std::env::var("DELTAREF_TEST_WRITE_PAUSE_MS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

fn read_err(path: &Path, e: std::io::Error) -> CaseError {
    CaseError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

/// The bytes of the regular file at `path`, refused before reading when it
/// is not a regular file or its size (times `widen`, what decoding it costs
/// per stored byte) exceeds the memory budget (see [`super::memory`]).
pub fn read_bounded(path: &Path, widen: u64) -> Result<Vec<u8>, CaseError> {
    let m = std::fs::metadata(path).map_err(|e| read_err(path, e))?;
    if !m.is_file() {
        return Err(CaseError::Usage(format!(
            "{}: cannot read: is a {}, not a regular file",
            path.display(),
            kind(&m)
        )));
    }
    let size = m.len();
    super::memory::check(
        &format!("reading {}", path.display()),
        size.saturating_mul(widen.max(1)),
    )?;
    let mut f = File::open(path).map_err(|e| read_err(path, e))?;
    let mut bytes = Vec::with_capacity(size as usize);
    // The file may grow after the size check: read no more than was checked.
    (&mut f)
        .take(size)
        .read_to_end(&mut bytes)
        .map_err(|e| read_err(path, e))?;
    Ok(bytes)
}
