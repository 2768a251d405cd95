//! `deltaref band`: the norm_ratio a correct kernel with a precision
//! preset's storage and arithmetic shows on a case, per output and
//! gradient, as a distribution over an ensemble of jittered emulation runs
//! (see `deltaref_verify::band`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args as ClapArgs;

use deltaref_verify::band::{self, Band, BandSpec};
use deltaref_verify::case::{Case, CaseError};
use deltaref_verify::impls::{oracle_truth, ImplName, ImplRequest};
use deltaref_verify::outputs::Tensors;

use super::{fail, ImplArgs};

/// The ensemble's size, seed and jitter (shared by `band`, `verify --band`,
/// `diagnose --noise-band` and `tolerance`).
#[derive(ClapArgs, Debug, Clone)]
pub struct EnsembleArgs {
    /// Emulation runs in the ensemble.
    #[arg(long, default_value_t = band::DEFAULT_SAMPLES)]
    pub samples: usize,
    /// Seed of the ensemble's jitter (the same seed gives the same band).
    #[arg(long = "band-seed", default_value_t = 0)]
    pub band_seed: u64,
    /// Largest relative move of a value before each store (default 2^-20).
    #[arg(long, default_value_t = band::DEFAULT_JITTER)]
    pub jitter: f64,
}

impl EnsembleArgs {
    pub fn spec(&self) -> BandSpec {
        BandSpec {
            samples: self.samples,
            seed: self.band_seed,
            jitter: self.jitter,
        }
    }
}

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[arg(long, help = super::CASE_HELP)]
    pub case: PathBuf,
    /// The implementation emulated (default: the chunked engine in the
    /// case's layout, CP when it has one) and --precision, the preset whose
    /// band it is (required).
    #[command(flatten)]
    pub imp: ImplArgs,
    #[command(flatten)]
    pub ensemble: EnsembleArgs,
    /// Print the band as JSON (`rows`: tensor, median, p1, p99, max, …).
    #[arg(long)]
    pub json: bool,
}

/// The request a band runs: `imp`'s, with the chunked engine in the case's
/// layout when no `--impl` is named, and `precision` as the preset.
pub fn band_request(
    imp: &ImplArgs,
    case: &Case,
    precision: &str,
) -> Result<ImplRequest, CaseError> {
    let (mut req, compute) = imp.request()?;
    if compute.is_some() {
        return Err(CaseError::Usage(
            "--compute: a band runs in its preset's compute scalar; drop --compute".into(),
        ));
    }
    if req.name == ImplName::Naive {
        req.name = ImplRequest::chunked_for(case).name;
    }
    req.precision = Some(precision.to_string());
    Ok(req)
}

/// The stored truth, else the f64 oracle's.
pub fn truth_of(case: &Case, path: &std::path::Path) -> Result<Tensors, CaseError> {
    let stored = case.results();
    if stored.is_empty() {
        oracle_truth(case, path)
    } else {
        Ok(stored)
    }
}

fn go(a: &Args) -> Result<Band, CaseError> {
    let Some(precision) = a.imp.precision.as_deref() else {
        return Err(CaseError::Usage(
            "--precision: name the preset whose band to compute (e.g. fla-bf16)".into(),
        ));
    };
    let case = Case::read(&a.case)?;
    let req = band_request(&a.imp, &case, precision)?;
    let truth = truth_of(&case, &a.case)?;
    band::of_case(&case, &a.case, &truth, &req, &a.ensemble.spec())
}

pub fn run(a: Args) -> ExitCode {
    match go(&a) {
        Ok(b) => {
            if a.json {
                super::print(&serde_json::to_string_pretty(&b).expect("band serialises"));
            } else {
                super::print(&b.to_string());
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}
