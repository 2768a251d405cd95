//! The scalar the oracle is generic over: `f64` is the truth, `f32` runs the
//! same code so single-precision behaviour can be studied without a GPU.

use std::fmt::{Debug, Display};
use std::iter::Sum;
use std::ops::{AddAssign, DivAssign, MulAssign, SubAssign};

use ndarray::{LinalgScalar, ScalarOperand};
use num_traits::{Float, FromPrimitive};

pub trait Scalar:
    Float
    + FromPrimitive
    + LinalgScalar
    + ScalarOperand
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Sum
    + Debug
    + Display
    + Default
    + Send
    + Sync
    + 'static
{
    /// Name used in reports and case files (`"f64"`, `"f32"`).
    const NAME: &'static str;

    /// Converts a literal or an `f64` input (exact for `f64`, rounded for `f32`).
    fn c(x: f64) -> Self;

    /// Widens to `f64` (exact).
    fn f64(self) -> f64;

    /// `exp(self)` within one ulp for `|self| ≤` [`exp_bound`] (not
    /// checked: the caller bounds its arguments). `f64` and `f32` use
    /// plain arithmetic with no branch, so a loop of it vectorises under
    /// [`crate::fast::simd::dispatch`] with the same bits at every width, where
    /// the libm `exp` (the default) is one scalar call per element.
    fn exp_bounded(self) -> Self {
        self.exp()
    }

    /// `dst[i] = src[i].exp()` with libm's bits: `f64` runs glibc's
    /// algorithm on vectors ([`crate::fast::exp`]), others call libm per element.
    #[inline(always)]
    fn exp_into(src: &[Self], dst: &mut [Self]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = x.exp();
        }
    }
}

/// The largest `|x|` that [`Scalar::exp_bounded`] accepts in `T`,
/// `0.4·ln(MAX)`: its power of two stays far inside the normal range, and
/// a product of two such exponentials stays finite (the chunked engines'
/// middle-row factors check their exponents against it).
pub fn exp_bound<T: Scalar>() -> f64 {
    0.4 * T::max_value().ln().f64()
}

/// The Cody–Waite reduction shared by both widths: `x = n·ln2 + r` with
/// `|r| ≤ ln2/2`, the integer `n` rounded by adding `shift` (1.5·2^p: `n`
/// lands in the low bits of `t`), `ln2 = ln2_hi + ln2_lo` with `n·ln2_hi`
/// exact. Returns `(t, r)`.
#[inline(always)]
fn reduce<T: Float>(x: T, log2e: T, shift: T, ln2_hi: T, ln2_lo: T) -> (T, T) {
    let t = x * log2e + shift;
    let n = t - shift;
    (t, (x - n * ln2_hi) - n * ln2_lo)
}

/// `1 + (r + r²·q(r))` with `q(r) = Σ_k f[k]·r^k` (`f[k] = 1/(k+2)!`),
/// `q` in Estrin's scheme: the short dependency chains let the CPU overlap
/// neighbouring elements.
#[inline(always)]
fn taylor<T: Float, const N: usize>(r: T, f: [T; N]) -> T {
    let r2 = r * r;
    let mut terms = [T::zero(); N];
    let mut n = 0;
    while n < N / 2 {
        terms[n] = f[2 * n] + f[2 * n + 1] * r;
        n += 1;
    }
    let (mut len, mut power) = (N / 2, r2);
    while len > 1 {
        let half = len.div_ceil(2);
        for i in 0..len / 2 {
            terms[i] = terms[2 * i] + terms[2 * i + 1] * power;
        }
        if len % 2 == 1 {
            terms[half - 1] = terms[len - 1];
        }
        (len, power) = (half, power * power);
    }
    T::one() + (r + r2 * terms[0])
}

/// `1/k!` for `k = 2..N + 2`.
const fn inverse_factorials<const N: usize>() -> [f64; N] {
    let mut f = [0.0; N];
    let (mut k, mut fact) = (0, 1.0);
    while k < N {
        fact *= (k + 2) as f64;
        f[k] = 1.0 / fact;
        k += 1;
    }
    f
}

impl Scalar for f64 {
    const NAME: &'static str = "f64";
    #[inline(always)]
    fn c(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn exp_bounded(self) -> Self {
        // Shift 1.5·2^52; fdlibm's split of ln 2 (a high part with 21 zero
        // low bits, so n·hi is exact). With |r| ≤ ln2/2 the
        // series stops at r^13/13! (the next term is below 2^-53).
        const F: [f64; 12] = inverse_factorials();
        let (t, r) = reduce(
            self,
            std::f64::consts::LOG2_E,
            6_755_399_441_055_744.0,
            f64::from_bits(0x3FE6_2E42_FEE0_0000),
            f64::from_bits(0x3DEA_39EF_3579_3C76),
        );
        taylor(r, F) * f64::from_bits(t.to_bits().wrapping_add(1023) << 52)
    }
    #[inline(always)]
    fn exp_into(src: &[f64], dst: &mut [f64]) {
        crate::fast::exp::exp_into(src, dst)
    }
}

impl Scalar for f32 {
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn c(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn exp_bounded(self) -> Self {
        // Shift 1.5·2^23; ln 2 = 355/512 (exact in 9 bits) + a remainder.
        // The series stops at r^7/7!.
        const F64: [f64; 6] = inverse_factorials();
        let f = F64.map(|v| v as f32);
        let (t, r) = reduce(
            self,
            std::f32::consts::LOG2_E,
            12_582_912.0,
            f32::from_bits(0x3F31_8000),
            f32::from_bits(0xB95E_8083),
        );
        taylor(r, f) * f32::from_bits(t.to_bits().wrapping_add(127) << 23)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_exp_is_within_an_ulp_of_libm_in_f64() {
        let bound = exp_bound::<f64>();
        let n = 300_000;
        let draws = crate::rng::Stream::new(3, "exp_bounded").uniforms(n, -1.0, 1.0);
        let mut exact = 0;
        for (i, u) in draws.into_iter().enumerate() {
            // The whole range, the reduced range and tiny arguments.
            let x = u * [bound, 1.0, 1e-9][i % 3];
            let d = x.exp().to_bits().abs_diff(x.exp_bounded().to_bits());
            assert!(d <= 1, "exp_bounded({x:e}) is {d} ulps from libm");
            exact += usize::from(d == 0);
        }
        // Mostly the same value, not merely close.
        assert!(exact > n * 9 / 10, "{exact} of {n} equal to libm");
        for x in [0.0, -0.0, bound, -bound, 0.5 * std::f64::consts::LN_2] {
            assert!(
                x.exp().to_bits().abs_diff(x.exp_bounded().to_bits()) <= 1,
                "{x}"
            );
        }
        assert_eq!(0.0f64.exp_bounded(), 1.0);
        assert!(f64::NAN.exp_bounded().is_nan());
    }

    #[test]
    fn bounded_exp_is_within_an_ulp_of_the_rounded_exp_in_f32() {
        let bound = exp_bound::<f32>() as f32;
        // Every 101st f32 of each sign up to the bound (~4·10^7 values).
        let top = bound.to_bits();
        for bits in (0..=top).step_by(101).chain([top]) {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                let want = (x as f64).exp() as f32;
                let d = want.to_bits().abs_diff(x.exp_bounded().to_bits());
                assert!(
                    d <= 1,
                    "exp_bounded({x:e}) is {d} ulps from exp rounded to f32"
                );
            }
        }
        assert!(f32::NAN.exp_bounded().is_nan());
    }
}
