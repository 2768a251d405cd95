//! `deltaref fuzz`: property tests of a candidate kernel (issue 49).
//!
//! Each case is drawn valid for the op and the candidate's convention
//! ([`draw`]), written in that convention and run through the candidate
//! ([`runner`]), mapped back to FLA's layout and judged against the float64
//! truth ([`judge`]). A failing case is shrunk while it fails the same way
//! ([`shrink`]) and reported with its likely cause; with an output folder
//! its case file (FLA's layout, with the truth) and the candidate's results
//! (its convention) are written with the command that replays them.

pub mod draw;
pub mod judge;
pub mod runner;
pub mod shrink;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::case::{Case, CaseError};
use crate::impls::{Compute, Impl};
use crate::outputs::Tensors;

pub use draw::{Extra, FuzzConfig, Params};
pub use judge::{judge, judge_by, BandRule, Rule, TensorCheck, Verdict};
pub use runner::{
    CommandRunner, FnRunner, KernelCase, OracleRunner, Runner, RunnerError, WorkerRunner,
};

/// How long a run goes and what it does with failures.
#[derive(Clone, Debug)]
pub struct FuzzOptions {
    /// Most cases (with `time`, whichever ends first).
    pub cases: Option<u64>,
    pub time: Option<Duration>,
    pub seed: u64,
    /// FLA's `assert_close` ratio a tensor must stay under.
    pub tolerance: f64,
    /// `--band PRESET`: judge each case in its noise band instead (tensors
    /// without a band row, such as gradients, at `tolerance`).
    pub band: Option<BandRule>,
    /// Keep going after the first failure (each new way of failing is shrunk).
    pub keep_going: bool,
    /// Most variants tried while shrinking one failure.
    pub shrink_budget: usize,
    /// Where each failure's case and candidate files go.
    pub out: Option<PathBuf>,
}

impl Default for FuzzOptions {
    fn default() -> Self {
        FuzzOptions {
            cases: Some(100),
            time: None,
            seed: 0,
            tolerance: 1e-4,
            band: None,
            keep_going: false,
            shrink_budget: 300,
            out: None,
        }
    }
}

/// One failure: the case as drawn and as shrunk, and why it fails.
#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    /// Its index in the run (replay with the same seed).
    pub index: u64,
    pub drawn: Params,
    pub shrunk: Params,
    pub shrink_steps: usize,
    /// `o,final_state [head-mapping]`: what failing the same way means.
    pub signature: String,
    /// The shrunk case's verdict (per-tensor and per-head errors, cause).
    pub verdict: Verdict,
    /// The runner's error, when it failed without results.
    pub runner_error: Option<String>,
    /// The shrunk case file and the candidate's results (with `out`).
    pub files: Option<(PathBuf, PathBuf)>,
    /// The one command that replays the shrunk failure.
    pub replay: Option<String>,
}

/// A whole run.
#[derive(Clone, Debug, Serialize)]
pub struct FuzzReport {
    pub op: String,
    pub convention: String,
    pub runner: String,
    /// How tensors were judged: `tolerance 0.0001` or `band fla-bf16 (4 samples)`.
    pub judged: String,
    pub seed: u64,
    pub cases: u64,
    pub passes: u64,
    /// Failing cases by signature (all of them, shrunk or not).
    pub failing_cases: BTreeMap<String, u64>,
    /// The shrunk failures, one per signature.
    pub failures: Vec<Failure>,
    pub seconds: f64,
    pub cases_per_minute: f64,
}

impl FuzzReport {
    pub fn pass(&self) -> bool {
        self.failing_cases.is_empty()
    }
}

/// One case's outcome.
pub struct Outcome {
    pub case: Case,
    pub truth: Tensors,
    /// The candidate's results in its convention (empty on a runner error).
    pub candidate: Tensors,
    pub verdict: Verdict,
    pub runner_error: Option<String>,
}

/// Builds the case `p` describes, runs it through `runner` in the
/// configured convention and judges it at `tolerance`. A runner that
/// cannot run at all is an error; one that fails on this case is a failed
/// verdict.
pub fn evaluate(
    cfg: &FuzzConfig,
    p: &Params,
    runner: &mut dyn Runner,
    tolerance: f64,
) -> Result<Outcome, RunnerError> {
    evaluate_by(cfg, p, runner, tolerance, None)
}

