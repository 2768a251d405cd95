//! `deltaref`: the command-line front of the oracle (see README).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

// A backward pass allocates and frees tens of MiB of per-head buffers; glibc
// hands such blocks back to the kernel on free, so every call pays for page
// faults on fresh memory (a third of the naive backward on a 2-core VM).
// mimalloc keeps freed memory for reuse.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "deltaref",
    version,
    about = "Reference and verification suite for KDA, DPLR and token-shift"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Refuse work whose up-front memory estimate exceeds this size (e.g.
    /// 8G, 512M; default: MemAvailable from /proc/meminfo).
    #[arg(long, global = true, value_parser = deltaref_verify::memory::parse_size)]
    max_memory: Option<u64>,
    /// No progress bar on stderr (it is hidden anyway when stderr is not a terminal).
    #[arg(long, short, global = true)]
    quiet: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check every implementation against every other on built-in cases.
    Selfcheck(cli::selfcheck::Args),
    /// Write a deterministic case file (inputs, upstream gradients, optionally the truth).
    Gen(cli::gen::Args),
    /// Compute a case's outputs and gradients with an implementation.
    Run(cli::run::Args),
    /// Compare a candidate (or an implementation) with the expected tensors.
    Verify(cli::verify::Args),
    /// Simulate context parallel on a case: per-rank table and CP vs non-CP.
    Cp(cli::cp::Args),
    /// Write the fixture set for other ports, or check a committed one.
    Fixtures(cli::fixtures::Args),
    /// Locate where an error starts: per token, sequence, rank and chunk.
    Diagnose(cli::diagnose::Args),
    /// Time implementations (CPU oracle, GPU kernels) on a case, with their errors.
    Bench(cli::bench::Args),
}

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
    run_args(std::env::args_os())
}

/// Parses `args` (the program name first) and runs the command: the whole
/// program but the signal handler, callable in-process (the fuzzer does).
pub fn run_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            // Help and version exit 0; usage errors exit 2.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    deltaref_verify::memory::set_limit(cli.max_memory);
    deltaref_verify::progress::set_quiet(cli.quiet);
    match cli.command {
        Command::Selfcheck(a) => cli::selfcheck::run(a),
        Command::Gen(a) => cli::gen::run(a),
        Command::Run(a) => cli::run::run(a),
        Command::Verify(a) => cli::verify::run(a),
        Command::Cp(a) => cli::cp::run(a),
        Command::Fixtures(a) => cli::fixtures::run(a),
        Command::Diagnose(a) => cli::diagnose::run(a),
        Command::Bench(a) => cli::bench::run(a),
    }
}
