//! The per-tensor comparison report of `deltaref verify` (table and JSON).

use std::fmt;

use ndarray::ArrayD;
use serde::Serialize;

use crate::band::{verdict_table, Band, Verdict};
use crate::intermediates::IntermediateRow;
use crate::metrics::Accum;
use crate::outputs::Tensors;

/// One tensor's comparison; `missing` when the candidate lacks it.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyRow {
    pub tensor: String,
    pub shape: Vec<usize>,
    pub norm_ratio: Option<f64>,
    pub max_abs: Option<f64>,
    /// Multi-dimensional index of the largest difference.
    pub argmax: Option<Vec<usize>>,
    pub pass: bool,
    /// Why the row fails in words: missing tensor, shape mismatch (no
    /// numbers then), or non-finite candidate values.
    pub problem: Option<String>,
    /// norm_ratio of each head along the tensor's head axis (`H`, `HV`),
    /// when it has one ([`VerifyReport::with_heads`]): a head-mapping bug
    /// fails some heads and not others.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_head: Vec<f64>,
}

/// The whole comparison.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub case: String,
    /// What the expected tensors came from: `"case file"` or `"impl:<name>"`.
    pub reference: String,
    /// The candidate file or `"impl:<name>"`.
    pub candidate: String,
    pub max_ratio: f64,
    pub pass: bool,
    pub rows: Vec<VerifyRow>,
    /// Only outputs and final state were compared (`--forward-only`).
    pub forward_only: bool,
    /// The candidate's intermediates against the oracle's.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub intermediates: Vec<IntermediateRow>,
    /// Outputs and gradients the case should have but stores no truth for
    /// (nothing checked them).
    pub unchecked: Vec<String>,
    /// Whether unchecked tensors were accepted (`--allow-partial`).
    pub allow_partial: bool,
    /// With `verify --band P`: each tensor judged against its noise band
    /// (then a row passes by its band, not by `max_ratio`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub band: Option<BandJudgement>,
}

/// The band and the verdicts of `verify --band`.
#[derive(Clone, Debug, Serialize)]
pub struct BandJudgement {
    pub band: Band,
    pub verdicts: Vec<Verdict>,
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (i, &n) in idx.iter_mut().zip(shape).rev() {
        *i = flat % n.max(1);
        flat /= n.max(1);
    }
    idx
}

fn row(name: &str, r: &ArrayD<f64>, c: Option<&ArrayD<f64>>, max_ratio: f64) -> VerifyRow {
    match c {
        None => VerifyRow::problem(name, r.shape(), "missing from the candidate".into()),
        Some(c) if c.shape() != r.shape() => {
            VerifyRow::problem(name, r.shape(), format!("candidate shape {:?}", c.shape()))
        }
        Some(c) => {
            let mut acc = Accum::default();
            acc.add(r.iter().copied().zip(c.iter().copied()), |i| i);
            VerifyRow::from_accum(name, r.shape(), &acc, max_ratio)
        }
    }
}

impl VerifyRow {
    /// A failed row without numbers (missing tensor, shape mismatch).
    pub fn problem(name: &str, shape: &[usize], problem: String) -> VerifyRow {
        VerifyRow {
            tensor: name.to_string(),
            shape: shape.to_vec(),
            norm_ratio: None,
            max_abs: None,
            argmax: None,
            pass: false,
            problem: Some(problem),
            per_head: vec![],
        }
    }

    /// The row of a tensor of `shape` whose pieces all went into `acc`.
    pub fn from_accum(name: &str, shape: &[usize], acc: &Accum, max_ratio: f64) -> VerifyRow {
        let cmp = acc.comparison(max_ratio);
        VerifyRow {
            tensor: name.to_string(),
            shape: shape.to_vec(),
            norm_ratio: Some(cmp.norm_ratio),
            max_abs: Some(cmp.max_abs),
            argmax: Some(unravel(cmp.argmax, shape)),
            pass: cmp.pass,
            // JSON has no NaN or Inf (serde writes null): say it in words.
            problem: acc
                .non_finite
                .then(|| "non-finite values in the candidate".to_string()),
            per_head: vec![],
        }
    }

    /// `worst head 3 (norm_ratio 1.9e0), 2 of 4 heads fail: [3.0e-8, …]`:
    /// the row's heads at `max_ratio`; `None` without per-head errors.
    pub fn heads_line(&self, max_ratio: f64) -> Option<String> {
        // A NaN head (a non-finite candidate) is the worst, whatever its sign bit.
        let (worst, w) = self.per_head.iter().copied().enumerate().max_by(|a, b| {
            (a.1.is_nan(), a.1)
                .partial_cmp(&(b.1.is_nan(), b.1))
                .unwrap_or(std::cmp::Ordering::Equal)
        })?;
        let failing = self
            .per_head
            .iter()
            .filter(|x| x.is_nan() || **x >= max_ratio)
            .count();
        let all: Vec<String> = self.per_head.iter().map(|x| format!("{x:.1e}")).collect();
        Some(format!(
            "worst head {worst} (norm_ratio {w:.3e}), {failing} of {} heads above {max_ratio:.1e}: [{}]",
            self.per_head.len(),
            all.join(", ")
        ))
    }
}

