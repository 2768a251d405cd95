//! FLA's error metrics (SPEC §7), computed in f64 whatever the input dtype.

use serde::Serialize;

/// FLA `get_err_ratio`: `rms(ref − x) / (rms(ref) + 1e-8)`.
/// NaN anywhere gives NaN (a failure under every threshold).
pub fn norm_ratio(reference: &[f64], x: &[f64]) -> f64 {
    assert_eq!(reference.len(), x.len(), "norm_ratio: lengths differ");
    if reference.is_empty() {
        return 0.0;
    }
    let n = reference.len() as f64;
    let err: f64 = reference
        .iter()
        .zip(x)
        .map(|(r, v)| (r - v) * (r - v))
        .sum::<f64>()
        / n;
    let base: f64 = reference.iter().map(|r| r * r).sum::<f64>() / n;
    err.sqrt() / (base.sqrt() + 1e-8)
}

/// `max |ref − x|` and its flat index; NaN wins (reported as NaN at its index).
pub fn max_abs(reference: &[f64], x: &[f64]) -> (f64, usize) {
    assert_eq!(reference.len(), x.len(), "max_abs: lengths differ");
    let mut best = (0.0f64, 0usize);
    for (i, (r, v)) in reference.iter().zip(x).enumerate() {
        let d = (r - v).abs();
        if d.is_nan() {
            return (f64::NAN, i);
        }
        if d > best.0 {
            best = (d, i);
        }
    }
    best
}

/// The comparison of one tensor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Comparison {
    pub norm_ratio: f64,
    pub max_abs: f64,
    /// Flat (row-major) index of the largest difference.
    pub argmax: usize,
    pub pass: bool,
}

/// FLA `assert_close` semantics: pass when `max_abs ≤ 1e-6`, else when
/// `norm_ratio < ratio`; NaN never passes.
pub fn compare(reference: &[f64], x: &[f64], ratio: f64) -> Comparison {
    let nr = norm_ratio(reference, x);
    let (ma, argmax) = max_abs(reference, x);
    let pass = !nr.is_nan() && !ma.is_nan() && (ma <= 1e-6 || nr < ratio);
    Comparison {
        norm_ratio: nr,
        max_abs: ma,
        argmax,
        pass,
    }
}

/// FLA's `assert_close(prefix, ref, tri, ratio)` as a `Result`: the error
/// message names the tensor and gives both figures.
pub fn assert_close(
    name: &str,
    reference: &[f64],
    x: &[f64],
    ratio: f64,
) -> Result<Comparison, String> {
    let c = compare(reference, x, ratio);
    if c.pass {
        Ok(c)
    } else {
        Err(format!(
            "{name}: norm_ratio {:.3e} ≥ {ratio:.1e} and max_abs {:.3e} > 1e-6 (at flat index {})",
            c.norm_ratio, c.max_abs, c.argmax
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_ratio_matches_hand_computation() {
        // ref = [3, 4]: rms = sqrt(12.5); diff = [0.3, 0]: rms = sqrt(0.045)
        let r = norm_ratio(&[3.0, 4.0], &[2.7, 4.0]);
        let expected = (0.09f64 / 2.0).sqrt() / ((25.0f64 / 2.0).sqrt() + 1e-8);
        assert!((r - expected).abs() < 1e-15);
    }

    #[test]
    fn nan_is_never_a_pass() {
        let c = compare(&[1.0, 2.0], &[1.0, f64::NAN], 1.0);
        assert!(!c.pass);
        assert!(c.max_abs.is_nan());
        assert_eq!(c.argmax, 1);
        let c = compare(&[f64::NAN, 2.0], &[1.0, 2.0], 1.0);
        assert!(!c.pass);
    }

    #[test]
    fn assert_close_names_the_tensor() {
        assert!(assert_close("o", &[1.0, 2.0], &[1.0, 2.0], 1e-3).is_ok());
        let e = assert_close("dq", &[1.0, 2.0], &[1.5, 2.0], 1e-3).unwrap_err();
        assert!(e.starts_with("dq: norm_ratio"), "{e}");
        assert!(assert_close("dk", &[1.0], &[f64::NAN], 1.0).is_err());
    }

    #[test]
    fn tiny_absolute_error_passes_regardless_of_ratio() {
        let c = compare(&[0.0, 0.0], &[1e-7, 0.0], 1e-12);
        assert!(c.pass);
        let c = compare(&[1.0, 1.0], &[1.1, 1.0], 5e-3);
        assert!(!c.pass);
        assert_eq!(c.argmax, 0);
    }
}
