//! The op counts behind `deltaref bench`'s GFLOP/s
//! ([`deltaref_verify::bench::op_count`]),
//! checked against an independent count: the engines run on [`Counted`], a
//! scalar that tallies every multiply, add and subtract it performs.

use std::cmp::Ordering;
use std::fmt;
use std::iter::Sum;
use std::num::FpCategory;
use std::ops::{
    Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Rem, RemAssign, Sub, SubAssign,
};
use std::sync::atomic::{AtomicU64, Ordering as AtOrd};

use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};
use deltaref::op;
use deltaref::scalar::Scalar;
use deltaref_verify::bench::op_count as ops;
use num_traits::{Float, FromPrimitive, Num, NumCast, One, ToPrimitive, Zero};

/// Multiplies, adds and subtracts done by [`Counted`] values, all threads.
static OPS: AtomicU64 = AtomicU64::new(0);
use crate::SERIAL;

#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd)]
struct Counted(f64);

fn tick(n: u64) {
    OPS.fetch_add(n, AtOrd::Relaxed);
}

macro_rules! counted_binop {
    ($tr:ident, $m:ident, $atr:ident, $am:ident, $op:tt, $n:expr) => {
        impl $tr for Counted {
            type Output = Counted;
            fn $m(self, o: Counted) -> Counted {
                tick($n);
                Counted(self.0 $op o.0)
            }
        }
        impl $atr for Counted {
            fn $am(&mut self, o: Counted) {
                *self = $tr::$m(*self, o);
            }
        }
    };
}
counted_binop!(Add, add, AddAssign, add_assign, +, 1);
counted_binop!(Sub, sub, SubAssign, sub_assign, -, 1);
counted_binop!(Mul, mul, MulAssign, mul_assign, *, 1);
counted_binop!(Div, div, DivAssign, div_assign, /, 0);
counted_binop!(Rem, rem, RemAssign, rem_assign, %, 0);

impl Neg for Counted {
    type Output = Counted;
    fn neg(self) -> Counted {
        Counted(-self.0)
    }
}

impl Sum for Counted {
    fn sum<I: Iterator<Item = Counted>>(it: I) -> Counted {
        it.fold(Counted(0.0), |a, b| a + b)
    }
}

