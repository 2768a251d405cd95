//! `deltaref`: the command-line front of the oracle (see README). The
//! program is this library's [`run_args`]; the binary adds the allocator
//! and the signal handler. One module per subcommand in [`commands`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod commands;
mod plot;

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
    Selfcheck(commands::selfcheck::Args),
    /// Write a deterministic case file (inputs, upstream gradients, optionally the truth).
    Gen(commands::gen::Args),
    /// Compute a case's outputs and gradients with an implementation.
    Run(commands::run::Args),
    /// Compare a candidate (or an implementation) with the expected tensors.
    Verify(commands::verify::Args),
    /// Simulate context parallel on a case: per-rank table and CP vs non-CP.
    Cp(commands::cp::Args),
    /// Write the fixture set for other ports, or check a committed one.
    Fixtures(commands::fixtures::Args),
    /// Locate where an error starts: per token, sequence, rank and chunk.
    Diagnose(commands::diagnose::Args),
    /// The band of norm_ratio a correct kernel with a precision preset shows on a case.
    Band(commands::band::Args),
    /// Per-tensor test bars at a shape, from the band over several input draws.
    Tolerance(commands::tolerance::Args),
    /// Time implementations (CPU oracle, GPU kernels) on a case, with their errors.
    Bench(commands::bench::Args),
    /// Property-test a candidate kernel: random valid cases, failures shrunk, likely cause named.
    Fuzz(commands::fuzz::Args),
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
        Command::Selfcheck(a) => commands::selfcheck::run(a),
        Command::Gen(a) => commands::gen::run(a),
        Command::Run(a) => commands::run::run(a),
        Command::Verify(a) => commands::verify::run(a),
        Command::Cp(a) => commands::cp::run(a),
        Command::Fixtures(a) => commands::fixtures::run(a),
        Command::Diagnose(a) => commands::diagnose::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Band(a) => commands::band::run(a),
        Command::Tolerance(a) => commands::tolerance::run(a),
        Command::Fuzz(a) => commands::fuzz::run(a),
    }
}
