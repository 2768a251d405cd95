//! `deltaref verify`: compare a candidate (or an implementation) with a
//! case's expected tensors (or the oracle's recomputation).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args as ClapArgs;
use ndarray::ArrayD;

use deltaref_verify::band;
use deltaref_verify::case::{Case, CaseError, Op};
use deltaref_verify::cause::{likely_cause, Cause};
use deltaref_verify::convention::Dims;
use deltaref_verify::heads::{BlockRows, HeadFile, STREAM_MIN_BYTES};
use deltaref_verify::impls::{oracle_truth, Compute, Device, Engine, Impl, ImplRequest};
use deltaref_verify::intermediates;
use deltaref_verify::outputs::Tensors;
use deltaref_verify::progress::Progress;
use deltaref_verify::report::VerifyReport;

use super::band::{band_request, EnsembleArgs};
use super::{fail, Against, ImplArgs};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[arg(long, help = super::CASE_HELP)]
    pub case: PathBuf,
    /// A candidate file (any float dtype) holding outputs and gradients.
    #[arg(long)]
    pub candidate: Option<PathBuf>,
    #[command(flatten)]
    pub imp: ImplArgs,
    /// A tensor passes when max_abs ≤ 1e-6 or norm_ratio < this (FLA assert_close).
    #[arg(long, default_value_t = 5e-3)]
    pub max_ratio: f64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Compare outputs and final state only (a forward-only port); the report says so.
    #[arg(long)]
    pub forward_only: bool,
    /// Accept partial checks: a case whose stored truth covers only some
    /// outputs and gradients, or a candidate that lacks some (FLA's CP
    /// returns no final state). The unchecked tensors are still listed.
    #[arg(long)]
    pub allow_partial: bool,
    /// Judge each tensor against the noise band of this precision preset
    /// (e.g. fla-bf16: where a correct kernel with its storage lands on this
    /// case) instead of --max-ratio: inside, above p99 by how many band
    /// widths, or far below it.
    #[arg(long, value_name = "PRECISION")]
    pub band: Option<String>,
    #[command(flatten)]
    pub ensemble: EnsembleArgs,
    /// What the run is compared with: `truth` (the stored results, else the
    /// f64 oracle) or `non-cp` (a CP --impl against the same engine,
    /// precision and compute without CP: what FLA's CP tests compare).
    #[arg(long, value_enum, default_value_t = Against::Truth)]
    pub against: Against,
    /// The candidate's convention (fla, flashkda, flashinfer-gdn, flashqla,
    /// opengdn, ggml): its tensors are mapped back to FLA's layout first.
    #[arg(long, default_value = "fla")]
    pub convention: String,
}

/// The candidate's intermediates against the oracle's, computed with the
/// chunked engine in the case's layout (CP when the case has one).
fn intermediate_rows(
    case: &Case,
    cand: &Case,
    max_ratio: f64,
) -> Result<Vec<intermediates::IntermediateRow>, CaseError> {
    let held = cand.intermediates();
    if held.is_empty() {
        return Ok(vec![]);
    }
    let imp = ImplRequest::chunked_for(case).resolve(case)?;
    let (oracle, chunks) = intermediates::compute(case, &imp, Compute::F64)?;
    Ok(intermediates::compare(&oracle, &held, &chunks, max_ratio))
}

