//! `deltaref diagnose`: where an error starts. Compares a candidate file, or
//! an implementation under a precision preset / fault, with the truth, and
//! breaks the error down per token, sequence, rank and chunk.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args as ClapArgs;
use deltaref_verify::bisect::{self, Bisection};
use deltaref_verify::case::Dtype;
use deltaref_verify::case::{Case, CaseError, Op};
use deltaref_verify::diagnose::{diagnose_with_noise, Diagnosis, NoiseReference, TokenMap};

use crate::plot::plot;
use deltaref_verify::files::destination;
use deltaref_verify::impls::{
    oracle_truth, Compute, Engine, Impl, ImplRequest, DEFAULT_CHUNK_SIZE,
};
use deltaref_verify::outputs::Tensors;
use deltaref_verify::presets;
use deltaref_verify::progress::Progress;
use deltaref_verify::report::VerifyReport;

use super::band::{band_request, EnsembleArgs};
use super::{fail, Against, ImplArgs};
use deltaref_verify::band::{self, Verdict};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[arg(long, help = super::CASE_HELP)]
    pub case: PathBuf,
    /// A candidate file holding outputs and gradients (else --impl/--precision compute one).
    #[arg(long)]
    pub candidate: Option<PathBuf>,
    #[command(flatten)]
    pub imp: ImplArgs,
    /// Floor of the band: per-token error above this (and above the noise
    /// reference's) leaves it (FLA's guide: 5e-3 for bf16 KCP).
    #[arg(long, default_value_t = 5e-3)]
    pub band: f64,
    /// Noise reference setting the band chunk by chunk (4× its error there):
    /// `auto` (the --precision preset with its fault off; for a candidate
    /// file with bf16 inputs, fla-bf16), `none` (the floor alone), or a preset name.
    #[arg(long, default_value = "auto")]
    pub noise: String,
    /// Write a PNG of per-token error against token, with rank cuts and chunk boundaries.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Print the diagnosis as JSON.
    #[arg(long)]
    pub json: bool,
    /// Accept a case whose stored truth covers only some outputs and gradients.
    #[arg(long)]
    pub allow_partial: bool,
    /// A forward-only port: compare the outputs and final state alone, and
    /// run no backward (the implementation, the truth and --bisect's runs).
    #[arg(long)]
    pub forward_only: bool,
    /// Break the --precision preset's error down by stage: each stage made
    /// exact in turn and each stage alone rounded; per tensor the share of
    /// the error each stage drives, largest first, and a one-line conclusion.
    #[arg(long)]
    pub bisect: bool,
    /// Also judge each whole tensor against the noise band of this
    /// precision preset (e.g. fla-bf16): inside, above p99 by how many band
    /// widths, far below; the exit status then follows the band, not --band.
    #[arg(long, value_name = "PRECISION")]
    pub noise_band: Option<String>,
    #[command(flatten)]
    pub ensemble: EnsembleArgs,
    /// The candidate file's convention (fla, flashkda, flashinfer-gdn,
    /// flashqla, opengdn, ggml): its tensors are mapped back to FLA's layout first.
    #[arg(long, default_value = "fla")]
    pub convention: String,
    /// What the run is compared with: `truth` (the stored results, else the
    /// f64 oracle) or `non-cp` (a CP --impl against the same engine,
    /// precision and compute without CP: the CP path's error alone).
    #[arg(long, value_enum, default_value_t = Against::Truth)]
    pub against: Against,
}