/// [`evaluate`], judged in the case's noise band when `band` is given
/// (a band that cannot be drawn, e.g. for a preset with no rounding, is
/// an error: the run cannot go on).
pub fn evaluate_by(
    cfg: &FuzzConfig,
    p: &Params,
    runner: &mut dyn Runner,
    tolerance: f64,
    band: Option<&BandRule>,
) -> Result<Outcome, RunnerError> {
    let case = p
        .case(cfg.op, cfg.convention, cfg.dtype)
        .map_err(|e| RunnerError::Broken(format!("drawing {}: {e}", p.describe())))?;
    let kcase = KernelCase::of(&case, cfg.convention, cfg.dtype).map_err(RunnerError::Broken)?;
    let (candidate, runner_error) = match runner.run(&kcase) {
        Ok(t) => (t, None),
        Err(RunnerError::Failed(e)) => (Tensors::new(), Some(e)),
        Err(e) => return Err(e),
    };
    let (fla, map_error) = match kcase.results_to_fla(candidate.clone()) {
        Ok(t) => (t, None),
        Err(e) => (Tensors::new(), Some(e)),
    };
    let grads = case.meta.op.info().grads;
    let backward = fla.keys().any(|n| grads.contains(&n.as_str()));
    let truth = if backward {
        Impl::NAIVE.compute(&case, Compute::F64)
    } else {
        Impl::NAIVE.compute_forward(&case, Compute::F64)
    }
    .map_err(|e| RunnerError::Broken(format!("the f64 oracle on {}: {e}", p.describe())))?;
    let verdict = match band {
        None => judge(&case, cfg.convention, &truth, &fla, tolerance),
        Some(b) => {
            let band = b
                .band_of(&case, &truth)
                .map_err(|e| RunnerError::Broken(e.to_string()))?;
            let rule = Rule::Band {
                band: &band,
                fallback: tolerance,
            };
            judge_by(&case, cfg.convention, &truth, &fla, rule)
        }
    };
    Ok(Outcome {
        case,
        truth,
        candidate,
        verdict,
        runner_error: runner_error.or(map_error),
    })
}

/// The signature of an outcome: the runner's failure, or the verdict's.
fn signature(o: &Outcome) -> Option<String> {
    match (&o.runner_error, o.verdict.pass()) {
        (Some(_), _) => Some("runner-error".into()),
        (None, true) => None,
        (None, false) => Some(o.verdict.signature()),
    }
}

/// Runs the fuzzer: draws cases until the budget ends (or the first
/// failure, unless `keep_going`), shrinking each new way of failing.
/// `on_case(i, passed)` is called after each case (progress).
pub fn fuzz(
    cfg: &FuzzConfig,
    runner: &mut dyn Runner,
    opt: &FuzzOptions,
    mut on_case: impl FnMut(u64, bool),
) -> Result<FuzzReport, CaseError> {
    cfg.check()?;
    let start = Instant::now();
    let mut report = FuzzReport {
        op: cfg.op.name().into(),
        convention: cfg.convention.name.into(),
        runner: runner.name(),
        judged: match &opt.band {
            None => format!("tolerance {}", opt.tolerance),
            Some(b) => format!("band {} ({} samples)", b.preset, b.samples),
        },
        seed: opt.seed,
        cases: 0,
        passes: 0,
        failing_cases: BTreeMap::new(),
        failures: vec![],
        seconds: 0.0,
        cases_per_minute: 0.0,
    };
    let broken = |e: RunnerError| CaseError::Usage(e.to_string());
    let mut i = 0u64;
    while opt.cases.is_none_or(|n| i < n) && opt.time.is_none_or(|t| start.elapsed() < t) {
        let p = cfg.draw(opt.seed, i);
        let o = evaluate_by(cfg, &p, runner, opt.tolerance, opt.band.as_ref()).map_err(broken)?;
        report.cases += 1;
        let sig = signature(&o);
        on_case(i, sig.is_none());
        match sig {
            None => report.passes += 1,
            Some(s) if i == 0 && s == "runner-error" && opt.cases != Some(1) => {
                return Err(CaseError::Usage(format!(
                    "the runner could not run the first case ({}): {}",
                    p.describe(),
                    o.runner_error.unwrap_or_default()
                )));
            }
            Some(s) => {
                let new = !report.failing_cases.contains_key(&s);
                *report.failing_cases.entry(s.clone()).or_insert(0) += 1;
                if new {
                    report
                        .failures
                        .push(shrink_failure(cfg, runner, opt, i, p, &s)?);
                }
                if !opt.keep_going {
                    break;
                }
            }
        }
        i += 1;
    }
    report.seconds = start.elapsed().as_secs_f64();
    report.cases_per_minute = report.cases as f64 * 60.0 / report.seconds.max(1e-9);
    Ok(report)
}

