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
}