/// The truth: stored results, else the f64 oracle on the inputs `imp`
/// reads (with `--forward-only`, its forward alone); with
/// `--forward-only`, the outputs and final state only.
fn truth(a: &Args, case: &Case, imp: &Impl) -> Result<Tensors, CaseError> {
    let stored = case.results();
    if !stored.is_empty() {
        return Ok(forward_part(a, case, stored));
    }
    let truth_case = match imp.policy.storage(deltaref::precision::Stage::Inputs) {
        Some(s) => case.with_rounded_inputs(|x| s.round_f64(x)),
        None => case.clone(),
    };
    if a.forward_only {
        Impl::NAIVE.check_memory(&truth_case)?;
        return Impl::NAIVE
            .compute_forward(&truth_case, Compute::F64)
            .map_err(CaseError::computing(&a.case));
    }
    oracle_truth(&truth_case, &a.case)
}

/// With `--forward-only`, the forward results (outputs, final state) of `t` alone.
fn forward_part(a: &Args, case: &Case, mut t: Tensors) -> Tensors {
    if a.forward_only {
        let keep = case.meta.op.forward_results();
        t.retain(|n, _| keep.contains(&n.as_str()));
    }
    t
}

/// What `imp` computes for `case`: forward and backward, or with
/// `--forward-only` the forward alone (a forward-only port has no backward
/// to compare, and running one costs time and can fail on its own).
fn compute_run(a: &Args, imp: &Impl, case: &Case, compute: Compute) -> Result<Tensors, CaseError> {
    let r = if a.forward_only {
        imp.compute_forward(case, compute)
    } else {
        imp.compute(case, compute)
    };
    r.map_err(CaseError::computing(&a.case))
}

/// `--bisect`: the preset's error by stage.
fn go_bisect(a: &Args) -> Result<Bisection, CaseError> {
    let usage = |m: &str| Err(CaseError::Usage(m.into()));
    let Some(preset) = &a.imp.precision else {
        return usage(
            "--bisect breaks a --precision preset's error down by stage: give --precision",
        );
    };
    if a.candidate.is_some() || a.plot.is_some() || a.noise != "auto" || a.against != Against::Truth
    {
        return usage(
            "--bisect computes its own runs against the truth: drop --candidate, --plot, --noise and --against",
        );
    }
    let case = Case::read(&a.case)?;
    let (imp, compute) = a.imp.resolve(&case)?;
    if imp.policy.features().is_empty() {
        return Err(CaseError::Usage(format!(
            "--precision {preset} rounds no stage: nothing to bisect"
        )));
    }
    let reference = truth(a, &case, &imp)?;
    imp.check_memory(&case)?;
    let _p = Progress::spinner(&format!(
        "bisecting --precision {preset}: {} runs of impl:{}",
        bisect::runs(&imp.policy),
        imp.name()
    ));
    let forward_only = a.forward_only;
    bisect::bisect(preset, &imp, &reference, |i| {
        if forward_only {
            i.compute_forward(&case, compute)
        } else {
            i.compute(&case, compute)
        }
    })
    .map_err(CaseError::computing(&a.case))
}

/// What `diagnose` found: the per-token diagnosis, the rows that could not
/// be compared, and (with `--noise-band`) each tensor against its band.
struct Found {
    d: Diagnosis,
    problems: Vec<String>,
    verdicts: Option<Vec<Verdict>>,
    /// Per-head errors of the tensors that fail somewhere.
    heads: Vec<String>,
    /// The tensors verify's test fails (`max_abs > 1e-6` and `norm_ratio
    /// ≥ --band`), and whether verify would pass.
    failing: Vec<String>,
    verify_pass: bool,
    /// What was compared with what, the preset and compute dtype included.
    header: String,
}

/// The report's first line: the case, what ran (preset and compute dtype)
/// or the candidate (its declared dtype), and the reference.
fn header(a: &Args, imp: &Impl, compute: Compute, declared: &Declared, stored: bool) -> String {
    let got = match &a.candidate {
        Some(p) => format!(
            "{} (declared dtype {}{})",
            p.display(),
            declared
                .dtype
                .map_or("none".to_string(), |d| d.name().to_string()),
            declared
                .precision
                .as_ref()
                .map_or(String::new(), |p| format!(", precision {p}"))
        ),
        None => super::impl_label(&imp.name(), a.imp.precision.as_deref(), compute),
    };
    let reference = match (a.against, stored) {
        (Against::NonCp, _) => "the same run without CP",
        (Against::Truth, true) => "case file",
        (Against::Truth, false) => "impl:naive (f64 oracle)",
    };
    format!("case {}: {got} against {reference}", a.case.display())
}

