//! Progress on stderr for work that can take seconds (an indicatif bar or
//! spinner). Hidden when stderr is not a terminal (pipes, CI, tests) and
//! with the global `--quiet`, so it never mixes into parsed output.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

static QUIET: AtomicBool = AtomicBool::new(false);
/// One indicator at a time: steps nested inside a longer task stay hidden.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// `--quiet`: no progress output at all.
pub fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
}

/// Where a new indicator draws, and whether it is the outermost one.
fn target() -> (ProgressDrawTarget, bool) {
    let outermost = !ACTIVE.swap(true, Ordering::Relaxed);
    if !outermost || QUIET.load(Ordering::Relaxed) || !std::io::stderr().is_terminal() {
        (ProgressDrawTarget::hidden(), outermost)
    } else {
        (ProgressDrawTarget::stderr(), outermost)
    }
}

/// A progress indicator; cleared from the terminal when dropped.
pub struct Progress(ProgressBar, bool);

impl Progress {
    /// A spinner for one step of unknown length, showing `msg` and the elapsed time.
    pub fn spinner(msg: &str) -> Progress {
        let (target, outermost) = target();
        let pb = ProgressBar::with_draw_target(None, target);
        pb.set_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("valid template"),
        );
        pb.set_message(msg.to_string());
        pb.enable_steady_tick(Duration::from_millis(120));
        Progress(pb, outermost)
    }

    /// A bar over `len` steps.
    pub fn bar(len: u64, msg: &str) -> Progress {
        let (target, outermost) = target();
        let pb = ProgressBar::with_draw_target(Some(len), target);
        pb.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({elapsed}, eta {eta})")
                .expect("valid template")
                .progress_chars("=> "),
        );
        pb.set_message(msg.to_string());
        pb.enable_steady_tick(Duration::from_millis(250));
        Progress(pb, outermost)
    }

    /// Names the current step.
    pub fn step(&self, msg: &str) {
        self.0.set_message(msg.to_string());
    }

    /// One step done.
    pub fn inc(&self) {
        self.0.inc(1);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.finish_and_clear();
        if self.1 {
            ACTIVE.store(false, Ordering::Relaxed);
        }
    }
}