impl fmt::Display for Counted {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Zero for Counted {
    fn zero() -> Self {
        Counted(0.0)
    }
    fn is_zero(&self) -> bool {
        self.0 == 0.0
    }
}

impl One for Counted {
    fn one() -> Self {
        Counted(1.0)
    }
}

impl Num for Counted {
    type FromStrRadixErr = num_traits::ParseFloatError;
    fn from_str_radix(s: &str, r: u32) -> Result<Self, Self::FromStrRadixErr> {
        f64::from_str_radix(s, r).map(Counted)
    }
}

impl ToPrimitive for Counted {
    fn to_i64(&self) -> Option<i64> {
        self.0.to_i64()
    }
    fn to_u64(&self) -> Option<u64> {
        self.0.to_u64()
    }
    fn to_f64(&self) -> Option<f64> {
        Some(self.0)
    }
}

impl NumCast for Counted {
    fn from<N: ToPrimitive>(n: N) -> Option<Self> {
        n.to_f64().map(Counted)
    }
}

impl FromPrimitive for Counted {
    fn from_i64(n: i64) -> Option<Self> {
        Some(Counted(n as f64))
    }
    fn from_u64(n: u64) -> Option<Self> {
        Some(Counted(n as f64))
    }
    fn from_f64(n: f64) -> Option<Self> {
        Some(Counted(n))
    }
}

impl ndarray::ScalarOperand for Counted {}

macro_rules! unary {
    ($($m:ident),*) => { $(fn $m(self) -> Self { Counted(self.0.$m()) })* };
}
macro_rules! binary {
    ($($m:ident),*) => { $(fn $m(self, o: Self) -> Self { Counted(self.0.$m(o.0)) })* };
}
macro_rules! consts {
    ($($m:ident),*) => { $(fn $m() -> Self { Counted(<f64 as Float>::$m()) })* };
}
macro_rules! preds {
    ($($m:ident),*) => { $(fn $m(self) -> bool { self.0.$m() })* };
}

impl Float for Counted {
    consts!(
        nan,
        infinity,
        neg_infinity,
        neg_zero,
        min_value,
        min_positive_value,
        max_value
    );
    preds!(
        is_nan,
        is_infinite,
        is_finite,
        is_normal,
        is_sign_positive,
        is_sign_negative
    );
    unary!(floor, ceil, round, trunc, fract, abs, signum, recip, sqrt, exp, exp2, ln, log2);
    unary!(log10, cbrt, sin, cos, tan, asin, acos, atan, exp_m1, ln_1p, sinh, cosh, tanh);
    unary!(asinh, acosh, atanh);
    binary!(powf, log, max, min, hypot, atan2);
    fn classify(self) -> FpCategory {
        self.0.classify()
    }
    fn mul_add(self, a: Self, b: Self) -> Self {
        self * a + b
    }
    fn powi(self, n: i32) -> Self {
        Counted(self.0.powi(n))
    }
    #[allow(deprecated)]
    fn abs_sub(self, o: Self) -> Self {
        Counted((self.0 - o.0).max(0.0))
    }
    fn sin_cos(self) -> (Self, Self) {
        (self.sin(), self.cos())
    }
    fn integer_decode(self) -> (u64, i16, i8) {
        self.0.integer_decode()
    }
}

impl Scalar for Counted {
    const NAME: &'static str = "counted";
    fn c(x: f64) -> Self {
        Counted(x)
    }
    fn f64(self) -> f64 {
        self.0
    }
}

/// Ops counted while `f` runs.
fn count(f: impl FnOnce()) -> u64 {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    OPS.store(0, AtOrd::SeqCst);
    f();
    OPS.load(AtOrd::SeqCst)
}

/// Counted ops of the naive and chunked engines, one forward+backward run
/// ([`op::forward_backward`]), for one
/// head of `t` tokens: `(kda naive, kda chunk, dplr naive, dplr chunk)`.
fn measured(t: usize, kd: usize, vd: usize, c: usize) -> [u64; 4] {
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let g = inputs::KdaSpec::generate(&KdaSpec {
        layout: Layout::batch(1, t),
        h: 1,
        hv: 1,
        k: kd,
        v: vd,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 3,
    });
    let x = g.inputs.cast::<Counted>();
    let (d_o, dht) = (
        deltaref::tensor::cast(&g.d_o),
        deltaref::tensor::cast(&g.dht),
    );
    let kn = count(|| {
        op::forward_backward(&kda::Naive, &x, &opts, &d_o, Some(&dht)).unwrap();
    });
    let chunk = kda::Chunk::new(c).unwrap();
    let kc = count(|| {
        op::forward_backward(&chunk, &x, &opts, &d_o, Some(&dht)).unwrap();
    });
    let d = inputs::DplrSpec::generate(&DplrSpec {
        layout: Layout::batch(1, t),
        h: 1,
        k: kd,
        v: vd,
        initial_state: true,
        seed: 3,
    });
    let dopts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let x = d.inputs.cast::<Counted>();
    let (d_o, dht) = (
        deltaref::tensor::cast(&d.d_o),
        deltaref::tensor::cast(&d.dht),
    );
    let dn = count(|| {
        op::forward_backward(&dplr::Naive, &x, &dopts, &d_o, Some(&dht)).unwrap();
    });
    let chunk = dplr::Chunk::new(c).unwrap();
    let dc = count(|| {
        op::forward_backward(&chunk, &x, &dopts, &d_o, Some(&dht)).unwrap();
    });
    [kn, kc, dn, dc]
}

/// The formulas of [`deltaref_verify::bench::op_count`] for the same runs.
fn formula(t: usize, kd: usize, vd: usize, c: usize) -> [f64; 4] {
    let tokens = |f: ops::OpCount| f.total() * t as f64;
    let chunks = |f: ops::OpCount| f.total() * (t / c) as f64;
    [
        tokens(ops::kda_naive(kd, vd)),
        chunks(ops::kda_chunk(c, kd, vd)),
        tokens(ops::dplr_naive(kd, vd)),
        chunks(ops::dplr_chunk(c, kd, vd)),
    ]
}

fn rel(a: f64, b: u64) -> f64 {
    (a - b as f64).abs() / b as f64
}

#[test]
fn formulas_match_counted_runs() {
    // The formulas keep the terms that grow with K·V, C·K·V and C²·(K+V);
    // what they drop (gates, norms, O(K + V) per token, the generic matrix
    // product's 3 ops per output element) is a few percent at these sizes.
    let mut worst = 0.0f64;
    for (t, kd, vd, c) in [
        (128, 32, 32, 32),
        (128, 64, 32, 32),
        (128, 32, 64, 32),
        (256, 64, 64, 64),
    ] {
        let got = measured(t, kd, vd, c);
        let want = formula(t, kd, vd, c);
        for (i, name) in ["kda naive", "kda chunk", "dplr naive", "dplr chunk"]
            .iter()
            .enumerate()
        {
            let r = rel(want[i], got[i]);
            eprintln!(
                "T={t} K={kd} V={vd} C={c} {name}: counted {} formula {} ({:.2}%)",
                got[i],
                want[i],
                r * 100.0
            );
            worst = worst.max(r);
        }
    }
    assert!(
        worst.partial_cmp(&0.06) == Some(Ordering::Less),
        "a formula is {:.2}% off its counted run",
        worst * 100.0
    );
}
