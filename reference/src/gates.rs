//! Element-wise pre-processing FLA fuses into its kernels, with their
//! derivatives: l2 normalisation of q/k, the KDA gates and the beta sigmoid.
//! Every formula of SPEC §3 "Options" lives here once.

use ndarray::{Array4, ArrayBase, Axis, Data, Ix4, Zip};

use crate::scalar::Scalar;

/// FLA's l2norm epsilon: `x / sqrt(Σx² + 1e-6)`.
pub const L2NORM_EPS: f64 = 1e-6;

pub(crate) fn sigmoid<T: Scalar>(x: T) -> T {
    // Split by sign so neither branch overflows.
    if x >= T::zero() {
        T::one() / (T::one() + (-x).exp())
    } else {
        let e = x.exp();
        e / (T::one() + e)
    }
}

/// `log(1 + e^x)` without overflow (exact; FLA's thresholded softplus differs
/// from it by < 2e-9 only for x > 20).
pub(crate) fn softplus<T: Scalar>(x: T) -> T {
    if x > T::zero() {
        x + (-x).exp().ln_1p()
    } else {
        x.exp().ln_1p()
    }
}

/// Normalises the last axis of `[B, T, H, D]`: `y = x / sqrt(Σx² + eps)`.
pub(crate) fn l2norm_fwd<T: Scalar, S: Data<Elem = T>>(x: &ArrayBase<S, Ix4>) -> Array4<T> {
    l2norm_owned(x.to_owned())
}

/// [`l2norm_fwd`] of `x`, normalised in its own buffer (the same values,
/// without a second tensor of its size).
pub(crate) fn l2norm_owned<T: Scalar>(mut x: Array4<T>) -> Array4<T> {
    for mut row in x.lanes_mut(Axis(3)) {
        let r = rstd(row.iter().copied());
        row.mapv_inplace(|v| v * r);
    }
    x
}

/// Gradient through `l2norm_fwd`: `dx = r (dy − y (y·dy))`, given the raw `x`.
pub(crate) fn l2norm_bwd<T: Scalar, S: Data<Elem = T>>(
    x: &ArrayBase<S, Ix4>,
    dy: &Array4<T>,
) -> Array4<T> {
    let mut dx = dy.clone();
    Zip::from(dx.lanes_mut(Axis(3)))
        .and(x.lanes(Axis(3)))
        .for_each(|mut d, xr| {
            let r = rstd(xr.iter().copied());
            let ydy: T = xr.iter().zip(d.iter()).map(|(&a, &b)| a * r * b).sum();
            Zip::from(&mut d)
                .and(&xr)
                .for_each(|dv, &xv| *dv = r * (*dv - xv * r * ydy));
        });
    dx
}

fn rstd<T: Scalar>(x: impl Iterator<Item = T>) -> T {
    let ss: T = x.map(|v| v * v).sum();
    T::one() / (ss + T::c(L2NORM_EPS)).sqrt()
}

/// How the log-space decay `g` is obtained from the `g` tensor passed in
/// (FLA `use_gate_in_kernel`, `lower_bound`).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Gate {
    /// `g` is already the log-space decay (`use_gate_in_kernel=False`).
    #[default]
    None,
    /// `g = −exp(A_log) · softplus(g + dt_bias)`; `A_log` required.
    Kda,
    /// `g = lower_bound · sigmoid(exp(A_log) · (g + dt_bias))` (FLA `safe_gate`);
    /// without `A_log`: `lower_bound · sigmoid(g + dt_bias)`.
    LowerBound { lower_bound: f64 },
}

impl Gate {
    /// The case-file name (`"none"`, `"kda"`, `"lowerbound"`).
    pub fn name(&self) -> &'static str {
        match self {
            Gate::None => "none",
            Gate::Kda => "kda",
            Gate::LowerBound { .. } => "lowerbound",
        }
    }

    /// One element of the gate: `x = g_raw + dt_bias`, `a_log` the head's `A_log`.
    /// Returns the decay and the partial derivatives `(∂g/∂x, ∂g/∂A_log)`.
    pub fn eval<T: Scalar>(self, x: T, a_log: Option<T>) -> (T, T, T) {
        match self {
            Gate::None => (x, T::one(), T::zero()),
            Gate::Kda => {
                let a = a_log.expect("validated: kda gate needs A_log").exp();
                let g = -a * softplus(x);
                (g, -a * sigmoid(x), g)
            }
            Gate::LowerBound { lower_bound } => {
                let lb = T::c(lower_bound);
                let (z, dz_dx) = match a_log {
                    Some(al) => (al.exp() * x, al.exp()),
                    None => (x, T::one()),
                };
                let s = sigmoid(z);
                let dg_dz = lb * s * (T::one() - s);
                let dg_da = if a_log.is_some() {
                    dg_dz * z
                } else {
                    T::zero()
                };
                (lb * s, dg_dz * dz_dx, dg_da)
            }
        }
    }
}

