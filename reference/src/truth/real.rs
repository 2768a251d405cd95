//! The scalars the truth is written over. [`Real`] is `pub`, as the bound
//! of the public [`super::Truth`] must be, but lives in this private module:
//! outside the crate the truth runs in `f64`; the dual numbers of the
//! crate's gradient checks are the other implementation.

use std::fmt::Debug;
use std::ops::{Add, Div, Mul, Neg, Sub};

use num_traits::{One, Zero};

/// The real numbers the truth is written over: `f64`, or (in the crate's
/// tests) a dual number carrying derivatives along with the value.
pub trait Real:
    Copy
    + Debug
    + Zero
    + One
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    /// A constant (no derivative).
    fn cst(x: f64) -> Self;
    /// `e^self`.
    fn exp(self) -> Self;
    /// `ln(1 + self)`.
    fn ln_1p(self) -> Self;
    /// `√self`.
    fn sqrt(self) -> Self;
}

impl Real for f64 {
    fn cst(x: f64) -> f64 {
        x
    }
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    fn ln_1p(self) -> f64 {
        f64::ln_1p(self)
    }
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
}
