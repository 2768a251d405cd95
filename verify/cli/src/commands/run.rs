//! `deltaref run`: compute a case's outputs and gradients with an implementation.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args as ClapArgs;
use deltaref::precision::Stage;
use deltaref_verify::case::{Case, CaseError, CaseMeta, Dtype};
use deltaref_verify::impls::{first_non_finite, Compute, Device, Impl};
use deltaref_verify::progress::Progress;

use super::{fail, ImplArgs};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[arg(long, help = super::CASE_HELP)]
    pub case: PathBuf,
    #[command(flatten)]
    pub imp: ImplArgs,
    /// Write the results as a candidate case file (float64).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// KDA, --impl chunk or cp: write the outputs, gradients and the oracle's
    /// forward intermediates under FLA's names and layouts (see README).
    #[arg(long)]
    pub intermediates: Option<PathBuf>,
}

fn go(a: &Args) -> Result<String, CaseError> {
    let case = Case::read(&a.case)?;
    super::warn_domain(&case);
    let (imp, compute) = a.imp.resolve(&case)?;
    imp.check_memory(&case)?;
    // Checked before the run, so a bad request costs nothing.
    let inter = a
        .intermediates
        .as_ref()
        .map(|_| deltaref_verify::intermediates::compute(&case, &imp, compute))
        .transpose()?;
    let progress = Progress::spinner(&format!("computing impl:{}", imp.name()));
    let results = imp
        .compute(&case, compute)
        .map_err(CaseError::computing(&a.case))?;
    drop(progress);
    if let Some((n, i, v)) = first_non_finite(&results) {
        let why = if imp.device == Device::Cpu && compute == Compute::F64 {
            "the inputs overflow float64 in the oracle's recurrence (e.g. a huge A_log, \
             gate or key norm): no finite truth exists for them"
        } else {
            "compare with the f64 oracle (`verify --impl naive`) to see whether the inputs \
             or the implementation are at fault"
        };
        return Err(CaseError::Usage(format!(
            "{}: impl:{} gave a non-finite result (`{n}` = {v} at flat index {i}); {why}",
            a.case.display(),
            imp.name()
        )));
    }
    let label = super::impl_label(&imp.name(), a.imp.precision.as_deref(), compute);
    let mut lines = vec![format!("{label} on {}:", a.case.display())];
    for (n, t) in &results {
        let rms = (t.iter().map(|v| v * v).sum::<f64>() / t.len().max(1) as f64).sqrt();
        lines.push(format!(
            "  {n:<12} {:<20} rms {rms:.6e}",
            format!("{:?}", t.shape())
        ));
    }
    if let Some(out) = &a.out {
        // The candidate says what produced it: the dtype it computed in and
        // the preset, not the case's input dtype (`diagnose --noise auto`
        // takes its noise reference from them).
        let mut cand = Case::new(CaseMeta {
            dtype: Some(computed_dtype(&imp, compute)),
            precision: a.imp.precision.clone(),
            ..case.meta.clone()
        });
        cand.cu_seqlens = case.cu_seqlens.clone();
        for (n, t) in case
            .tensors
            .iter()
            .filter(|(n, _)| !case.meta.op.results().contains(&n.as_str()))
        {
            cand.insert(
                n,
                t.clone(),
                case.dtypes.get(n).copied().unwrap_or(Dtype::F64),
            );
        }
        for (n, t) in &results {
            cand.insert(n, t.clone(), Dtype::F64);
        }
        cand.write(out)?;
        lines.push(format!("wrote {}", out.display()));
    }
    if let (Some(path), Some((tensors, _))) = (&a.intermediates, inter) {
        let mut file = Case::new(case.meta.clone());
        for (n, t) in results.iter().chain(&tensors) {
            file.insert(n, t.clone(), Dtype::F64);
        }
        for (n, t) in &tensors {
            lines.push(format!("  {n:<12} {:?}", t.shape()));
        }
        file.write(path)?;
        lines.push(format!(
            "wrote {} (outputs, gradients and {} intermediates)",
            path.display(),
            tensors.len()
        ));
    }
    Ok(lines.join("\n"))
}

/// The dtype `imp` computed its results in: the dtype its policy hands
/// results back in (`fla-bf16`: bf16), else the compute scalar's; a GPU run
/// computes in f32.
fn computed_dtype(imp: &Impl, compute: Compute) -> Dtype {
    // A stage dtype a case file cannot state (tf32, e5m2) says nothing here.
    if let Some(d) = imp
        .policy
        .storage(Stage::Outputs)
        .filter(|d| Dtype::CASE_FILE.contains(d))
    {
        return d;
    }
    match (imp.device, compute) {
        (Device::Gpu(_), _) | (Device::Cpu, Compute::F32) => Dtype::F32,
        (Device::Cpu, Compute::F64) => Dtype::F64,
    }
}

pub fn run(a: Args) -> ExitCode {
    match go(&a) {
        Ok(s) => {
            super::print(&s);
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}
