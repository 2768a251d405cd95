//! Judging one candidate against the float64 truth: FLA's `assert_close`
//! per tensor, per-head errors, and the likely cause of a failure.

use serde::Serialize;

use rayon::prelude::*;

use crate::band::{self, Band, BandSpec, MARGIN_WIDTHS};
use crate::case::{Case, CaseError};
use crate::cause::{likely_cause, Cause};
use crate::convention::Convention;
use crate::impls::{ImplName, ImplRequest};
use crate::metrics::Accum;
use crate::outputs::Tensors;

/// One tensor's comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorCheck {
    pub name: String,
    pub norm_ratio: f64,
    pub max_abs: f64,
    pub pass: bool,
    /// Missing, or shaped otherwise than the truth.
    pub problem: Option<String>,
    /// `norm_ratio` of each head along the tensor's head axis.
    pub per_head: Vec<f64>,
    /// With `--band`: where `norm_ratio` sits in the case's noise band
    /// (`inside`, `OUT above p99 by 3.1 widths`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub band: Option<String>,
}

/// A candidate's verdict on one case.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub checks: Vec<TensorCheck>,
    /// The failing tensors, in the op's result order.
    pub failing: Vec<String>,
    pub cause: Option<Cause>,
}

impl Verdict {
    pub fn pass(&self) -> bool {
        self.failing.is_empty()
    }

    /// What "failing in the same way" means while shrinking: the failing
    /// tensors and the named cause.
    pub fn signature(&self) -> String {
        format!(
            "{} [{}]",
            self.failing.join(","),
            self.cause.as_ref().map_or("unexplained".into(), |c| c
                .mistakes
                .iter()
                .map(|m| m.name())
                .collect::<Vec<_>>()
                .join("+"))
        )
    }
}

/// How each tensor is judged.
#[derive(Clone, Copy, Debug)]
pub enum Rule<'a> {
    /// FLA's `assert_close`: pass when max_abs ≤ 1e-6 or norm_ratio < the ratio.
    Tolerance(f64),
    /// In the case's noise band ([`band::judge_one`]) or max_abs ≤ 1e-6; a
    /// tensor the band has no row for is judged at `fallback`.
    Band { band: &'a Band, fallback: f64 },
}

impl Rule<'_> {
    /// The norm_ratio tensor `name` must stay under to pass (the band's
    /// edge: `p99` plus [`MARGIN_WIDTHS`] widths).
    pub fn limit(&self, name: &str) -> f64 {
        match self {
            Rule::Tolerance(r) => *r,
            Rule::Band { band, fallback } => band
                .row(name)
                .map_or(*fallback, |r| r.p99 + MARGIN_WIDTHS * r.width()),
        }
    }
}

/// Judges the candidate's results `cand` (FLA's layout) on the FLA case
/// `case` against `truth` at tolerance `ratio`: every tensor of `truth` is
/// required; on a failure the likely cause is searched in convention `c`.
pub fn judge(case: &Case, c: &Convention, truth: &Tensors, cand: &Tensors, ratio: f64) -> Verdict {
    judge_by(case, c, truth, cand, Rule::Tolerance(ratio))
}

/// [`judge`] with any [`Rule`]; under a band the likely cause is searched
/// at the largest band edge of the failing tensors.
pub fn judge_by(
    case: &Case,
    c: &Convention,
    truth: &Tensors,
    cand: &Tensors,
    rule: Rule,
) -> Verdict {
    let info = case.meta.op.info();
    let mut checks = vec![];
    for name in info.results() {
        let Some(t) = truth.get(name) else { continue };
        let check = match cand.get(name) {
            None => problem(name, "missing from the candidate".into()),
            Some(x) if x.shape() != t.shape() => problem(
                name,
                format!("shape {:?}, expected {:?}", x.shape(), t.shape()),
            ),
            Some(x) => {
                let mut a = Accum::default();
                a.add(t.iter().copied().zip(x.iter().copied()), |i| i);
                let cmp = a.comparison(rule.limit(name));
                let (pass, band) = match (rule, cmp.max_abs <= 1e-6) {
                    (Rule::Band { band, .. }, floor) => match band.row(name) {
                        Some(row) => {
                            let v = band::judge_one(row, cmp.norm_ratio);
                            let at = match v.position {
                                band::Position::Inside => "inside".to_string(),
                                p => format!("{} by {:.2} widths", p.name(), v.widths),
                            };
                            (
                                v.pass || floor,
                                Some(format!("{at} [p1 {:.2e}, p99 {:.2e}]", row.p1, row.p99)),
                            )
                        }
                        None => (cmp.pass, None),
                    },
                    _ => (cmp.pass, None),
                };
                TensorCheck {
                    name: name.into(),
                    norm_ratio: cmp.norm_ratio,
                    max_abs: cmp.max_abs,
                    pass,
                    problem: None,
                    per_head: per_head(info.head_axis(name), t, x),
                    band,
                }
            }
        };
        checks.push(check);
    }
    let failing: Vec<String> = checks
        .iter()
        .filter(|c| !c.pass)
        .map(|c| c.name.clone())
        .collect();
    let cause = if failing.is_empty() {
        None
    } else {
        let ratio = failing.iter().map(|n| rule.limit(n)).fold(0.0, f64::max);
        likely_cause(case, c, cand, &failing, ratio)
    };
    Verdict {
        checks,
        failing,
        cause,
    }
}

