//! The one storage dtype of the workspace: what a case file stores a tensor
//! as, what a precision stage rounds to, what the GPU kernels read their
//! inputs as. Each user accepts a subset ([`Dtype::CASE_FILE`],
//! [`Dtype::GPU`]) and refuses the rest with [`Dtype::require`], naming the
//! flag or tensor and the allowed values.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::scalar::Scalar;

/// A storage dtype; values are rounded to it (round to nearest even).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dtype {
    F64,
    F32,
    Bf16,
    F16,
    /// TF32: 10 explicit mantissa bits (a tensor-core input rounding).
    Tf32,
    /// 2 explicit mantissa bits, fp8 e5m2's rounding (the exponent range is
    /// not clamped): a deliberately coarse stage for bisection tests.
    E5m2,
}

impl Dtype {
    pub const ALL: [Dtype; 6] = [
        Dtype::F64,
        Dtype::F32,
        Dtype::Bf16,
        Dtype::F16,
        Dtype::Tf32,
        Dtype::E5m2,
    ];
    /// The dtypes a case file (safetensors) stores floats as.
    pub const CASE_FILE: [Dtype; 4] = [Dtype::F64, Dtype::F32, Dtype::Bf16, Dtype::F16];
    /// The input dtypes the GPU kernels read.
    pub const GPU: [Dtype; 2] = [Dtype::F32, Dtype::Bf16];

    /// Parses a short name (`f64`, `bf16`, `tf32`, …) or PyTorch's long name
    /// of the four file dtypes (`float64`, `bfloat16`, …).
    pub fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "f64" | "fp64" | "float64" => Dtype::F64,
            "f32" | "fp32" | "float32" => Dtype::F32,
            "bf16" | "bfloat16" => Dtype::Bf16,
            "f16" | "fp16" | "float16" => Dtype::F16,
            "tf32" => Dtype::Tf32,
            "e5m2" => Dtype::E5m2,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "f64",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::Tf32 => "tf32",
            Dtype::E5m2 => "e5m2",
        }
    }

    /// `self` if it is one of `allowed`, else an error naming `what` (the
    /// flag or tensor), the dtype and the allowed names.
    pub fn require(self, what: &str, allowed: &[Dtype]) -> Result<Dtype, String> {
        if allowed.contains(&self) {
            Ok(self)
        } else {
            Err(format!(
                "{what}: dtype {self} is not allowed here (allowed: {})",
                names(allowed)
            ))
        }
    }

    /// Parses `s` as one of `allowed`; the error names `what`, the value
    /// and the allowed names.
    pub fn parse_among(s: &str, what: &str, allowed: &[Dtype]) -> Result<Dtype, String> {
        Dtype::parse(s)
            .ok_or_else(|| {
                format!(
                    "{what}: unknown dtype \"{s}\" (allowed: {})",
                    names(allowed)
                )
            })?
            .require(what, allowed)
    }

    /// Rounds an f64 to this dtype and back.
    pub fn round_f64(self, x: f64) -> f64 {
        match self {
            Dtype::F64 => x,
            Dtype::F32 => x as f32 as f64,
            Dtype::Bf16 => to_bf16(x).to_f64(),
            Dtype::F16 => to_f16(x).to_f64(),
            Dtype::Tf32 => {
                // Round f32's 23-bit mantissa to 10 bits, nearest even.
                let b = f32_round_to_odd(x).to_bits();
                let lsb = (b >> 13) & 1;
                f32::from_bits((b.wrapping_add(0x0FFF + lsb)) & !0x1FFF) as f64
            }
            Dtype::E5m2 => {
                // Round f64's 52-bit mantissa to 2 bits, nearest even.
                let b = x.to_bits();
                let lsb = (b >> 50) & 1;
                f64::from_bits(b.wrapping_add((1 << 49) - 1 + lsb) & !((1u64 << 50) - 1))
            }
        }
    }

    pub fn round<T: Scalar>(self, x: T) -> T {
        match self {
            Dtype::F64 => x,
            _ => T::c(self.round_f64(x.f64())),
        }
    }

    /// `Σ xs` as a GPU reduction accumulating in this storage: each lane
    /// sums `per_lane` neighbouring values serially, then the lanes' partial
    /// sums combine by butterfly (lane `i` with lane `i + n/2`, `n` halving),
    /// every partial sum rounded. Returns 0 for no terms.
    pub fn lane_sum<T: Scalar>(self, xs: &[T], per_lane: usize) -> T {
        lane_sum_with(xs, per_lane, |x| self.round(x))
    }
}

