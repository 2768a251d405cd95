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
            "f64" | "float64" => Dtype::F64,
            "f32" | "float32" => Dtype::F32,
            "bf16" | "bfloat16" => Dtype::Bf16,
            "f16" | "float16" => Dtype::F16,
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
            Dtype::Bf16 => bf16::from_f64(x).to_f64(),
            Dtype::F16 => f16::from_f64(x).to_f64(),
            Dtype::Tf32 => {
                // Round f32's 23-bit mantissa to 10 bits, nearest even.
                let b = (x as f32).to_bits();
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