/// Shrinks failure `p` (case `index`, failing as `sig`) and writes its files.
fn shrink_failure(
    cfg: &FuzzConfig,
    runner: &mut dyn Runner,
    opt: &FuzzOptions,
    index: u64,
    p: Params,
    sig: &str,
) -> Result<Failure, CaseError> {
    let (shrunk, steps) = shrink::shrink(cfg, p.clone(), sig, opt.shrink_budget, |q| {
        evaluate_by(cfg, q, runner, opt.tolerance, opt.band.as_ref())
            .ok()
            .and_then(|o| signature(&o))
    });
    let o = evaluate_by(cfg, &shrunk, runner, opt.tolerance, opt.band.as_ref())
        .map_err(|e| CaseError::Usage(e.to_string()))?;
    let files = match &opt.out {
        Some(dir) => Some(write_failure(dir, cfg, index, &o)?),
        None => None,
    };
    let judged = match &opt.band {
        None => format!("--max-ratio {}", opt.tolerance),
        Some(b) => format!(
            "--band {} --samples {} --band-seed {}",
            crate::presets::without_fault(&b.preset),
            b.samples,
            o.case.meta.seed.unwrap_or(0)
        ),
    };
    let replay = files.as_ref().map(|(c, k)| {
        format!(
            "deltaref verify --case {} --candidate {} --convention {} {judged} --forward-only",
            c.display(),
            k.display(),
            cfg.convention.name,
        )
    });
    Ok(Failure {
        index,
        drawn: p,
        shrunk,
        shrink_steps: steps,
        signature: sig.into(),
        verdict: o.verdict,
        runner_error: o.runner_error,
        files,
        replay,
    })
}

/// `DIR/failure-I.case.safetensors` (FLA's layout, inputs and f64 truth)
/// and `DIR/failure-I.candidate.safetensors` (the candidate's results in
/// its convention, f64).
fn write_failure(
    dir: &Path,
    cfg: &FuzzConfig,
    index: u64,
    o: &Outcome,
) -> Result<(PathBuf, PathBuf), CaseError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| CaseError::Usage(format!("--out {}: {e}", dir.display())))?;
    let cpath = dir.join(format!("failure-{index}.case.safetensors"));
    let kpath = dir.join(format!("failure-{index}.candidate.safetensors"));
    let mut case = o.case.clone();
    for (n, x) in &o.truth {
        case.insert(n, x.clone(), crate::case::Dtype::F64);
    }
    case.write(&cpath)?;
    let mut cand = Case::new(o.case.meta.clone());
    for (n, x) in &o.candidate {
        cand.insert(n, x.clone(), crate::case::Dtype::F64);
    }
    let bytes =
        cand.to_bytes_with_metadata(&[("convention", cfg.convention.to_json().to_string())])?;
    crate::case::write_atomic(&kpath, &bytes)?;
    Ok((cpath, kpath))
}

/// The report as a table: cases, passes, failures grouped by signature,
/// and each shrunk failure with its cause and replay command.
pub fn render(r: &FuzzReport) -> String {
    let mut s = format!(
        "fuzz --op {} --convention {} --runner {} (seed {}, judged by {})\n{} cases, {} passed, {} failed ({:.1} s, {:.0} cases/min)\n",
        r.op,
        r.convention,
        r.runner,
        r.seed,
        r.judged,
        r.cases,
        r.passes,
        r.cases - r.passes,
        r.seconds,
        r.cases_per_minute
    );
    if !r.failing_cases.is_empty() {
        s += "\nfailing cases by way of failing:\n";
        for (sig, n) in &r.failing_cases {
            s += &format!("  {n:>6}  {sig}\n");
        }
    }
    for f in &r.failures {
        s += &format!(
            "\nfailure (case {}), shrunk in {} steps to: {}\n",
            f.index,
            f.shrink_steps,
            f.shrunk.describe()
        );
        if let Some(e) = &f.runner_error {
            s += &format!("  runner error: {e}\n");
        }
        for c in f.verdict.checks.iter().filter(|c| !c.pass) {
            match &c.problem {
                Some(p) => s += &format!("  {}: {p}\n", c.name),
                None => {
                    let heads: Vec<String> =
                        c.per_head.iter().map(|x| format!("{x:.1e}")).collect();
                    s += &format!(
                        "  {}: norm_ratio {:.3e}, max_abs {:.3e}{}; per head [{}]\n",
                        c.name,
                        c.norm_ratio,
                        c.max_abs,
                        c.band
                            .as_ref()
                            .map_or(String::new(), |b| format!(", band: {b}")),
                        heads.join(", ")
                    );
                }
            }
        }
        match &f.verdict.cause {
            Some(c) => s += &format!("  likely cause: {}\n", c.sentence),
            None => s += "  likely cause: none of the usual convention mistakes explains it\n",
        }
        if let Some(cmd) = &f.replay {
            s += &format!("  replay: {cmd}\n");
        }
    }
    s
}

#[cfg(test)]
mod tests;