/// [`Dtype::lane_sum`]'s reduction with `store` applied to every partial
/// sum (a plain or a jittered store, [`crate::precision::Store`]).
pub(crate) fn lane_sum_with<T: Scalar>(xs: &[T], per_lane: usize, store: impl Fn(T) -> T) -> T {
    let serial = |run: &[T]| run.iter().skip(1).fold(run[0], |acc, &x| store(acc + x));
    let mut parts: Vec<T> = xs.chunks(per_lane.max(1)).map(serial).collect();
    while parts.len() > 1 {
        let n = parts.len().div_ceil(2);
        parts = (0..n)
            .map(|i| match parts.get(i + n) {
                Some(&other) => store(parts[i] + other),
                None => parts[i],
            })
            .collect();
    }
    parts.first().copied().unwrap_or_else(T::zero)
}

/// `x` rounded to nearest even bf16. `half::bf16::from_f64` drops the
/// f64's low 32 mantissa bits before rounding, which turns values just
/// above a midpoint into ties (f64 bits `0x47ec900080000000` give bf16
/// `0x7f64`, not `0x7f65`): this rounds `x` itself.
pub fn to_bf16(x: f64) -> bf16 {
    bf16::from_f32(f32_round_to_odd(x))
}

/// `x` rounded to nearest even f16 (see [`to_bf16`] for why not `half`'s
/// f64 conversion).
pub fn to_f16(x: f64) -> f16 {
    f16::from_f32(f32_round_to_odd(x))
}

/// `x` cut to f32 toward zero, the last bit set when anything was cut
/// (round to odd). Rounding that to nearest even in a format with at least
/// two fewer mantissa bits gives the same result as rounding `x` itself:
/// the set bit keeps a cut-off remainder from looking like a tie.
fn f32_round_to_odd(x: f64) -> f32 {
    let f = x as f32;
    if !f.is_finite() || f as f64 == x {
        return f;
    }
    let bits = f.to_bits() - u32::from((f as f64).abs() > x.abs());
    f32::from_bits(bits | 1)
}

