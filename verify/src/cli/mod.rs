//! One module per subcommand: each exposes `Args` and `run(args) -> ExitCode`.
//! Exit codes: 0 success/all pass, 1 a comparison failed, 2 usage or input error.

pub mod gen;
pub mod run;
pub mod selfcheck;
pub mod verify;

use std::process::ExitCode;

use clap::Args as ClapArgs;
use deltaref_verify::case::CaseError;
use deltaref_verify::impls::{Compute, Impl};

/// Prints an error and returns exit code 2.
pub fn fail(e: &CaseError) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(2)
}

/// Parses a comma-separated list of non-negative integers.
pub fn list(flag: &str, s: &str) -> Result<Vec<usize>, CaseError> {
    s.split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| {
            CaseError::Usage(format!(
                "{flag}: expected comma-separated non-negative integers, got `{s}`"
            ))
        })
}

/// `--impl` and its parameters.
#[derive(ClapArgs, Debug)]
pub struct ImplArgs {
    /// Implementation: naive or chunk.
    #[arg(long = "impl", default_value = "naive")]
    pub imp: String,
    /// Chunk size of --impl chunk: 16, 32 or 64.
    #[arg(long, default_value_t = 64)]
    pub chunk_size: usize,
    /// Compute in f64 (the oracle) or f32 (same code, single precision).
    #[arg(long, default_value = "f64")]
    pub compute: String,
}

impl ImplArgs {
    pub fn resolve(&self) -> Result<(Impl, Compute), CaseError> {
        let compute = match self.compute.as_str() {
            "f64" => Compute::F64,
            "f32" => Compute::F32,
            c => {
                return Err(CaseError::Usage(format!(
                    "--compute: expected f64 or f32, got `{c}`"
                )))
            }
        };
        Ok((Impl::parse(&self.imp, self.chunk_size)?, compute))
    }
}
