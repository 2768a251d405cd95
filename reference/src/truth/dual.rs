//! Dual numbers for forward-mode differentiation: a value and its derivative
//! along [`LANES`] directions at once, so one run of a truth `forward` on
//! them gives `LANES` directional derivatives. Each operation applies the
//! chain rule to every lane.

use std::ops::{Add, Div, Mul, Neg, Sub};

use num_traits::{One, Zero};

use super::Real;

/// Directions carried by one [`Dual`].
pub const LANES: usize = 8;

/// `v + Σ_l d[l]·ε_l` with `ε_l ε_m = 0`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dual {
    /// The value.
    pub v: f64,
    /// The derivative along each direction.
    pub d: [f64; LANES],
}

impl Dual {
    /// The value `v` with derivatives `d`, lane by lane.
    pub fn new(v: f64, d: [f64; LANES]) -> Dual {
        Dual { v, d }
    }

    /// `f(self)` given `f(v)` and `f'(v)`.
    fn chain(self, f: f64, df: f64) -> Dual {
        Dual::new(f, self.d.map(|d| d * df))
    }

    /// `a·self.d + b·o.d`, lane by lane.
    fn mix(self, a: f64, o: Dual, b: f64) -> [f64; LANES] {
        std::array::from_fn(|l| a * self.d[l] + b * o.d[l])
    }
}

impl Add for Dual {
    type Output = Dual;
    fn add(self, o: Dual) -> Dual {
        Dual::new(self.v + o.v, self.mix(1.0, o, 1.0))
    }
}

impl Sub for Dual {
    type Output = Dual;
    fn sub(self, o: Dual) -> Dual {
        Dual::new(self.v - o.v, self.mix(1.0, o, -1.0))
    }
}

impl Mul for Dual {
    type Output = Dual;
    fn mul(self, o: Dual) -> Dual {
        Dual::new(self.v * o.v, self.mix(o.v, o, self.v))
    }
}

impl Div for Dual {
    type Output = Dual;
    /// `(a/b)' = a'/b − (a/b)·b'/b`.
    fn div(self, o: Dual) -> Dual {
        let q = self.v / o.v;
        Dual::new(q, self.mix(1.0 / o.v, o, -q / o.v))
    }
}

impl Neg for Dual {
    type Output = Dual;
    fn neg(self) -> Dual {
        self.chain(-self.v, -1.0)
    }
}

impl Zero for Dual {
    fn zero() -> Dual {
        Dual::cst(0.0)
    }
    fn is_zero(&self) -> bool {
        *self == Dual::zero()
    }
}

impl One for Dual {
    fn one() -> Dual {
        Dual::cst(1.0)
    }
}

impl Real for Dual {
    fn cst(x: f64) -> Dual {
        Dual::new(x, [0.0; LANES])
    }
    fn exp(self) -> Dual {
        let e = self.v.exp();
        self.chain(e, e)
    }
    fn ln_1p(self) -> Dual {
        self.chain(self.v.ln_1p(), 1.0 / (1.0 + self.v))
    }
    fn sqrt(self) -> Dual {
        let s = self.v.sqrt();
        self.chain(s, 0.5 / s)
    }
}