fn go(a: &Args) -> Result<Found, CaseError> {
    super::check_ratio("--band", a.band)?;
    let case = Case::read(&a.case)?;
    super::warn_domain(&case);
    let plot_path = a.plot.as_deref().map(destination).transpose()?;
    let invalid = CaseError::computing(&a.case);
    let (imp, compute) = a.imp.resolve(&case)?;
    let reference =
        match a.against {
            Against::Truth => truth(a, &case, &imp)?,
            Against::NonCp if a.candidate.is_some() => return Err(CaseError::Usage(
                "--against non-cp runs the same implementation without CP: it needs --impl cp, \
                 not --candidate"
                    .into(),
            )),
            Against::NonCp => {
                let precision = a.imp.precision.as_deref();
                super::non_cp_reference(&imp, &case, precision, compute, a.forward_only)?.0
            }
        };
    let mut declared = Declared::default();
    let candidate = match &a.candidate {
        Some(p) => {
            let (said, results) = candidate_results(a, &case, p)?;
            declared = said;
            forward_part(a, &case, results)
        }
        None => {
            imp.check_memory(&case)?;
            let _p = Progress::spinner(&format!("computing impl:{}", imp.name()));
            compute_run(a, &imp, &case, compute)?
        }
    };
    // A candidate is laid out as the case says: its `cp` metadata (rank
    // cuts) and chunk size, as verify reads its intermediates.
    let layout = match &a.candidate {
        Some(_) => ImplRequest {
            chunk_size: a.imp.chunk_size,
            ..ImplRequest::chunked_for(&case)
        }
        .resolve(&case)?,
        None => imp.clone(),
    };
    // Fail exactly where verify fails: missing, misshapen or non-finite
    // tensors, nothing to compare, or partial truth.
    let keep = case.meta.op.forward_results();
    let unchecked = case
        .expected_results()
        .into_iter()
        .filter(|n| !a.forward_only || keep.contains(n))
        .filter(|n| !reference.contains_key(*n))
        .map(String::from)
        .collect();
    let verdict = VerifyReport::new("", "", "", &reference, &candidate, a.band)
        .with_unchecked(unchecked, a.allow_partial);
    let problems = verdict.problems();
    let failing: Vec<String> = verdict
        .rows
        .iter()
        .filter(|r| !r.pass)
        .map(|r| r.tensor.clone())
        .collect();
    let (b, t) = case
        .tensors
        .get(case.meta.op.first_input())
        .map(|x| (x.shape()[0], x.shape()[1]))
        .unwrap_or((1, 0));
    let cuts = match &layout.cp {
        Some((spec, _)) => spec
            .build(b, t, case.cu_seqlens.as_deref())
            .map_err(|e| invalid(e.into()))?
            .cuts()
            .to_vec(),
        None => vec![],
    };
    let chunk = match layout.engine {
        Engine::Chunk(c) => c.get(),
        Engine::Naive => case.meta.chunk_size.unwrap_or(DEFAULT_CHUNK_SIZE),
    };
    let map = TokenMap::new(b, t, case.cu_seqlens.as_deref(), &cuts, chunk);
    let noise = noise_run(a, &case, &declared)?;
    let v_dim = case.meta.op.is_delta_rule().then(|| case.value_dim());
    let d = diagnose_with_noise(
        &reference,
        &candidate,
        noise.as_ref().map(|(name, t)| NoiseReference {
            name: name.clone(),
            tensors: t,
        }),
        &map,
        a.band,
        v_dim,
    );
    if let Some(path) = &plot_path {
        plot(&d, path).map_err(CaseError::Usage)?;
    }
    let verdicts = match &a.noise_band {
        None => None,
        Some(p) => {
            let req = band_request(&a.imp, &case, p)?;
            let b = band::of_case(&case, &a.case, &reference, &req, &a.ensemble.spec())?;
            Some(band::judge(&b, &band::ratios(&reference, &candidate)))
        }
    };
    let heads = head_lines(case.meta.op, &reference, &candidate, a.band);
    Ok(Found {
        d,
        problems,
        verdicts,
        heads,
        failing,
        verify_pass: verdict.pass,
        header: header(a, &imp, compute, &declared, !case.results().is_empty()),
    })
}