/// [`Gate::eval`] over a run of elements of one head, `x[i] = g_raw + dt_bias`
/// and `a_log` the head's `A_log`: writes the decay into `g` and, with
/// `derivatives`, `(∂g/∂x, ∂g/∂A_log)` into them. The same bits as
/// `Gate::eval` element by element: `exp(A_log)` is taken once, and the
/// run's other exponentials together ([`Scalar::exp_into`], glibc's bits on
/// vectors in `f64`; call it under [`crate::fast::simd::dispatch`]).
#[inline(always)]
pub(crate) fn gate_eval_run<T: Scalar>(
    gate: Gate,
    x: &[T],
    a_log: Option<T>,
    g: &mut [T],
    derivatives: Option<(&mut [T], &mut [T])>,
) {
    const RUN: usize = 64;
    let (mut m, mut e) = ([T::zero(); RUN], [T::zero(); RUN]);
    let mut derivatives = derivatives;
    for (at, x) in (0..x.len()).step_by(RUN).zip(x.chunks(RUN)) {
        let n = x.len();
        let g = &mut g[at..at + n];
        let mut d = derivatives
            .as_mut()
            .map(|(dx, da)| (&mut dx[at..at + n], &mut da[at..at + n]));
        match gate {
            Gate::None => {
                g.copy_from_slice(x);
                if let Some((dx, da)) = d {
                    dx.fill(T::one());
                    da.fill(T::zero());
                }
            }
            Gate::Kda => {
                let a = a_log.expect("validated: kda gate needs A_log").exp();
                // softplus and sigmoid both take exp(−|x|) (at 0, e^0 = e^−0).
                for (m, &x) in m.iter_mut().zip(x) {
                    *m = if x > T::zero() { -x } else { x };
                }
                T::exp_into(&m[..n], &mut e[..n]);
                for (i, (&x, &e)) in x.iter().zip(&e[..n]).enumerate() {
                    let softplus = if x > T::zero() {
                        x + e.ln_1p()
                    } else {
                        e.ln_1p()
                    };
                    g[i] = -a * softplus;
                    if let Some((dx, da)) = d.as_mut() {
                        let sigmoid = if x >= T::zero() {
                            T::one() / (T::one() + e)
                        } else {
                            e / (T::one() + e)
                        };
                        (dx[i], da[i]) = (-a * sigmoid, g[i]);
                    }
                }
            }
            Gate::LowerBound { lower_bound } => {
                let lb = T::c(lower_bound);
                let ea = a_log.map(|al| al.exp());
                for (m, &x) in m.iter_mut().zip(x) {
                    let z = ea.map_or(x, |ea| ea * x);
                    *m = if z >= T::zero() { -z } else { z };
                }
                T::exp_into(&m[..n], &mut e[..n]);
                for (i, (&x, &e)) in x.iter().zip(&e[..n]).enumerate() {
                    let z = ea.map_or(x, |ea| ea * x);
                    let s = if z >= T::zero() {
                        T::one() / (T::one() + e)
                    } else {
                        e / (T::one() + e)
                    };
                    g[i] = lb * s;
                    if let Some((dx, da)) = d.as_mut() {
                        let dg_dz = lb * s * (T::one() - s);
                        dx[i] = dg_dz * ea.unwrap_or(T::one());
                        da[i] = if ea.is_some() { dg_dz * z } else { T::zero() };
                    }
                }
            }
        }
    }
}

/// `β = scale · sigmoid(b)` with scale 2 under `allow_neg_eigval`; returns `(β, ∂β/∂b)`.
pub(crate) fn beta_sigmoid<T: Scalar>(b: T, allow_neg_eigval: bool) -> (T, T) {
    let c = if allow_neg_eigval {
        T::c(2.0)
    } else {
        T::one()
    };
    let s = sigmoid(b);
    (c * s, c * s * (T::one() - s))
}