/// norm_ratio per index of axis `axis` of `truth` against `got` (same shape).
pub fn per_head(axis: usize, truth: &ArrayD<f64>, got: &ArrayD<f64>) -> Vec<f64> {
    let ax = ndarray::Axis(axis);
    truth
        .axis_iter(ax)
        .zip(got.axis_iter(ax))
        .map(|(t, g)| {
            let mut acc = Accum::default();
            acc.add(t.iter().copied().zip(g.iter().copied()), |i| i);
            acc.norm_ratio()
        })
        .collect()
}

impl VerifyReport {
    /// One row per expected tensor.
    pub fn new(
        case: &str,
        reference: &str,
        candidate: &str,
        expected: &Tensors,
        got: &Tensors,
        max_ratio: f64,
    ) -> Self {
        let rows: Vec<VerifyRow> = expected
            .iter()
            .map(|(n, r)| row(n, r, got.get(n), max_ratio))
            .collect();
        VerifyReport::from_rows(case, reference, candidate, rows, max_ratio)
    }

    /// A report over rows already compared (a long case, head block by head block).
    pub fn from_rows(
        case: &str,
        reference: &str,
        candidate: &str,
        rows: Vec<VerifyRow>,
        max_ratio: f64,
    ) -> Self {
        VerifyReport {
            case: case.to_string(),
            reference: reference.to_string(),
            candidate: candidate.to_string(),
            max_ratio,
            pass: !rows.is_empty() && rows.iter().all(|r| r.pass),
            rows,
            unchecked: vec![],
            allow_partial: false,
            forward_only: false,
            intermediates: vec![],
            band: None,
        }
    }

    /// Fills each row's per-head errors: tensors of `op` with a head axis
    /// (`H`, `HV`; [`deltaref::registry::OpInfo::head_axis`]) compared head
    /// by head, `expected` against `got`, where both are there with one
    /// shape. A non-finite candidate is compared too: its NaN heads say
    /// where it overflowed (a head-stride bug breaks some heads only).
    pub fn with_heads(mut self, op: crate::case::Op, expected: &Tensors, got: &Tensors) -> Self {
        let info = op.info();
        for r in self.rows.iter_mut() {
            let (Some(t), Some(g)) = (expected.get(&r.tensor), got.get(&r.tensor)) else {
                continue;
            };
            let axis = info
                .axes_of(&r.tensor)
                .and_then(|a| a.split(',').position(|x| x == "H" || x == "HV"));
            if let Some(a) = axis.filter(|&a| a < t.ndim() && t.shape() == g.shape()) {
                r.per_head = per_head(a, t, g);
            }
        }
        self
    }

    /// Judges the rows by `verdicts` (against `band`) instead of
    /// `max_ratio`: a row with a verdict passes when its verdict does (a
    /// row without one, or with a problem, keeps its result); the report
    /// passes when every row does.
    pub fn with_band(mut self, band: Band, verdicts: Vec<Verdict>) -> Self {
        for r in self.rows.iter_mut().filter(|r| r.problem.is_none()) {
            if let Some(v) = verdicts.iter().find(|v| v.tensor == r.tensor) {
                r.pass = v.pass;
            }
        }
        self.pass = !self.rows.is_empty()
            && self.rows.iter().all(|r| r.pass)
            && self.intermediates.iter().all(|r| r.pass)
            && (self.unchecked.is_empty() || self.allow_partial);
        self.band = Some(BandJudgement { band, verdicts });
        self
    }

    /// Marks the report as covering outputs and final state only.
    pub fn forward_only(self) -> Self {
        VerifyReport {
            forward_only: true,
            ..self
        }
    }

    /// Adds the intermediates' rows; the report passes only if they do too.
    pub fn with_intermediates(self, rows: Vec<IntermediateRow>) -> Self {
        VerifyReport {
            pass: self.pass && rows.iter().all(|r| r.pass),
            intermediates: rows,
            ..self
        }
    }

    /// Records the tensors left unchecked (a case with partial truth): the
    /// report fails unless `allow_partial`.
    pub fn with_unchecked(mut self, unchecked: Vec<String>, allow_partial: bool) -> Self {
        self.pass &= unchecked.is_empty() || allow_partial;
        self.unchecked = unchecked;
        self.allow_partial = allow_partial;
        self
    }

    /// Rows that fail for a reason other than their numbers (missing,
    /// misshapen or non-finite candidate tensors), in words.
    pub fn problems(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .rows
            .iter()
            .filter_map(|r| r.problem.as_ref().map(|p| format!("`{}`: {p}", r.tensor)))
            .collect();
        if self.rows.is_empty() {
            v.push("nothing to compare (no expected tensors)".into());
        }
        if !self.unchecked.is_empty() && !self.allow_partial {
            v.push(self.unchecked_line());
        }
        v
    }