/// `o per head: worst head 3 (…), 2 of 4 heads above …` for each tensor
/// with a head axis that fails somewhere (a head-mapping bug fails some
/// heads only), judged at `band`.
fn head_lines(op: Op, reference: &Tensors, candidate: &Tensors, band: f64) -> Vec<String> {
    let r = VerifyReport::new("", "", "", reference, candidate, band)
        .with_heads(op, reference, candidate);
    r.rows
        .iter()
        .filter(|row| {
            row.per_head.len() > 1 && row.per_head.iter().any(|x| x.is_nan() || *x > band)
        })
        .filter_map(|row| {
            Some(format!(
                "{} per head: {}",
                row.tensor,
                row.heads_line(band)?
            ))
        })
        .collect()
}

/// What a candidate file says produced it (its `case` metadata's `dtype`
/// and `precision`).
#[derive(Clone, Debug, Default)]
struct Declared {
    dtype: Option<Dtype>,
    precision: Option<String>,
}

/// What the candidate file declares, and its results mapped from
/// `--convention` to FLA's layout.
fn candidate_results(
    a: &Args,
    case: &Case,
    path: &std::path::Path,
) -> Result<(Declared, Tensors), CaseError> {
    let cand = Case::read_candidate_for(path, case)?;
    let conv = super::convention(&a.convention, case)?;
    let dims = deltaref_verify::convention::Dims::of(case).map_err(CaseError::Usage)?;
    let results = conv
        .to_fla(case.meta.op, &dims, cand.results())
        .map_err(|e| CaseError::Usage(format!("--candidate in convention {}: {e}", conv.name)))?;
    let declared = Declared {
        dtype: cand.meta.dtype,
        precision: cand.meta.precision.clone(),
    };
    Ok((declared, results))
}

/// The preset `--noise auto` takes for a candidate file: what the
/// candidate declares (the `precision` preset that produced it, its fault
/// off; else its `dtype`: a bf16 kernel is judged against fla-bf16's noise,
/// an fp32 one against f32's, an f64 one against none), else, undeclared,
/// fla-bf16 when the case's inputs are bf16. Returns the preset and why,
/// for the report.
fn auto_for_candidate(case: &Case, declared: &Declared) -> Option<(String, String)> {
    if let Some(p) = &declared.precision {
        let base = presets::without_fault(p);
        let why = format!("the candidate declares precision {p}");
        return (base != "exact").then(|| (base.to_string(), why));
    }
    let bf16_inputs = case.dtypes.get(case.meta.op.first_input()) == Some(&Dtype::Bf16);
    let named = |p: &str, why: &str| Some((p.to_string(), why.to_string()));
    match declared.dtype {
        Some(Dtype::Bf16) => named("fla-bf16", "the candidate declares dtype bf16"),
        Some(Dtype::F32) => named("f32", "the candidate declares dtype f32"),
        Some(_) => None,
        None if bf16_inputs => named(
            "fla-bf16",
            "the candidate declares no dtype and the case's inputs are bf16: assumed a bf16 \
             kernel (state the candidate's `dtype` in its metadata to change this)",
        ),
        None => None,
    }
}