/// `deltaref verify` on the whole case: the report it prints.
pub fn go(a: &Args) -> Result<VerifyReport, CaseError> {
    super::check_ratio("--max-ratio", a.max_ratio)?;
    if a.candidate.is_some() && a.imp.given() {
        return Err(CaseError::Usage(
            "--impl and its flags choose what to run; with --candidate nothing runs \
             but the f64 oracle (when the case stores no truth): drop them"
                .into(),
        ));
    }
    if a.against == Against::NonCp && a.candidate.is_some() {
        return Err(CaseError::Usage(
            "--against non-cp runs the same implementation without CP: it needs --impl cp \
             (or gpu-cp), not --candidate (compare a candidate with the truth)"
                .into(),
        ));
    }
    // A candidate in another convention is mapped back whole (head blocks
    // read FLA's layout); a non-CP reference is a whole-case run.
    let streams = (a.convention == "fla" || a.candidate.is_none()) && a.against == Against::Truth;
    if let Some(file) = HeadFile::open(&a.case, STREAM_MIN_BYTES)?.filter(|_| streams) {
        if a.band.is_some() {
            return Err(CaseError::Usage(format!(
                "--band: {} is large enough to be verified head block by head block; a band \
                 needs whole-case emulation runs (compute it on a shorter case of the same shape family)",
                a.case.display()
            )));
        }
        match &a.candidate {
            None => return streamed(a, &file, None),
            Some(c) => {
                if let Some(cand) = file.candidate(c)? {
                    return streamed(a, &file, Some(&cand));
                }
            }
        }
    }
    let case = Case::read(&a.case)?;
    super::warn_domain(&case);
    let stored = case.results();
    // Without stored truth every comparison is against the f64 oracle.
    let truth = |case: &Case| -> Result<(Tensors, String), CaseError> {
        if stored.is_empty() {
            let t = oracle_truth(case, &a.case)?;
            Ok((t, "impl:naive (f64 oracle)".to_string()))
        } else {
            Ok((stored.clone(), "case file".to_string()))
        }
    };
    let mut inter = vec![];
    let (mut expected, reference, got, candidate) = match &a.candidate {
        Some(cpath) => {
            let cand = Case::read_candidate_for(cpath, &case)?;
            inter = intermediate_rows(&case, &cand, a.max_ratio)?;
            let (expected, reference) = truth(&case)?;
            (
                expected,
                reference,
                candidate_in_fla(a, &case, &cand)?,
                cpath.display().to_string(),
            )
        }
        None => {
            let (imp, compute) = a.imp.resolve(&case)?;
            let precision = a.imp.precision.as_deref();
            let (expected, reference) = match a.against {
                Against::NonCp => {
                    super::non_cp_reference(&imp, &case, precision, compute, a.forward_only)?
                }
                Against::Truth if stored.is_empty() && is_the_oracle(&imp, compute) => {
                    return Err(oracle_against_itself(&a.case));
                }
                Against::Truth => {
                    imp.check_memory(&case)?;
                    truth(&case)?
                }
            };
            let _p = Progress::spinner(&format!("computing impl:{}", imp.name()));
            let got = imp
                .compute(&case, compute)
                .map_err(CaseError::computing(&a.case))?;
            let label = super::impl_label(&imp.name(), a.imp.precision.as_deref(), compute);
            (expected, reference, got, label)
        }
    };
    let mut names: BTreeSet<String> = expected.keys().cloned().collect();
    let got_names = got.keys().cloned().collect();
    let unchecked = select(
        a,
        case.meta.op,
        case.expected_results(),
        &mut names,
        &got_names,
    );
    expected.retain(|n, _| names.contains(n));
    let report = VerifyReport::new(
        &a.case.display().to_string(),
        &reference,
        &candidate,
        &expected,
        &got,
        a.max_ratio,
    )
    .with_heads(case.meta.op, &expected, &got)
    .with_intermediates(inter);
    let report = match &a.band {
        None => report,
        Some(p) => {
            let req = band_request(&a.imp, &case, p)?;
            let b = band::of_case(&case, &a.case, &expected, &req, &a.ensemble.spec())?;
            let verdicts = band::judge(&b, &band::ratios(&expected, &got));
            report.with_band(b, verdicts)
        }
    };
    Ok(finish(a, report, unchecked))
}

/// Whether `imp` computing in `compute` is the f64 oracle itself (naive,
/// no CP, no rounding, on the CPU): against a case without stored truth it
/// would be compared with itself.
fn is_the_oracle(imp: &Impl, compute: Compute) -> bool {
    matches!(imp.engine, Engine::Naive)
        && imp.cp.is_none()
        && imp.device == Device::Cpu
        && imp.policy.features().is_empty()
        && compute == Compute::F64
}