/// `fuzz --band PRESET`: the noise band a correct kernel in `preset`'s
/// precision shows on a case, from `samples` jittered runs (small: it is
/// drawn for every case).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BandRule {
    pub preset: String,
    pub samples: usize,
}

impl BandRule {
    /// The band of `case`'s forward results (FLA's layout) against
    /// `truth`: the preset's emulation (chunked, under CP when the case has
    /// cut points; its CP fault, if any, left out) run `samples` times
    /// jittered ([`band::BandSpec`]), seeded by the case's seed. A preset
    /// that stores nothing in a lower precision has no band: an error.
    pub fn band_of(&self, case: &Case, truth: &Tensors) -> Result<Band, CaseError> {
        let spec = BandSpec {
            samples: self.samples,
            seed: case.meta.seed.unwrap_or(0),
            ..BandSpec::default()
        };
        spec.check().map_err(CaseError::Usage)?;
        let precision = crate::presets::without_fault(&self.preset);
        let req = ImplRequest {
            name: if case.meta.cp.is_some() {
                ImplName::Cp
            } else {
                ImplName::Chunk
            },
            precision: Some(precision.into()),
            ..ImplRequest::default()
        };
        let (imp, compute) = req.resolve_with_compute(case)?;
        if imp.policy.features().is_empty()
            && imp
                .cp
                .as_ref()
                .is_none_or(|(_, o)| o.policy.features().is_empty())
        {
            return Err(CaseError::Usage(format!(
                "--band {}: precision `{precision}` stores nothing in a lower precision, so its \
                 band is a single point (use e.g. fla-bf16, or --tolerance)",
                self.preset
            )));
        }
        let compute = compute.unwrap_or(crate::impls::Compute::F32);
        let samples = (0..spec.samples)
            .into_par_iter()
            .map(|i| {
                let got = imp
                    .jittered(spec.jitter_of(i))
                    .compute_forward(case, compute)
                    .map_err(|e| CaseError::Usage(format!("--band {}: {e}", self.preset)))?;
                Ok(band::ratios(truth, &got))
            })
            .collect::<Result<Vec<_>, CaseError>>()?;
        Ok(Band::of(
            case.meta.op,
            precision,
            &imp.name(),
            spec,
            &samples,
        ))
    }
}

fn problem(name: &str, why: String) -> TensorCheck {
    TensorCheck {
        name: name.into(),
        norm_ratio: f64::NAN,
        max_abs: f64::NAN,
        pass: false,
        problem: Some(why),
        per_head: vec![],
        band: None,
    }
}

/// `norm_ratio` per index of axis `axis` (none without a head axis).
fn per_head(axis: Option<usize>, t: &ndarray::ArrayD<f64>, x: &ndarray::ArrayD<f64>) -> Vec<f64> {
    let Some(a) = axis.filter(|&a| a < t.ndim()) else {
        return vec![];
    };
    let ax = ndarray::Axis(a);
    t.axis_iter(ax)
        .zip(x.axis_iter(ax))
        .map(|(th, xh)| {
            let mut acc = Accum::default();
            acc.add(th.iter().copied().zip(xh.iter().copied()), |i| i);
            acc.norm_ratio()
        })
        .collect()
}
