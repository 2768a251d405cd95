//! Judging one candidate against the float64 truth: FLA's `assert_close`
//! per tensor, per-head errors, and the likely cause of a failure.

use serde::Serialize;

use crate::case::Case;
use crate::cause::{likely_cause, Cause};
use crate::convention::Convention;
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

/// Judges the candidate's results `cand` (FLA's layout) on the FLA case
/// `case` against `truth` at tolerance `ratio`: every tensor of `truth` is
/// required; on a failure the likely cause is searched in convention `c`.
pub fn judge(case: &Case, c: &Convention, truth: &Tensors, cand: &Tensors, ratio: f64) -> Verdict {
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
                let cmp = a.comparison(ratio);
                TensorCheck {
                    name: name.into(),
                    norm_ratio: cmp.norm_ratio,
                    max_abs: cmp.max_abs,
                    pass: cmp.pass,
                    problem: None,
                    per_head: per_head(info.head_axis(name), t, x),
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
        likely_cause(case, c, cand, &failing, ratio)
    };
    Verdict {
        checks,
        failing,
        cause,
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
