//! FLA's error metrics (SPEC §7), computed in f64 whatever the input dtype.

use serde::Serialize;

/// FLA `get_err_ratio`: `rms(ref − x) / (rms(ref) + 1e-8)`.
/// NaN anywhere gives NaN (a failure under every threshold).
pub fn norm_ratio(reference: &[f64], x: &[f64]) -> f64 {
    assert_eq!(reference.len(), x.len(), "norm_ratio: lengths differ");
    let mut a = Accum::default();
    a.add(reference.iter().copied().zip(x.iter().copied()), |i| i);
    a.norm_ratio()
}

/// `max |ref − x|` and its flat index; NaN wins (reported as NaN at its index).
pub fn max_abs(reference: &[f64], x: &[f64]) -> (f64, usize) {
    assert_eq!(reference.len(), x.len(), "max_abs: lengths differ");
    let mut a = Accum::default();
    a.add(reference.iter().copied().zip(x.iter().copied()), |i| i);
    (a.max_abs, a.argmax)
}

/// FLA's metrics accumulated over pieces of one tensor (a long case is
/// compared head block by head block, never whole): sums of squares, the
/// largest difference and its flat index in the whole tensor. Fed one piece
/// in flat order it gives the bits of a whole-tensor pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Accum {
    n: usize,
    err: f64,
    base: f64,
    pub max_abs: f64,
    /// Flat index (in the whole tensor) of `max_abs`: the smallest on ties.
    pub argmax: usize,
    /// Whether the candidate side held a NaN or an infinity.
    pub non_finite: bool,
}

impl Default for Accum {
    fn default() -> Self {
        // -0.0 is the start of Rust's `f64` sum: the same bits as `.sum()`.
        Accum {
            n: 0,
            err: -0.0,
            base: -0.0,
            max_abs: 0.0,
            argmax: 0,
            non_finite: false,
        }
    }
}

impl Accum {
    /// Adds `(ref, x)` pairs; `full(i)` maps the piece's `i`-th pair to its
    /// flat index in the whole tensor (increasing with `i`).
    pub fn add(&mut self, pairs: impl Iterator<Item = (f64, f64)>, full: impl Fn(usize) -> usize) {
        for (i, (r, v)) in pairs.enumerate() {
            let d = (r - v).abs();
            self.n += 1;
            self.err += (r - v) * (r - v);
            self.base += r * r;
            self.non_finite |= !v.is_finite();
            if self.max_abs.is_nan() {
                if d.is_nan() && full(i) < self.argmax {
                    self.argmax = full(i);
                }
                continue;
            }
            let j = full(i);
            if d.is_nan() || d > self.max_abs || (d == self.max_abs && d > 0.0 && j < self.argmax) {
                self.max_abs = d;
                self.argmax = j;
            }
        }
    }

    pub fn norm_ratio(&self) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let n = self.n as f64;
        (self.err / n).sqrt() / ((self.base / n).sqrt() + 1e-8)
    }

    /// FLA `assert_close`'s verdict on everything added.
    pub fn comparison(&self, ratio: f64) -> Comparison {
        let nr = self.norm_ratio();
        let ma = self.max_abs;
        Comparison {
            norm_ratio: nr,
            max_abs: ma,
            argmax: self.argmax,
            pass: !nr.is_nan() && !ma.is_nan() && (ma <= 1e-6 || nr < ratio),
        }
    }
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
    assert_eq!(reference.len(), x.len(), "compare: lengths differ");
    let mut a = Accum::default();
    a.add(reference.iter().copied().zip(x.iter().copied()), |i| i);
    a.comparison(ratio)
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

/// [`assert_close`] for row-major tensors of `shape`: the message gives
/// the largest error's multi-dimensional index (`[b, t, h, k]`), which a
/// user can index their tensor with, instead of the flat one.
pub fn assert_close_shaped(
    name: &str,
    reference: &[f64],
    x: &[f64],
    shape: &[usize],
    ratio: f64,
) -> Result<Comparison, String> {
    let c = compare(reference, x, ratio);
    if c.pass {
        return Ok(c);
    }
    let mut idx = vec![0; shape.len()];
    let mut i = c.argmax;
    for (d, &n) in shape.iter().enumerate().rev() {
        idx[d] = i % n.max(1);
        i /= n.max(1);
    }
    Err(format!(
        "{name}: norm_ratio {:.3e} ≥ {ratio:.1e} and max_abs {:.3e} > 1e-6 (at index {idx:?})",
        c.norm_ratio, c.max_abs
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The failure message names the largest error by its index in the
    /// tensor's shape: element `[1, 2, 0]` of a `[2, 3, 2]` tensor is flat 10.
    #[test]
    fn assert_close_shaped_names_a_multi_dimensional_index() {
        let r: Vec<f64> = (0..12).map(|i| 1.0 + i as f64).collect();
        let mut x = r.clone();
        x[10] += 5.0;
        let e = assert_close_shaped("o", &r, &x, &[2, 3, 2], 5e-3).unwrap_err();
        assert!(e.contains("at index [1, 2, 0]"), "{e}");
        assert!(assert_close_shaped("o", &r, &r, &[2, 3, 2], 5e-3).is_ok());
    }

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

    #[test]
    fn pieces_in_any_order_give_the_whole_tensors_verdict() {
        let r = [1.0, -2.0, 3.0, 0.5, 4.0, -1.0];
        let x = [1.5, -2.0, 2.5, 0.5, 4.0, f64::NAN];
        let whole = compare(&r[..5], &x[..5], 1e-3);
        // Rows 3.. then rows ..3 of a [2, 3] tensor: ties (0.5 at 0 and 2) keep the first index.
        let mut a = Accum::default();
        a.add(r[3..5].iter().copied().zip(x[3..5].iter().copied()), |i| {
            3 + i
        });
        a.add(r[..3].iter().copied().zip(x[..3].iter().copied()), |i| i);
        let c = a.comparison(1e-3);
        assert_eq!((c.max_abs, c.argmax, c.pass), (0.5, 0, false));
        assert!((c.norm_ratio - whole.norm_ratio).abs() < 1e-15);
        assert!(!a.non_finite);
        let mut a = Accum::default();
        a.add(r[5..].iter().copied().zip(x[5..].iter().copied()), |i| {
            5 + i
        });
        a.add(r[..5].iter().copied().zip(x[..5].iter().copied()), |i| i);
        assert!(a.max_abs.is_nan() && a.argmax == 5 && a.non_finite);
    }
}
