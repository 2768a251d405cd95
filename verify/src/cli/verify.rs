//! `deltaref verify`: compare a candidate (or an implementation) with a
//! case's expected tensors (or the oracle's recomputation).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args as ClapArgs;

use deltaref_verify::case::{Case, CaseError, Op};
use deltaref_verify::heads::{BlockRows, HeadFile, STREAM_MIN_BYTES};
use deltaref_verify::impls::{oracle_truth, ImplRequest};
use deltaref_verify::intermediates;
use deltaref_verify::outputs::Tensors;
use deltaref_verify::progress::Progress;
use deltaref_verify::report::VerifyReport;

use super::{fail, ImplArgs};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[arg(long)]
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
    let (oracle, chunks) = intermediates::compute(case, &imp)?;
    Ok(intermediates::compare(&oracle, &held, &chunks, max_ratio))
}

fn go(a: &Args) -> Result<VerifyReport, CaseError> {
    super::check_ratio("--max-ratio", a.max_ratio)?;
    if a.candidate.is_none() {
        if let Some(file) = HeadFile::open(&a.case, STREAM_MIN_BYTES)? {
            return streamed(a, &file);
        }
    }
    let case = Case::read(&a.case)?;
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
            if a.imp.given() {
                return Err(CaseError::Usage(
                    "--impl and its flags choose what to run; with --candidate nothing runs \
                     but the f64 oracle (when the case stores no truth): drop them"
                        .into(),
                ));
            }
            let cand = Case::read_candidate_for(cpath, &case)?;
            inter = intermediate_rows(&case, &cand, a.max_ratio)?;
            let (expected, reference) = truth(&case)?;
            (
                expected,
                reference,
                cand.results(),
                cpath.display().to_string(),
            )
        }
        None => {
            let (imp, compute) = a.imp.resolve(&case)?;
            imp.check_memory(&case)?;
            let (expected, reference) = truth(&case)?;
            let _p = Progress::spinner(&format!("computing impl:{}", imp.name()));
            let got = imp
                .compute(&case, compute)
                .map_err(CaseError::computing(&a.case))?;
            (expected, reference, got, format!("impl:{}", imp.name()))
        }
    };
    let mut names: BTreeSet<String> = expected.keys().cloned().collect();
    let unchecked = select(a, case.meta.op, case.expected_results(), &mut names, &got);
    expected.retain(|n, _| names.contains(n));
    let report = VerifyReport::new(
        &a.case.display().to_string(),
        &reference,
        &candidate,
        &expected,
        &got,
        a.max_ratio,
    );
    Ok(finish(a, report.with_intermediates(inter), unchecked))
}

/// Applies `--forward-only` and `--allow-partial` to the names of the
/// expected tensors (against `got`) and returns the names left unchecked.
fn select(
    a: &Args,
    op: Op,
    results: Vec<&'static str>,
    expected: &mut BTreeSet<String>,
    got: &Tensors,
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
            .filter(|n| !got.contains_key(*n))
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

/// `verify --impl` of a large case, one head block at a time (see
/// [`HeadFile`]): the same report as a whole-case run, in bounded memory.
fn streamed(a: &Args, file: &HeadFile) -> Result<VerifyReport, CaseError> {
    let blocks = file.blocks();
    let bar = Progress::bar(blocks.len() as u64, "head blocks");
    let mut rows = BlockRows::default();
    let mut names = None;
    for heads in &blocks {
        let of = format!("heads {}..{} of {}", heads.start, heads.end, file.heads());
        bar.step(&format!("{of}: reading"));
        let case = file.read_inputs(heads)?;
        let (imp, compute) = a.imp.resolve(&case)?;
        imp.check_memory(&case)?;
        let (op, results) = (case.meta.op, case.expected_results());
        let shapes: BTreeMap<String, Vec<usize>> = op
            .results()
            .iter()
            .filter_map(|&n| Some((n.to_string(), case.result_shape(n)?)))
            .collect();
        let oracle = if file.has_results() {
            None
        } else {
            bar.step(&format!("{of}: computing the f64 oracle"));
            Some(oracle_truth(&case, &a.case)?)
        };
        bar.step(&format!("{of}: computing impl:{}", imp.name()));
        let mut got = imp
            .compute_owned(case, compute)
            .map_err(CaseError::computing(&a.case))?;
        let (mut oracle, reference) = match oracle {
            Some(t) => (Some(t), "impl:naive (f64 oracle)"),
            None => (None, "case file"),
        };
        let mut expected: BTreeSet<String> = match &oracle {
            Some(t) => t.keys().cloned().collect(),
            None => file.result_names().into_iter().collect(),
        };
        let unchecked = select(a, op, results, &mut expected, &got);
        // The stored truth is read only now, one tensor at a time, and each
        // computed tensor is freed once compared: the comparison holds one
        // tensor pair beside the rest of the results, never two full sets.
        for name in &expected {
            let truth = match &mut oracle {
                Some(t) => t.remove(name).expect("selected from its names"),
                None => file.read_result(heads, name, &shapes)?,
            };
            rows.add(file, heads, name, &truth, got.remove(name).as_ref())?;
        }
        names.get_or_insert((reference, format!("impl:{}", imp.name()), unchecked));
        bar.inc();
    }
    drop(bar);
    let (reference, candidate, unchecked) = names.expect("H ≥ 2: at least one block");
    let report = VerifyReport::from_rows(
        &a.case.display().to_string(),
        reference,
        &candidate,
        rows.rows(a.max_ratio),
        a.max_ratio,
    );
    Ok(finish(a, report, unchecked))
}

pub fn run(a: Args) -> ExitCode {
    match go(&a) {
        Ok(report) => {
            if a.json {
                super::print(&serde_json::to_string_pretty(&report).expect("report serialises"));
            } else {
                super::print(&report.to_string());
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