/// `a, b or c`.
fn names(ds: &[Dtype]) -> String {
    let n: Vec<&str> = ds.iter().map(|d| d.name()).collect();
    match n.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => n.join(""),
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Dtype, String> {
        Dtype::parse_among(s, "dtype", &Dtype::ALL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_sum_rounds_serially_in_a_lane_then_across_lanes() {
        let xs = [1.0, 5.0 / 512.0, 3.0 / 256.0, 1.0 / 256.0];
        // bf16 keeps 7 mantissa bits: each order rounds differently.
        // One lane: ((x0 + x1) + x2) + x3.
        assert_eq!(Dtype::Bf16.lane_sum(&xs, 4), 1.015625);
        // Two lanes of two: (x0 + x1) + (x2 + x3).
        assert_eq!(Dtype::Bf16.lane_sum(&xs, 2), 1.0234375);
        // One value per lane, butterfly: (x0 + x2) + (x1 + x3).
        assert_eq!(Dtype::Bf16.lane_sum(&xs, 1), 1.03125);
        assert_eq!(Dtype::F64.lane_sum(&xs, 1), xs.iter().sum::<f64>());
        assert_eq!(Dtype::Bf16.lane_sum::<f64>(&[], 8), 0.0);
    }

    /// Nearest even with `bits` explicit mantissa bits, on the f64's bits
    /// (right for values in the target's normal range).
    fn round_mantissa(x: f64, bits: u32) -> f64 {
        let cut = 52 - bits;
        let b = x.to_bits();
        let lsb = (b >> cut) & 1;
        f64::from_bits(b.wrapping_add((1u64 << (cut - 1)) - 1 + lsb) & !((1u64 << cut) - 1))
    }

    #[test]
    fn bf16_and_f16_round_the_f64_itself() {
        // Just above a bf16 midpoint, with the excess below f64 bit 32.
        let x = f64::from_bits(0x47ec_9000_8000_0000);
        assert_eq!(to_bf16(x).to_bits(), 0x7f65);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..300_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Midpoints with a small excess or deficit, and random values,
            // for bf16 (7 mantissa bits) and f16 (10), in their normal range.
            let (bits, exp) = if i % 2 == 0 { (7, 1003) } else { (10, 1013) };
            let half_ulp = 1u64 << (51 - bits);
            let tie = (state & !(2 * half_ulp - 1)) | half_ulp;
            let mant = match i % 3 {
                0 => tie | (state >> 40 & 0xff),
                1 => tie - (state >> 40 & 0xff) - 1,
                _ => state,
            } & ((1 << 52) - 1);
            let x = f64::from_bits((exp + (state >> 56) % 20) << 52 | mant);
            let got = if bits == 7 {
                to_bf16(x).to_f64()
            } else {
                to_f16(x).to_f64()
            };
            assert_eq!(got, round_mantissa(x, bits), "{:#x}", x.to_bits());
        }
    }

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>(), Ok(d));
            assert_eq!(d.to_string(), d.name());
        }
        assert_eq!(Dtype::parse("bfloat16"), Some(Dtype::Bf16));
        assert_eq!(Dtype::parse("float8"), None);
    }

    #[test]
    fn subsets_refuse_the_rest_by_name() {
        assert_eq!(
            Dtype::Bf16.require("--gpu-dtype", &Dtype::GPU),
            Ok(Dtype::Bf16)
        );
        let e = Dtype::F16.require("--gpu-dtype", &Dtype::GPU).unwrap_err();
        assert_eq!(
            e,
            "--gpu-dtype: dtype f16 is not allowed here (allowed: f32 or bf16)"
        );
        let e = Dtype::parse_among("tf32", "tensor `q`", &Dtype::CASE_FILE).unwrap_err();
        assert!(e.contains("tensor `q`") && e.contains("tf32"), "{e}");
        assert!(e.contains("f64, f32, bf16 or f16"), "{e}");
        let e = Dtype::parse_among("int8", "--dtype", &Dtype::CASE_FILE).unwrap_err();
        assert!(e.contains("--dtype") && e.contains("\"int8\""), "{e}");
    }

    #[test]
    fn storage_rounding_matches_half_and_tf32_keeps_10_bits() {
        let x = 1.0 + 2f64.powi(-12) + 2f64.powi(-20);
        assert_eq!(Dtype::Bf16.round_f64(x), 1.0);
        assert_eq!(Dtype::F16.round_f64(x), 1.0);
        assert_eq!(Dtype::F32.round_f64(x), x);
        // TF32 keeps 10 mantissa bits: 1 + 2^-10 survives, 1 + 2^-12 does not.
        assert_eq!(
            Dtype::Tf32.round_f64(1.0 + 2f64.powi(-10)),
            1.0 + 2f64.powi(-10)
        );
        assert_eq!(Dtype::Tf32.round_f64(1.0 + 2f64.powi(-12)), 1.0);
        // Ties go to even: 1 + 2^-11 (halfway) rounds down to 1.
        assert_eq!(Dtype::Tf32.round_f64(1.0 + 2f64.powi(-11)), 1.0);
        assert_eq!(
            Dtype::Tf32.round_f64(1.0 + 3.0 * 2f64.powi(-11)),
            1.0 + 2f64.powi(-9)
        );
        // e5m2 keeps 2 mantissa bits: 1.25 and 1.5 survive, 1.1 goes to 1.
        assert_eq!(Dtype::E5m2.round_f64(1.25), 1.25);
        assert_eq!(Dtype::E5m2.round_f64(-1.5), -1.5);
        assert_eq!(Dtype::E5m2.round_f64(1.1), 1.0);
        assert_eq!(Dtype::E5m2.round_f64(1.2), 1.25);
        // A tie (1.125) goes to even (1.0), 1.375 to 1.5.
        assert_eq!(Dtype::E5m2.round_f64(1.125), 1.0);
        assert_eq!(Dtype::E5m2.round_f64(1.375), 1.5);
    }

    #[test]
    fn round_is_generic_over_the_scalar() {
        let x = 1.0 + 2f64.powi(-20);
        assert_eq!(Dtype::F64.round(x), x);
        assert_eq!(Dtype::Bf16.round(x as f32), 1.0f32);
    }
}
