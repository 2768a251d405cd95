//! Checks that do not refuse a case but catch a silent mistake: inputs
//! outside their domain (a log-decay gate given in linear space), and a
//! candidate computed from other inputs than the case's.

use ndarray::ArrayD;
use serde_json::Value;

use super::{Case, CaseError, Dtype};

/// The inputs of a case that are log-decays (≤ 0: `exp(g) ≤ 1`), given
/// the case's options: KDA's and GDN's `g` without an in-kernel gate (with
/// one, `g` is a pre-activation of any sign), GDN-2's likewise, DPLR's `gk`.
fn log_decays(case: &Case) -> Vec<&'static str> {
    let opt = &case.meta.options;
    let no_gate = |key: &str| match opt.get(key) {
        None => true,
        Some(Value::String(s)) => s == "none",
        Some(Value::Bool(b)) => !b,
        Some(_) => false,
    };
    match case.meta.op.name() {
        "kda" if no_gate("gate") => vec!["g"],
        "gdn" | "gdn2" if no_gate("use_gate_in_kernel") => vec!["g"],
        "dplr" => vec!["gk"],
        _ => vec![],
    }
}

impl Case {
    /// One sentence per input outside its domain: a log-decay with
    /// positive entries (a gate given in linear space, a decay in (0, 1],
    /// instead of its log) names the tensor, how many entries of how many
    /// are positive and the largest. Empty when every input is in domain.
    pub fn domain_warnings(&self) -> Vec<String> {
        log_decays(self)
            .into_iter()
            .filter_map(|name| {
                let g = self.tensors.get(name)?;
                let positive = g.iter().filter(|&&x| x > 0.0).count();
                (positive > 0).then(|| {
                    let max = g.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    format!(
                        "`{name}` is a log-decay (≤ 0, the state decays by exp({name})) but \
                         {positive} of {} entries are positive (max {max:.3e}): a gate given in \
                         linear space (a decay in (0, 1]) must be passed as its log, else the \
                         state grows without bound",
                        g.len()
                    )
                })
            })
            .collect()
    }

    /// Refuses a candidate whose inputs (or `cu_seqlens`) are not the
    /// case's: a port run on another seed or another packing is compared
    /// with the wrong truth. Every input and upstream gradient the
    /// candidate carries is compared with the case's, allowing the
    /// rounding of the coarser of the two stored dtypes; the error names
    /// the tensor, the largest difference and where. `what` names the
    /// candidate file.
    pub fn check_candidate_inputs(&self, cand: &Case, what: &str) -> Result<(), CaseError> {
        let err = |tensor: &str, why: String| CaseError::Tensor {
            path: what.to_string(),
            tensor: tensor.to_string(),
            why,
        };
        if let Some(c) = &cand.cu_seqlens {
            if self.cu_seqlens.as_ref() != Some(c) {
                return Err(err(
                    "cu_seqlens",
                    format!(
                        "the candidate's cu_seqlens {c:?} differ from the case's {:?}: it was \
                         computed on another packing of the sequences",
                        self.cu_seqlens
                    ),
                ));
            }
        }
        let op = self.meta.op;
        let names = op.inputs().iter().chain(op.upstream().iter());
        for &name in names {
            let (Some(a), Some(c)) = (self.tensors.get(name), cand.tensors.get(name)) else {
                continue;
            };
            if a.shape() != c.shape() {
                return Err(err(
                    name,
                    format!(
                        "input shape {:?} differs from the case's {:?}: the candidate was \
                         computed from other inputs",
                        c.shape(),
                        a.shape()
                    ),
                ));
            }
            let dt = coarser(self.dtypes.get(name), cand.dtypes.get(name));
            if let Some((i, d)) = first_mismatch(a, c, dt) {
                return Err(err(
                    name,
                    format!(
                        "the candidate's input differs from the case's by up to {d:.3e} (first \
                         at index {:?}, beyond {} rounding): it was computed from other inputs \
                         (another seed or case); run the port on this case's inputs",
                        unravel(i, a.shape()),
                        dt.name()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The multi-dimensional index of flat (row-major) index `i` in `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        idx[d] = i % n.max(1);
        i /= n.max(1);
    }
    idx
}

/// The coarser of two stored dtypes (f64 when neither is known).
fn coarser(a: Option<&Dtype>, b: Option<&Dtype>) -> Dtype {
    let bits = |d: Dtype| match d {
        Dtype::F64 => 52,
        Dtype::F32 => 23,
        Dtype::Tf32 | Dtype::F16 => 10,
        Dtype::Bf16 => 7,
        Dtype::E5m2 => 2,
    };
    [a, b]
        .into_iter()
        .flatten()
        .copied()
        .min_by_key(|&d| bits(d))
        .unwrap_or(Dtype::F64)
}

/// `(flat index of the first entry differing by more than one unit in the
/// last place of `dt`, the largest such difference)`, or None.
fn first_mismatch(a: &ArrayD<f64>, c: &ArrayD<f64>, dt: Dtype) -> Option<(usize, f64)> {
    // One ulp of `dt` relative to the value, and an absolute floor for
    // values near zero (f16's subnormals are the coarsest).
    let rel = match dt {
        Dtype::F64 => 0.0,
        Dtype::F32 => 2f64.powi(-23),
        Dtype::Tf32 | Dtype::F16 => 2f64.powi(-10),
        Dtype::Bf16 => 2f64.powi(-7),
        Dtype::E5m2 => 0.25,
    };
    let floor = if dt == Dtype::F64 { 0.0 } else { 6.0e-8 };
    let mut first = None;
    let mut worst = 0.0f64;
    for (i, (&x, &y)) in a.iter().zip(c.iter()).enumerate() {
        let d = (x - y).abs();
        let bad = d > rel * x.abs().max(y.abs()) + floor || (x.is_nan() != y.is_nan());
        if bad {
            first.get_or_insert(i);
            worst = worst.max(d);
        }
    }
    first.map(|i| (i, worst))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::Op;
    use crate::generate::{generate, GenSpec};

    fn kda(seed: u64) -> Case {
        let mut spec = GenSpec::new(Op::Kda);
        spec.shape = Some(vec![1, 16, 1, 1, 4, 4]);
        spec.seed = seed;
        generate(&spec).unwrap()
    }

    #[test]
    fn a_gate_in_linear_space_is_named_with_its_count() {
        let mut case = kda(0);
        assert!(
            case.domain_warnings().is_empty(),
            "FLA's draws are log-decays"
        );
        let g = case.tensors["g"].mapv(f64::exp);
        let n = g.len();
        case.tensors.insert("g".into(), g);
        let w = case.domain_warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("`g`") && w[0].contains(&format!("{n} of {n}")),
            "{w:?}"
        );
    }

    #[test]
    fn a_candidate_from_other_inputs_is_refused_naming_the_tensor() {
        let case = kda(0);
        assert!(case.check_candidate_inputs(&case, "c").is_ok());
        // The same inputs stored in bf16 are the case's, rounded.
        let mut bf = Case::new(case.meta.clone());
        for (n, t) in &case.tensors {
            bf.insert(n, t.clone(), Dtype::Bf16);
        }
        assert!(case.check_candidate_inputs(&bf, "c").is_ok());
        let e = case
            .check_candidate_inputs(&kda(1), "c")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("other inputs") && e.contains("differs from the case's by up to"),
            "{e}"
        );
        let mut other = case.clone();
        other.cu_seqlens = Some(vec![0, 5, 16]);
        let e = case
            .check_candidate_inputs(&other, "c")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cu_seqlens"), "{e}");
    }
}