/// The refusal of a check that cannot fail: what would have been compared
/// with what, and how to get a truth.
fn oracle_against_itself(case: &std::path::Path) -> CaseError {
    CaseError::Usage(format!(
        "{} stores no expected results, so verify would compare impl:naive (the f64 oracle) \
         with the f64 oracle recomputed on the same inputs: every tensor would pass by \
         construction. Compare something else against the oracle (--candidate FILE, or \
         --impl chunk|cp, --precision P, --compute f32), or store a truth in the case \
         (`deltaref gen … --expected`)",
        case.display()
    ))
}

/// Applies `--forward-only` and `--allow-partial` to the names of the
/// expected tensors (against the names `got` of the candidate's) and
/// returns the names left unchecked.
fn select(
    a: &Args,
    op: Op,
    results: Vec<&'static str>,
    expected: &mut BTreeSet<String>,
    got: &BTreeSet<String>,
) -> Vec<String> {
    let keep = op.forward_results();
    if a.forward_only {
        expected.retain(|n| keep.contains(&n.as_str()));
    }
    let mut unchecked: Vec<String> = results
        .into_iter()
        .filter(|n| !expected.contains(*n) && (!a.forward_only || keep.contains(n)))
        .map(String::from)
        .collect();
    if a.allow_partial {
        let missing: Vec<String> = expected
            .iter()
            .filter(|n| !got.contains(*n))
            .cloned()
            .collect();
        for n in missing {
            expected.remove(&n);
            unchecked.push(n);
        }
    }
    unchecked
}

fn finish(a: &Args, report: VerifyReport, unchecked: Vec<String>) -> VerifyReport {
    let report = report.with_unchecked(unchecked, a.allow_partial);
    if a.forward_only {
        report.forward_only()
    } else {
        report
    }
}

/// What a head block's truth is compared with: the results an
/// implementation computed, or a candidate file's, read tensor by tensor.
enum Got<'f> {
    Computed(Tensors),
    File(&'f HeadFile),
}

impl Got<'_> {
    fn names(&self) -> BTreeSet<String> {
        match self {
            Got::Computed(t) => t.keys().cloned().collect(),
            Got::File(f) => f.result_names().into_iter().collect(),
        }
    }

    /// Tensor `name` of head block `heads` (moved out of the computed ones).
    fn take(&mut self, heads: &Range<usize>, name: &str) -> Result<Option<ArrayD<f64>>, CaseError> {
        match self {
            Got::Computed(t) => Ok(t.remove(name)),
            Got::File(f) => f.read_candidate(heads, name),
        }
    }
}

