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

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
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
