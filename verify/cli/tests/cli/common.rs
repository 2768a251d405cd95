//! Running the real `deltaref` binary from the CLI tests.
// Each test file uses the helpers it needs.
#![allow(dead_code)]

use std::path::Path;

use assert_cmd::Command;

pub fn deltaref() -> Command {
    Command::cargo_bin("deltaref").expect("binary built")
}

/// Runs `args`, asserting exit 0; returns stdout.
pub fn run_ok(args: &[&str]) -> String {
    let out = deltaref().args(args).output().expect("runs");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// `(exit code, stdout, stderr)` of `args`.
pub fn code(args: &[&str]) -> (i32, String, String) {
    let out = deltaref().args(args).output().expect("runs");
    (
        out.status.code().expect("exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}