/// FLA's `gate_bound_is_safe(lower_bound, chunk_size)`: whether gates
/// `≥ lower_bound` keep the midpoint-centered exponents of a chunk,
/// `(chunk_size/2 + 1)·|lower_bound|·log2(e)`, within 124 (fp32's exponent
/// range less 4 bits of headroom): when DPLR takes the safe-gate scheme
/// ([`crate::dplr::DplrOptions::uses_safe_gate`]). A non-negative bound
/// licenses nothing.
pub fn gate_bound_is_safe(lower_bound: f64, chunk_size: usize) -> bool {
    lower_bound < 0.0
        && lower_bound.abs() * (chunk_size / 2 + 1) as f64 * std::f64::consts::LOG2_E <= 124.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigmoid_and_softplus_are_stable_at_extremes() {
        assert_eq!(sigmoid(800.0f64), 1.0);
        assert_eq!(sigmoid(-800.0f64), 0.0);
        assert!((softplus(800.0f64) - 800.0).abs() < 1e-12);
        assert!(softplus(-800.0f64) >= 0.0);
        assert!((softplus(0.0f64) - 2f64.ln()).abs() < 1e-15);
    }

    /// A run of elements gives each element's [`Gate::eval`] bits, for every
    /// gate, with and without `A_log`, in f64 and f32, over signs and
    /// magnitudes that reach both branches and the sigmoid's saturation.
    #[test]
    fn a_run_has_each_elements_bits() {
        fn check<T: Scalar>() {
            let rng = crate::rng::Stream::new(5, "gate run");
            let x: Vec<T> = (0..200u64)
                .map(|i| match i {
                    0 => T::zero(),
                    1 => -T::zero(),
                    2 => T::c(800.0),
                    3 => T::c(-800.0),
                    _ => T::c(rng.normal(i) * 2f64.powi((rng.uniform(i, 1) * 12.0) as i32 - 6)),
                })
                .collect();
            let gates = [
                Gate::None,
                Gate::Kda,
                Gate::LowerBound { lower_bound: -5.0 },
            ];
            for gate in gates {
                for a in [Some(T::c(0.3)), Some(T::c(-1.7)), None] {
                    if gate == Gate::Kda && a.is_none() {
                        continue;
                    }
                    let n = x.len();
                    let (mut g, mut dx, mut da) =
                        (vec![T::nan(); n], vec![T::nan(); n], vec![T::nan(); n]);
                    crate::fast::simd::dispatch(
                        #[inline(always)]
                        || gate_eval_run(gate, &x, a, &mut g, Some((&mut dx, &mut da))),
                    );
                    let mut only = vec![T::nan(); n];
                    gate_eval_run(gate, &x, a, &mut only, None);
                    for i in 0..n {
                        let want = gate.eval(x[i], a);
                        let got = (g[i], dx[i], da[i]);
                        let same = |p: T, q: T| p.f64().to_bits() == q.f64().to_bits();
                        assert!(
                            same(got.0, want.0) && same(got.1, want.1) && same(got.2, want.2),
                            "{gate:?} {a:?} x = {}: {got:?} vs {want:?}",
                            x[i]
                        );
                        assert!(same(only[i], want.0));
                    }
                }
            }
        }
        check::<f64>();
        check::<f32>();
    }

    #[test]
    fn gate_derivatives_match_central_differences() {
        let h = 1e-6;
        for gate in [Gate::Kda, Gate::LowerBound { lower_bound: -5.0 }] {
            for a in [Some(0.3f64), None] {
                if gate == Gate::Kda && a.is_none() {
                    continue;
                }
                let x = 0.7;
                let (_, dx, da) = gate.eval(x, a);
                let fd_x = (gate.eval(x + h, a).0 - gate.eval(x - h, a).0) / (2.0 * h);
                assert!((dx - fd_x).abs() < 1e-8, "{gate:?} {a:?}: {dx} vs {fd_x}");
                if let Some(al) = a {
                    let fd_a =
                        (gate.eval(x, Some(al + h)).0 - gate.eval(x, Some(al - h)).0) / (2.0 * h);
                    assert!((da - fd_a).abs() < 1e-8, "{gate:?}: {da} vs {fd_a}");
                }
            }
        }
    }
}
