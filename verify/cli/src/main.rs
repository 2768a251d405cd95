//! `deltaref`: the command-line program (the CLI is [`deltaref_cli::run_args`]).

use std::process::ExitCode;

// A backward pass allocates and frees tens of MiB of per-head buffers; glibc
// hands such blocks back to the kernel on free, so every call pays for page
// faults on fresh memory (a third of the naive backward on a 2-core VM).
// mimalloc keeps freed memory for reuse.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// mimalloc 3 returns freed memory to the OS after `purge_delay` (1 s by
// default). A long case's head block frees hundreds of MiB between phases
// (per-piece intermediates, then the pieces, then the results) and the next
// phase allocates others: with a 1 s delay both stay resident, 0.3 to 0.5 GB
// above what is live (measured on the 65,536-token CP8 verify). 50 ms keeps
// the reuse inside a phase's loops and returns the memory between phases
// (peak RSS 1.45-1.6 GB instead of 1.9-2.2 GB, same CPU time; 0 ms costs
// 3x the system time in page faults). `MIMALLOC_PURGE_DELAY` in the
// environment still wins.
const PURGE_DELAY_MS: std::ffi::c_long = 50;
/// `mi_option_purge_delay` in mimalloc's `mi_option_e` (v2 and v3).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

fn tune_allocator() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: called once at start-up, before any other thread exists
        // (mimalloc's option setters are not thread safe).
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
    }
}

fn main() -> ExitCode {
    tune_allocator();
    // An interrupted write must not leave its temporary file behind.
    if let Err(e) = ctrlc::set_handler(|| {
        deltaref_verify::files::remove_live_temps();
        std::process::exit(130);
    }) {
        eprintln!("warning: cannot install the SIGINT/SIGTERM handler: {e}");
    }
    deltaref_cli::run_args(std::env::args_os())
}