/// The noise reference's name (with why it was chosen) and results, if
/// any (see `--noise`); `declared`: what the candidate says produced it.
fn noise_run(
    a: &Args,
    case: &Case,
    declared: &Declared,
) -> Result<Option<(String, Tensors)>, CaseError> {
    let (name, why) = match (a.noise.as_str(), &a.imp.precision, &a.candidate) {
        ("none", _, _) => return Ok(None),
        ("auto", Some(p), None) => (
            presets::without_fault(p).to_string(),
            "--precision with its fault off".to_string(),
        ),
        ("auto", _, Some(_)) => match auto_for_candidate(case, declared) {
            Some((p, why)) => (p, why),
            None => return Ok(None),
        },
        ("auto", _, _) => return Ok(None),
        (p, _, _) => (p.to_string(), "--noise".to_string()),
    };
    let (mut req, _) = a.imp.request()?;
    if a.candidate.is_some() {
        req = ImplRequest::chunked_for(case);
    }
    req.precision = Some(name.clone());
    let (imp, compute) = req.resolve_with_compute(case)?;
    let t = compute_run(a, &imp, case, compute.unwrap_or(Compute::F64))?;
    Ok(Some((format!("`{name}` (chosen by {why})"), t)))
}

pub fn run(a: Args) -> ExitCode {
    if a.bisect {
        return match go_bisect(&a) {
            Ok(b) => {
                if a.json {
                    super::print(&serde_json::to_string_pretty(&b).expect("bisection serialises"));
                } else {
                    super::print(&b.to_string());
                }
                // Like verify: fail when the full preset's error is out of band.
                if b.tensors.iter().all(|t| t.full <= a.band) {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                }
            }
            Err(e) => fail(&e),
        };
    }
    match go(&a) {
        Ok(Found {
            d,
            problems,
            verdicts,
            heads,
            failing,
            verify_pass,
            header,
        }) => {
            if a.json {
                let j = match &verdicts {
                    None => serde_json::to_value(&d),
                    Some(v) => {
                        serde_json::to_value(serde_json::json!({"diagnosis": &d, "band": v}))
                    }
                };
                super::print(
                    &serde_json::to_string_pretty(&j.expect("diagnosis serialises")).expect("JSON"),
                );
            } else {
                super::print(&header);
                super::print(&d.to_string());
                for h in &heads {
                    super::print(h);
                }
                if let Some(v) = &verdicts {
                    super::print(&format!(
                        "against the band of `{}`:",
                        a.noise_band.as_deref().unwrap_or("")
                    ));
                    super::print(&band::verdict_table(v));
                }
                if let Some(p) = &a.plot {
                    super::print(&format!("plot: {}", p.display()));
                }
            }
            for p in &problems {
                eprintln!("FAIL: {p}");
            }
            // Verify's status (with --band as its max ratio, or the noise
            // band's verdict with --noise-band), stated on the last line:
            // where the error starts is information either way.
            let pass = match &verdicts {
                Some(v) => problems.is_empty() && v.iter().all(|v| v.pass),
                None => verify_pass,
            };
            if !a.json {
                super::print(&verdict_line(pass, &failing, &problems, a.band));
            }
            if pass {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => fail(&e),
    }
}

/// The headline: verify's verdict on the whole tensors, which the exit
/// status follows (never a passing line under a failing status).
fn verdict_line(pass: bool, failing: &[String], problems: &[String], band: f64) -> String {
    if pass {
        return format!("verdict: pass (every tensor passes verify at max ratio {band:.1e})");
    }
    let mut why = vec![];
    if !failing.is_empty() {
        why.push(format!(
            "{} fail verify at max ratio {band:.1e}",
            failing.join(", ")
        ));
    }
    why.extend(problems.iter().cloned());
    if why.is_empty() {
        why.push("outside the noise band (--noise-band)".into());
    }
    format!("verdict: FAIL ({})", why.join("; "))
}