/// `verify --impl` or `verify --candidate` of a large case, one head block
/// at a time (see [`HeadFile`]): the same report as a whole-case run, in
/// bounded memory. `cand`: the candidate file, opened in the case's blocks.
pub fn streamed(
    a: &Args,
    file: &HeadFile,
    cand: Option<&HeadFile>,
) -> Result<VerifyReport, CaseError> {
    let blocks = file.blocks();
    let bar = Progress::bar(blocks.len() as u64, "head blocks");
    let mut rows = BlockRows::default();
    let mut names = None;
    for heads in &blocks {
        let of = format!("heads {}..{} of {}", heads.start, heads.end, file.heads());
        bar.step(&format!("{of}: reading"));
        let case = file.read_inputs(heads)?;
        let (op, results) = (case.meta.op, case.expected_results());
        let shapes: BTreeMap<String, Vec<usize>> = op
            .results()
            .iter()
            .filter_map(|&n| Some((n.to_string(), case.result_shape(n)?)))
            .collect();
        let mut oracle = if file.has_results() {
            None
        } else {
            bar.step(&format!("{of}: computing the f64 oracle"));
            Some(oracle_truth(&case, &a.case)?)
        };
        let (mut got, candidate) = match cand {
            None => {
                let (imp, compute) = a.imp.resolve(&case)?;
                if oracle.is_some() && is_the_oracle(&imp, compute) {
                    return Err(oracle_against_itself(&a.case));
                }
                imp.check_memory_owned(&case, oracle.is_some())?;
                bar.step(&format!("{of}: computing impl:{}", imp.name()));
                let got = imp
                    .compute_owned(case, compute)
                    .map_err(CaseError::computing(&a.case))?;
                let label = super::impl_label(&imp.name(), a.imp.precision.as_deref(), compute);
                (Got::Computed(got), label)
            }
            Some(c) => {
                c.check_candidate_meta(heads, &case)?;
                (Got::File(c), c.path().display().to_string())
            }
        };
        let reference = match oracle {
            Some(_) => "impl:naive (f64 oracle)",
            None => "case file",
        };
        let mut expected: BTreeSet<String> = match &oracle {
            Some(t) => t.keys().cloned().collect(),
            None => file.result_names().into_iter().collect(),
        };
        let unchecked = select(a, op, results, &mut expected, &got.names());
        // The stored truth (and a candidate) is read only now, one tensor at
        // a time, and each computed tensor is freed once compared: the
        // comparison holds one tensor pair beside the rest of the results,
        // never two full sets.
        bar.step(&format!("{of}: comparing"));
        for name in &expected {
            let truth = match &mut oracle {
                Some(t) => t.remove(name).expect("selected from its names"),
                None => file.read_result(heads, name, &shapes)?,
            };
            rows.add(file, heads, name, &truth, got.take(heads, name)?.as_ref())?;
        }
        names.get_or_insert((reference, candidate, unchecked));
        bar.inc();
    }
    drop(bar);
    let (reference, candidate, unchecked) = names.expect("H ≥ 1: at least one block");
    let report = VerifyReport::from_rows(
        &a.case.display().to_string(),
        reference,
        &candidate,
        rows.rows(a.max_ratio),
        a.max_ratio,
    );
    Ok(finish(a, report, unchecked))
}

/// The candidate's results mapped from `--convention` to FLA's layout.
pub fn candidate_in_fla(a: &Args, case: &Case, cand: &Case) -> Result<Tensors, CaseError> {
    let conv = super::convention(&a.convention, case)?;
    let dims = Dims::of(case).map_err(CaseError::Usage)?;
    conv.to_fla(case.meta.op, &dims, cand.results())
        .map_err(|e| CaseError::Usage(format!("--candidate in convention {}: {e}", conv.name)))
}

/// The likely cause of a failed `verify --candidate` (see
/// [`deltaref_verify::cause`]), when one of the usual mistakes explains it.
fn cause_of(a: &Args, report: &VerifyReport) -> Option<Cause> {
    let cpath = a.candidate.as_ref().filter(|_| !report.pass)?;
    let case = Case::read(&a.case).ok()?;
    let cand = Case::read_candidate_for(cpath, &case).ok()?;
    let got = candidate_in_fla(a, &case, &cand).ok()?;
    let conv = super::convention(&a.convention, &case).ok()?;
    let failing: Vec<String> = report
        .rows
        .iter()
        .filter(|r| !r.pass)
        .map(|r| r.tensor.clone())
        .collect();
    likely_cause(&case, conv, &got, &failing, a.max_ratio)
}

pub fn run(a: Args) -> ExitCode {
    match go(&a) {
        Ok(report) => {
            let cause = cause_of(&a, &report);
            if a.json {
                let mut v = serde_json::to_value(&report).expect("report serialises");
                if let (Some(c), Some(m)) = (&cause, v.as_object_mut()) {
                    m.insert(
                        "likely_cause".into(),
                        serde_json::to_value(c).expect("cause serialises"),
                    );
                }
                super::print(&serde_json::to_string_pretty(&v).expect("report serialises"));
            } else {
                super::print(&report.to_string());
                if let Some(c) = &cause {
                    super::print(&format!("likely cause: {}", c.sentence));
                }
            }
            if report.pass {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => fail(&e),
    }
}