    fn unchecked_line(&self) -> String {
        format!(
            "unchecked (no stored truth, or missing from the candidate under --allow-partial): {}{}",
            self.unchecked.join(", "),
            if self.allow_partial {
                " (accepted: --allow-partial)"
            } else {
                "; store the full truth or pass --allow-partial"
            }
        )
    }
}

/// A table cell for an optional number.
fn num(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |v| format!("{v:.3e}"))
}

/// A row's result: `pass`, `FAIL`, or `FAIL (why)` when it could not be compared.
fn verdict(problem: &Option<String>, pass: bool) -> String {
    match (problem, pass) {
        (Some(p), _) => format!("FAIL ({p})"),
        (None, true) => "pass".into(),
        (None, false) => "FAIL".into(),
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // With a band the rows pass by it; the max ratio only judges intermediates.
        let judged_by = match &self.band {
            Some(b) => format!("judged by the band of `{}`", b.band.precision),
            None => format!("max ratio {:.1e}", self.max_ratio),
        };
        writeln!(
            f,
            "case {}: {} against {} ({judged_by})",
            self.case, self.candidate, self.reference
        )?;
        writeln!(
            f,
            "{:<13} {:<20} {:>11} {:>11}  {:<20} result",
            "tensor", "shape", "norm_ratio", "max_abs", "argmax"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<13} {:<20} {:>11} {:>11}  {:<20} {}",
                r.tensor,
                format!("{:?}", r.shape),
                num(r.norm_ratio),
                num(r.max_abs),
                r.argmax.as_ref().map_or("-".into(), |a| format!("{a:?}")),
                verdict(&r.problem, r.pass)
            )?;
        }
        // Per head for the failing rows: a wrong head mapping or a bug on
        // heads > 0 fails some heads only.
        for r in self.rows.iter().filter(|r| !r.pass && r.per_head.len() > 1) {
            if let Some(line) = r.heads_line(self.max_ratio) {
                writeln!(f, "  {} per head: {line}", r.tensor)?;
            }
        }
        if !self.unchecked.is_empty() {
            writeln!(f, "{}", self.unchecked_line())?;
        }
        if self.forward_only {
            writeln!(
                f,
                "forward only: outputs and final state compared, gradients not checked"
            )?;
        }
        if !self.intermediates.is_empty() {
            writeln!(
                f,
                "intermediates (first chunk/rank whose error leaves {:.1e}):",
                self.max_ratio
            )?;
            for r in &self.intermediates {
                writeln!(
                    f,
                    "{:<21} {:<20} {:>11} {:>11}  {:<44} {}",
                    r.tensor,
                    format!("{:?}", r.shape),
                    num(r.norm_ratio),
                    num(r.max_abs),
                    r.first_bad.as_deref().unwrap_or("-"),
                    verdict(&r.problem, r.pass)
                )?;
            }
        }
        if let Some(b) = &self.band {
            writeln!(
                f,
                "against the band of `{}` ({} samples, {}): rows pass by the band, not by the max ratio",
                b.band.precision, b.band.spec.samples, b.band.implementation
            )?;
            writeln!(f, "{}", verdict_table(&b.verdicts))?;
        }
        let failed = self.rows.iter().filter(|r| !r.pass).count()
            + self.intermediates.iter().filter(|r| !r.pass).count();
        let total = self.rows.len() + self.intermediates.len();
        write!(f, "{} of {} tensors pass", total - failed, total)
    }
}

/// How a report names an implementation's run: `impl:NAME`, the precision
/// preset and the scalar it computed in, so that every report header says
/// what produced its numbers.
pub fn impl_label(name: &str, precision: Option<&str>, compute: crate::impls::Compute) -> String {
    format!(
        "impl:{name} [precision {}, compute {compute}]",
        precision.unwrap_or("exact")
    )
}

#[cfg(test)]
mod head_tests {
    use super::*;
    use crate::case::Op;

    /// A candidate wrong on value head 1 only: the row lists both heads'
    /// errors and the table names head 1 as the worst, 1 of 2 failing.
    #[test]
    fn a_wrong_head_shows_in_the_per_head_errors() {
        let truth = ArrayD::from_shape_fn(ndarray::IxDyn(&[1, 3, 2, 2]), |i| {
            1.0 + (i[1] + i[3]) as f64
        });
        let mut got = truth.clone();
        got.index_axis_mut(ndarray::Axis(2), 1).mapv_inplace(|x| -x);
        let expected = Tensors::from([("o".to_string(), truth)]);
        let got = Tensors::from([("o".to_string(), got)]);
        let r = VerifyReport::new("c", "ref", "cand", &expected, &got, 1e-4).with_heads(
            Op::parse("kda").unwrap(),
            &expected,
            &got,
        );
        assert_eq!(r.rows[0].per_head.len(), 2);
        assert_eq!(r.rows[0].per_head[0], 0.0);
        assert!(r.rows[0].per_head[1] > 1.0);
        let text = r.to_string();
        assert!(
            text.contains("o per head: worst head 1") && text.contains("1 of 2 heads above"),
            "{text}"
        );
    }
}
