//! The noise band: the norm_ratio a *correct* kernel with a preset's
//! storage and arithmetic shows on one case, as a distribution rather than
//! one emulated number, and verdicts and test tolerances drawn from it.
//!
//! A correct bf16 kernel's error depends on the tensor: a per-token tensor
//! averages millions of rounding errors and lands on nearly the same
//! norm_ratio whatever the kernel's internal order, while `dA_log` or
//! `ddt_bias` (sums over every token into H or H·K numbers) are a sample of
//! a few numbers and move by several times. One emulated run cannot say
//! which; an ensemble of runs that differ only in what a correct kernel is
//! free to do can.
//!
//! The ensemble ([`ensemble`]): sample `i` is the preset's emulation with
//! every stored stage jittered ([`deltaref::precision::Jitter`], seed drawn
//! from `(seed, i)`): before each store the fp32 value moves by a relative
//! amount in `±rel`, then rounds to nearest even. What it models is read
//! from FLA 0.6.0's kernels: the value a kernel stores is the end of a
//! reduction whose order the emulation does not share — `tl.dot` on tensor
//! cores (the MMA's accumulation order and alignment are the hardware's),
//! `tl.sum` lane trees, the `BV`/`BK` block splits of the state passes
//! (`chunk_gated_delta_rule_fwd_h`, `chunk_bwd_dqkwg`), `exp2` as the
//! approximate `ex2.approx.f32` — so it differs from the emulation's in its
//! last fp32 bits. Stores themselves round to nearest even (Triton's
//! `.to(bf16)`), so a value near a bf16 rounding boundary may round either
//! way, and the difference flows into everything downstream (the recurrent
//! state `h` carries it to later chunks). Inputs are never jittered: a
//! kernel reads its inputs as given. The runs are independent (one per
//! rayon task, results in sample order), each deterministic, so a band is
//! the same bits for a seed whatever the thread count.
//!
//! The published band is the ensemble's `[p1, p99]` widened on each side
//! by the emulation's measured distance from a real kernel
//! ([`MODEL_MARGIN`]): the ensemble says how much a correct kernel's error
//! moves with its internal order, the margin how well the emulation knows
//! where that error sits. Both are in every row.

use std::collections::BTreeMap;

use rayon::prelude::*;
use serde::Serialize;

use deltaref::precision::Jitter;

use crate::case::{Case, CaseError, Op};
use crate::impls::{Compute, ComputeError, Impl, ImplRequest};
use crate::metrics::norm_ratio;
use crate::outputs::Tensors;

/// The default relative jitter before a store: `2^-20`, eight fp32 ulps at
/// the top of a binade (sixteen at its bottom). A 64- or 128-term fp32
/// reduction in another order differs by a few ulps at the top of that
/// range, and cancellation (the WY inverse, `v − w·h`, the decay-gradient
/// sums) raises the relative difference of the result; `ex2.approx` alone
/// is off by up to 2 ulps.
pub const DEFAULT_JITTER: f64 = 1.0 / (1u64 << 20) as f64;

/// The default ensemble size.
pub const DEFAULT_SAMPLES: usize = 32;

/// A candidate may sit this many band widths beyond `p99` (or below `p1`)
/// before it is out of the band: `N` samples estimate the tails only
/// roughly, and a fresh correct run lands past the `N`-sample max about
/// once in `N + 1` tries per tensor.
pub const MARGIN_WIDTHS: f64 = 1.0;

/// The narrowest band width used to judge, relative to `p99`: with
/// [`MARGIN_WIDTHS`] = 1 a tensor fails above `1.3 · p99` (narrow bands) or
/// `p99 + (p99 − p1)` (wide ones), so a fault that doubles a tensor's error
/// is always flagged.
pub const MIN_REL_WIDTH: f64 = 0.3;

/// How far the emulation may sit from a real kernel that follows the same
/// storage plan, as a factor on each side of the ensemble's `[p1, p99]`.
/// The ensemble re-draws only what happens near rounding boundaries, so on
/// a per-token tensor (an average over millions of rounding errors) its
/// runs agree to a fraction of a percent; but the emulation is not FLA's
/// kernel: where a dot's operands are rounded to TF32, the order of its
/// partial sums and which operands it keeps in registers shift every
/// element's error a little the same way. Measured against FLA 0.6.0 on an
/// H100 over 21 cases (debug.md, "Fidelity, restated"): KDA's per-token
/// tensors within ×1.07 of the ensemble, DPLR's within ×1.2 (its emulation
/// follows FLA's stages less closely), the decay gradients within ×1.36.
/// The published band is the ensemble's widened by [`model_margin`].
pub const MODEL_MARGIN: f64 = 1.15;

/// [`MODEL_MARGIN`] of DPLR's tensors.
pub const MODEL_MARGIN_DPLR: f64 = 1.25;

/// [`MODEL_MARGIN`] of the decay gradients ([`DECAY_GRADIENTS`]) and of any
/// noisy tensor: sums over every token into a few numbers (`dA_log`: H of
/// them), whose 8-sample ensemble quantiles are themselves rough, and which
/// sum the in-kernel gate's backward (computed in fp32 from bf16 operands in
/// an order the emulation does not share).
pub const MODEL_MARGIN_DECAY: f64 = 1.4;

/// The gradients of the decay's parameters.
pub const DECAY_GRADIENTS: [&str; 4] = ["dg", "dgk", "dA_log", "ddt_bias"];

/// The model margin of `tensor` of `op` (see [`MODEL_MARGIN`]); `noisy`:
/// its ensemble is noisy.
pub fn model_margin(op: Op, tensor: &str, noisy: bool) -> f64 {
    if noisy || DECAY_GRADIENTS.contains(&tensor) {
        MODEL_MARGIN_DECAY
    } else if op == Op::Dplr {
        MODEL_MARGIN_DPLR
    } else {
        MODEL_MARGIN
    }
}

/// A candidate under `p1 /` this is far below its band whatever the width.
pub const FAR_BELOW_FACTOR: f64 = 10.0;

/// A band whose `p99 / p1` exceeds this is intrinsically noisy: a correct
/// kernel's error on that tensor varies by more than ×2 with the kernel's
/// internal order alone, so its norm_ratio is weak evidence either way.
pub const NOISY_SPAN: f64 = 2.0;

/// What the ensemble varies and how large it is.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BandSpec {
    pub samples: usize,
    pub seed: u64,
    /// [`Jitter::rel`] of every sample.
    pub jitter: f64,
}

impl Default for BandSpec {
    fn default() -> Self {
        BandSpec {
            samples: DEFAULT_SAMPLES,
            seed: 0,
            jitter: DEFAULT_JITTER,
        }
    }
}

impl BandSpec {
    /// Refuses an empty ensemble or a jitter that is not a finite number in
    /// `[0, 2^-8]` (beyond a bf16 ulp it is no longer a reordering).
    pub fn check(&self) -> Result<(), String> {
        if self.samples < 2 {
            return Err(format!(
                "--samples: a band needs at least 2 samples, got {}",
                self.samples
            ));
        }
        if !(self.jitter.is_finite() && (0.0..=1.0 / 256.0).contains(&self.jitter)) {
            return Err(format!(
                "--jitter: expected a relative size in [0, 2^-8 = 0.00390625], got {}",
                self.jitter
            ));
        }
        Ok(())
    }

    /// Sample `i`'s jitter: its seed mixes the band's seed and `i`.
    pub fn jitter_of(&self, i: usize) -> Jitter {
        let z = self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).rotate_left(32);
        Jitter {
            seed: z
                .wrapping_add(0xD1B5_4A32_D192_ED03)
                .wrapping_mul(0xBF58_476D_1CE4_E5B9),
            rel: self.jitter,
        }
    }
}

/// norm_ratio per tensor of `got` against `truth`, for the tensors both
/// hold with the same shape.
pub fn ratios(truth: &Tensors, got: &Tensors) -> BTreeMap<String, f64> {
    truth
        .iter()
        .filter_map(|(name, t)| {
            let g = got.get(name).filter(|g| g.shape() == t.shape())?;
            let (a, b): (Vec<f64>, Vec<f64>) =
                t.iter().zip(g.iter()).map(|(a, b)| (*a, *b)).unzip();
            Some((name.clone(), norm_ratio(&a, &b)))
        })
        .collect()
}

/// The ensemble's norm_ratios: one map per sample (in sample order), each
/// `tensor → norm_ratio` of `imp` jittered per [`BandSpec::jitter_of`]
/// computing `case` in `compute`, against `truth`. Samples run in parallel.
pub fn ensemble(
    case: &Case,
    imp: &Impl,
    compute: Compute,
    truth: &Tensors,
    spec: &BandSpec,
) -> Result<Vec<BTreeMap<String, f64>>, ComputeError> {
    (0..spec.samples)
        .into_par_iter()
        .map(|i| {
            let got = imp.jittered(spec.jitter_of(i)).compute(case, compute)?;
            Ok(ratios(truth, &got))
        })
        .collect()
}

/// The band of `case` under `req` (which must name a `precision`),
/// against `truth`: the implementation `req` resolves to, run `spec.samples`
/// times jittered in the preset's compute scalar. `path` names the case in
/// errors.
pub fn of_case(
    case: &Case,
    path: &std::path::Path,
    truth: &Tensors,
    req: &ImplRequest,
    spec: &BandSpec,
) -> Result<Band, CaseError> {
    let (samples, name) = samples_of_case(case, path, truth, req, spec)?;
    let precision = req.precision.as_deref().unwrap_or_default();
    Ok(Band::of(case.meta.op, precision, &name, *spec, &samples))
}

/// [`of_case`]'s ensemble itself ([`ensemble`]'s maps, in sample order)
/// and the implementation's name.
#[allow(clippy::type_complexity)]
pub fn samples_of_case(
    case: &Case,
    path: &std::path::Path,
    truth: &Tensors,
    req: &ImplRequest,
    spec: &BandSpec,
) -> Result<(Vec<BTreeMap<String, f64>>, String), CaseError> {
    spec.check().map_err(CaseError::Usage)?;
    let Some(precision) = req.precision.clone() else {
        return Err(CaseError::Usage(
            "a band is the spread of a precision preset's runs: give the preset (e.g. fla-bf16)"
                .into(),
        ));
    };
    let (imp, compute) = req.resolve_with_compute(case)?;
    if imp.policy.features().is_empty()
        && imp
            .cp
            .as_ref()
            .is_none_or(|(_, o)| o.policy.features().is_empty())
    {
        return Err(CaseError::Usage(format!(
            "precision `{precision}` stores nothing in a lower precision: its runs have no \
             rounding to vary, so its band is a single point (use e.g. fla-bf16)"
        )));
    }
    imp.check_memory(case)?;
    let _p = crate::progress::Progress::spinner(&format!(
        "band of {precision}: {} runs of impl:{}",
        spec.samples,
        imp.name()
    ));
    let samples = ensemble(case, &imp, compute.unwrap_or(Compute::F64), truth, spec)
        .map_err(CaseError::computing(path))?;
    Ok((samples, imp.name()))
}

/// The `q`-quantile (`0 ≤ q ≤ 1`) of sorted values, linearly interpolated
/// between the two nearest ranks (NumPy's default); NaN for no values.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, frac) = (pos.floor() as usize, pos - pos.floor());
    match sorted.get(lo + 1) {
        Some(&hi) if frac > 0.0 => sorted[lo] + frac * (hi - sorted[lo]),
        _ => sorted[lo],
    }
}

/// One tensor's band.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BandRow {
    pub tensor: String,
    /// The ensemble's median.
    pub median: f64,
    /// The band: the ensemble's p1 divided by `margin`.
    pub p1: f64,
    /// The band: the ensemble's p99 times `margin`.
    pub p99: f64,
    /// The ensemble's largest and smallest sample.
    pub max: f64,
    pub min: f64,
    /// The ensemble's own quantiles, before the model margin.
    pub ensemble_p1: f64,
    pub ensemble_p99: f64,
    /// [`model_margin`] of the tensor.
    pub margin: f64,
    /// The ensemble's `p99 / p1 >` [`NOISY_SPAN`]: weak evidence either way.
    pub noisy: bool,
}

impl BandRow {
    /// The band of `values`, the norm_ratios of `op`'s `tensor` (NaNs sort
    /// last and so reach `max` first).
    pub fn of(op: Op, tensor: &str, values: &[f64]) -> BandRow {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let (p1, p99) = (quantile(&v, 0.01), quantile(&v, 0.99));
        // A NaN sample makes the band unusable as evidence: noisy too.
        let noisy = p99.is_nan() || p1.is_nan() || p99 > NOISY_SPAN * p1;
        let margin = model_margin(op, tensor, noisy);
        BandRow {
            tensor: tensor.to_string(),
            median: quantile(&v, 0.5),
            p1: p1 / margin,
            p99: p99 * margin,
            max: v.last().copied().unwrap_or(f64::NAN),
            min: v.first().copied().unwrap_or(f64::NAN),
            ensemble_p1: p1,
            ensemble_p99: p99,
            margin,
            noisy,
        }
    }

    /// The width candidates are judged in: `p99 − p1`, at least
    /// [`MIN_REL_WIDTH`]` · p99`.
    pub fn width(&self) -> f64 {
        (self.p99 - self.p1).max(MIN_REL_WIDTH * self.p99)
    }
}

/// A case's band under one preset.
#[derive(Clone, Debug, Serialize)]
pub struct Band {
    pub precision: String,
    pub implementation: String,
    pub spec: BandSpec,
    pub rows: Vec<BandRow>,
}

impl Band {
    /// The band of an ensemble's samples of `op`, one row per tensor (name order).
    pub fn of(
        op: Op,
        precision: &str,
        implementation: &str,
        spec: BandSpec,
        samples: &[BTreeMap<String, f64>],
    ) -> Band {
        Band {
            precision: precision.to_string(),
            implementation: implementation.to_string(),
            spec,
            rows: per_tensor(samples)
                .iter()
                .map(|(t, v)| BandRow::of(op, t, v))
                .collect(),
        }
    }

    pub fn row(&self, tensor: &str) -> Option<&BandRow> {
        self.rows.iter().find(|r| r.tensor == tensor)
    }
}

/// The samples regrouped `tensor → values`.
pub fn per_tensor(samples: &[BTreeMap<String, f64>]) -> BTreeMap<String, Vec<f64>> {
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for s in samples {
        for (t, v) in s {
            out.entry(t.clone()).or_default().push(*v);
        }
    }
    out
}

/// Where a candidate's norm_ratio sits against its tensor's band.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Position {
    /// In `[p1, p99]`.
    Inside,
    /// Above `p99` by at most [`MARGIN_WIDTHS`] band widths: reported, passes.
    Above,
    /// Above `p99` by more: the tensor fails.
    OutAbove,
    /// Below `p1` by at most [`MARGIN_WIDTHS`] widths.
    Below,
    /// Below `p1` by more, or under `p1 /` [`FAR_BELOW_FACTOR`]: reported
    /// (passes): a kernel more accurate than the precision it claims may
    /// not be doing what it claims.
    FarBelow,
    /// The candidate's norm_ratio is NaN: fails.
    Nan,
}

impl Position {
    pub fn name(self) -> &'static str {
        match self {
            Position::Inside => "inside",
            Position::Above => "above",
            Position::OutAbove => "OUT above",
            Position::Below => "below",
            Position::FarBelow => "far below",
            Position::Nan => "NaN",
        }
    }

    pub fn passes(self) -> bool {
        !matches!(self, Position::OutAbove | Position::Nan)
    }
}

/// One tensor judged against its band.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub tensor: String,
    pub norm_ratio: f64,
    pub position: Position,
    /// How far outside `[p1, p99]`, in band widths ([`BandRow::width`]); 0 inside.
    pub widths: f64,
    pub band: BandRow,
    pub pass: bool,
}

/// Judges one norm_ratio against a band row.
pub fn judge_one(row: &BandRow, x: f64) -> Verdict {
    let w = row.width();
    let (position, widths) = if x.is_nan() {
        (Position::Nan, f64::NAN)
    } else if x > row.p99 {
        let k = (x - row.p99) / w;
        (
            if k > MARGIN_WIDTHS {
                Position::OutAbove
            } else {
                Position::Above
            },
            k,
        )
    } else if x < row.p1 {
        let k = (row.p1 - x) / w;
        (
            // A wide band's width can exceed p1 itself: an order of
            // magnitude under it is far below too.
            if k > MARGIN_WIDTHS || x < row.p1 / FAR_BELOW_FACTOR {
                Position::FarBelow
            } else {
                Position::Below
            },
            k,
        )
    } else {
        (Position::Inside, 0.0)
    };
    Verdict {
        tensor: row.tensor.clone(),
        norm_ratio: x,
        position,
        widths,
        band: row.clone(),
        pass: position.passes(),
    }
}

/// Every tensor of `ratios` that has a band row, judged (name order).
pub fn judge(band: &Band, ratios: &BTreeMap<String, f64>) -> Vec<Verdict> {
    ratios
        .iter()
        .filter_map(|(t, &x)| Some(judge_one(band.row(t)?, x)))
        .collect()
}

/// The verdict table (text).
pub fn verdict_table(verdicts: &[Verdict]) -> String {
    let mut s = format!(
        "{:<12} {:>11} {:>10} {:>10} {:>10}  {:<10} {:>8}  note\n",
        "tensor", "norm_ratio", "p1", "median", "p99", "position", "widths"
    );
    for v in verdicts {
        let note = match (v.position, v.band.noisy) {
            (Position::FarBelow, _) => {
                "far more accurate than the precision claims: is it computing what it says?"
            }
            (_, true) => "noisy band (p99/p1 > 2): weak evidence either way",
            _ => "",
        };
        s += &format!(
            "{:<12} {:>11.3e} {:>10.3e} {:>10.3e} {:>10.3e}  {:<10} {:>8.2}  {note}\n",
            v.tensor,
            v.norm_ratio,
            v.band.p1,
            v.band.median,
            v.band.p99,
            v.position.name(),
            v.widths
        );
    }
    let bad: Vec<&str> = verdicts
        .iter()
        .filter(|v| !v.pass)
        .map(|v| v.tensor.as_str())
        .collect();
    s += &if bad.is_empty() {
        format!(
            "all {} tensors within their band (p99 + {MARGIN_WIDTHS} band width)",
            verdicts.len()
        )
    } else {
        format!("out of band: {}", bad.join(", "))
    };
    s
}

impl std::fmt::Display for Band {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "band of `{}` ({}): {} samples, seed {}, jitter {:.2e} before every store; \
             p1 and p99 widened by the model margin (column x)",
            self.precision,
            self.implementation,
            self.spec.samples,
            self.spec.seed,
            self.spec.jitter
        )?;
        writeln!(
            f,
            "{:<12} {:>10} {:>10} {:>10} {:>10} {:>5}  note",
            "tensor", "median", "p1", "p99", "max", "x"
        )?;
        for r in &self.rows {
            let note = if r.noisy { "noisy (p99/p1 > 2)" } else { "" };
            writeln!(
                f,
                "{:<12} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e} {:>5.2}  {note}",
                r.tensor, r.median, r.p1, r.p99, r.max, r.margin
            )?;
        }
        Ok(())
    }
}

/// `Φ^{-1}(p)`, the standard normal quantile, `0 < p < 1` (P. J. Acklam's
/// rational approximation, relative error below 1.2e-9).
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.383_577_518_672_69e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let poly = |c: &[f64], x: f64| c.iter().fold(0.0, |acc, &k| acc * x + k);
    let tail = |q: f64| {
        let r = (-2.0 * q.ln()).sqrt();
        poly(&C, r) / (poly(&D, r) * r + 1.0)
    };
    const P_LOW: f64 = 0.02425;
    if p < P_LOW {
        tail(p)
    } else if p > 1.0 - P_LOW {
        -tail(1.0 - p)
    } else {
        let q = p - 0.5;
        let r = q * q;
        poly(&A, r) * q / (poly(&B, r) * r + 1.0)
    }
}

/// The upper tail `P(T > t)` of Student's t with `nu ≥ 1` degrees of
/// freedom, `t ≥ 0`, from the closed forms for integer `nu` (Abramowitz &
/// Stegun 26.7.3–4: with `θ = atan(t/√nu)`, `P(|T| < t)` is a finite series
/// in `cos θ`), exact to rounding.
pub fn student_t_upper(t: f64, nu: usize) -> f64 {
    let theta = (t / (nu as f64).sqrt()).atan();
    let (s, c2) = (theta.sin(), theta.cos().powi(2));
    // The series' terms: odd `nu` starts at cos θ with ratio
    // (2j)/(2j+1)·cos²θ; even `nu` at 1 with ratio (2j−1)/(2j)·cos²θ.
    let inside = if nu % 2 == 1 {
        let mut term = theta.cos();
        let mut sum = if nu > 1 { term } else { 0.0 };
        for j in 1..(nu.saturating_sub(1) / 2) {
            term *= c2 * (2 * j) as f64 / (2 * j + 1) as f64;
            sum += term;
        }
        2.0 / std::f64::consts::PI * (theta + s * sum)
    } else {
        let (mut term, mut sum) = (1.0, 1.0);
        for j in 1..(nu / 2) {
            term *= c2 * (2 * j - 1) as f64 / (2 * j) as f64;
            sum += term;
        }
        s * sum
    };
    (1.0 - inside) / 2.0
}

/// `t_{nu}^{-1}(p)`, Student's t quantile for `1/2 ≤ p < 1` and integer
/// `nu ≥ 1`, by bisection on [`student_t_upper`] (monotone) to a relative
/// 1e-12.
pub fn student_t_quantile(p: f64, nu: usize) -> f64 {
    let tail = 1.0 - p;
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while student_t_upper(hi, nu) > tail {
        hi *= 2.0;
    }
    while hi - lo > 1e-12 * hi {
        let mid = 0.5 * (lo + hi);
        if student_t_upper(mid, nu) > tail {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// One tensor's recommended test bar.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToleranceRow {
    pub tensor: String,
    /// The bar: a correct kernel on a fresh input draw exceeds it with
    /// probability at most the tensor's share of the false-alarm rate.
    pub bar: f64,
    /// Median norm_ratio over every run.
    pub median: f64,
    pub max_seen: f64,
    /// The fitted spread (standard deviation) of `ln norm_ratio` of one
    /// run on a fresh draw: between draws and within one draw's ensemble.
    pub log_sd: f64,
    /// Of which between input draws (the part a test's fresh inputs face).
    pub log_sd_between: f64,
    /// Input draws and emulation runs per draw it is computed from.
    pub draws: usize,
    pub samples: usize,
}

/// Why no bar can be fitted.
fn fit_error(tensor: &str, draws: &[Vec<f64>]) -> Option<String> {
    if draws.len() < 2 {
        return Some(format!(
            "tolerance of `{tensor}`: the bar is the spread between input draws, which needs at \
             least 2 draws (8 or more for a useful bar), got {}",
            draws.len()
        ));
    }
    if draws
        .iter()
        .any(|d| d.len() != draws[0].len() || d.is_empty())
    {
        return Some(format!(
            "tolerance of `{tensor}`: every draw needs the same number (≥ 1) of runs, got {:?}",
            draws.iter().map(Vec::len).collect::<Vec<_>>()
        ));
    }
    let bad = draws
        .iter()
        .flatten()
        .find(|x| !(x.is_finite() && **x > 0.0));
    bad.map(|x| {
        format!("tolerance of `{tensor}`: a correct run's norm_ratio is {x}; expected a finite positive number")
    })
}

/// Per tensor, the bar a correct kernel on a fresh input draw exceeds with
/// probability at most `false_alarm / n` (`n` tensors: by the union bound a
/// test asserting all of them fails a correct kernel with probability at
/// most `false_alarm`).
///
/// `values`: `tensor → draws → runs`, the ensemble's norm_ratios on each of
/// `D ≥ 2` input draws (`S` runs each). A test faces a new draw, and the
/// runs of one draw are nearly identical on most tensors, so pooling them
/// as if independent would measure the within-draw spread and miss the
/// between-draw one. The fit is a one-way random-effects model on
/// `ln norm_ratio` (positive, skewed, its log close to normal across
/// draws): per-draw means `m_d`, their variance `s_m²` (which holds
/// `σ_b² + σ_w²/S`), the pooled within-draw variance `s_w²`; one fresh run
/// has variance `σ² = s_m² + (1 − 1/S)·s_w²`. The bar is the upper
/// prediction bound `exp(m̄ + t_{D−1}(1 − α)·σ·√(1 + 1/D))`, Student's t
/// with `D − 1` degrees of freedom for the between-draw spread estimated
/// from `D` numbers (the small-sample correction: few draws give wide
/// bars), never below the largest value seen, rounded up to two
/// significant digits for pasting. Tensors in name order.
pub fn tolerance(
    values: &BTreeMap<String, Vec<Vec<f64>>>,
    false_alarm: f64,
) -> Result<Vec<ToleranceRow>, String> {
    if !(false_alarm > 0.0 && false_alarm < 1.0) {
        return Err(format!(
            "--false-alarm: expected a probability in (0, 1), got {false_alarm}"
        ));
    }
    let alpha = false_alarm / values.len().max(1) as f64;
    values
        .iter()
        .map(|(t, draws)| {
            if let Some(e) = fit_error(t, draws) {
                return Err(e);
            }
            let (d, s) = (draws.len(), draws[0].len());
            let logs: Vec<Vec<f64>> = draws
                .iter()
                .map(|r| r.iter().map(|x| x.ln()).collect())
                .collect();
            let means: Vec<f64> = logs.iter().map(|l| mean(l)).collect();
            let grand = mean(&means);
            let s_m2 = sum_sq(&means, grand) / (d - 1) as f64;
            let s_w2 = if s > 1 {
                logs.iter()
                    .zip(&means)
                    .map(|(l, &m)| sum_sq(l, m))
                    .sum::<f64>()
                    / (d * (s - 1)) as f64
            } else {
                0.0
            };
            let var = s_m2 + (1.0 - 1.0 / s as f64) * s_w2;
            let k = student_t_quantile(1.0 - alpha, d - 1) * (1.0 + 1.0 / d as f64).sqrt();
            let mut all: Vec<f64> = draws.iter().flatten().copied().collect();
            all.sort_by(f64::total_cmp);
            let max_seen = all[all.len() - 1];
            Ok(ToleranceRow {
                tensor: t.clone(),
                bar: round_up_2(f64::max((grand + k * var.sqrt()).exp(), max_seen)),
                median: quantile(&all, 0.5),
                max_seen,
                log_sd: var.sqrt(),
                log_sd_between: (s_m2 - s_w2 / s as f64).max(0.0).sqrt(),
                draws: d,
                samples: s,
            })
        })
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// `Σ (v_i − m)²`.
fn sum_sq(v: &[f64], m: f64) -> f64 {
    v.iter().map(|x| (x - m) * (x - m)).sum()
}

/// `x` rounded up to two significant digits (`3.41e-3 → 3.5e-3`).
pub fn round_up_2(x: f64) -> f64 {
    if !(x.is_finite() && x > 0.0) {
        return x;
    }
    let e = x.log10().floor() - 1.0;
    let scale = 10f64.powf(e);
    let r = (x / scale).ceil() * scale;
    // Printing `r` with 2 significant digits gives back a number ≥ x.
    format!("{r:.1e}")
        .parse::<f64>()
        .map_or(r, |p| if p >= x { p } else { r })
}

/// The bars as a Python dict literal a pytest suite can paste.
pub fn python_dict(rows: &[ToleranceRow]) -> String {
    let items: Vec<String> = rows
        .iter()
        .map(|r| format!("    {:?}: {:.1e},", r.tensor, r.bar))
        .collect();
    format!("{{\n{}\n}}", items.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_between_ranks() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 1.0), 5.0);
        // 0.99 · 4 = 3.96: 4 + 0.96 · (5 − 4).
        assert!((quantile(&v, 0.99) - 4.96).abs() < 1e-12);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn normal_quantile_matches_tabulated_values() {
        // Tabulated: Φ^{-1}(0.975) = 1.959963985, Φ^{-1}(0.999) = 3.090232306,
        // Φ^{-1}(0.01) = −2.326347874, Φ^{-1}(1 − 1e-5) = 4.264890794.
        for (p, z) in [
            (0.5, 0.0),
            (0.975, 1.959963985),
            (0.999, 3.090232306),
            (0.01, -2.326347874),
            (1.0 - 1e-5, 4.264890794),
        ] {
            assert!(
                (normal_quantile(p) - z).abs() < 1e-7,
                "{p}: {}",
                normal_quantile(p)
            );
        }
    }

    #[test]
    fn student_t_quantile_matches_tabulated_values() {
        // Tabulated: t_1(0.975) = 12.7062, t_2(0.995) = 9.92484,
        // t_3(0.999) = 10.2145, t_9(0.975) = 2.26216, t_30(0.995) = 2.74999.
        for (p, nu, t) in [
            (0.975, 1, 12.7062),
            (0.995, 2, 9.92484),
            (0.999, 3, 10.2145),
            (0.975, 9, 2.26216),
            (0.995, 30, 2.74999),
        ] {
            let q = student_t_quantile(p, nu);
            assert!(
                (q / t - 1.0).abs() < 1e-5,
                "t_{nu}({p}) = {q}, tabulated {t}"
            );
        }
        assert_eq!(student_t_upper(0.0, 7), 0.5);
    }

    #[test]
    fn verdicts_place_a_value_against_the_band() {
        let row = BandRow::of(Op::Kda, "dq", &[1.0, 1.1, 1.2, 1.3, 1.4]);
        assert!(!row.noisy);
        assert_eq!(judge_one(&row, 1.2).position, Position::Inside);
        // Twice p99 is beyond p99 + one width (the width is below p99 when p1 > 0).
        let v = judge_one(&row, 2.0 * row.p99);
        assert_eq!(v.position, Position::OutAbove);
        assert!(!v.pass && v.widths > 1.0);
        let v = judge_one(&row, row.p99 + 0.5 * row.width());
        assert_eq!((v.position, v.pass), (Position::Above, true));
        assert!((v.widths - 0.5).abs() < 1e-12);
        assert_eq!(judge_one(&row, 1e-3).position, Position::FarBelow);
        assert_eq!(judge_one(&row, f64::NAN).position, Position::Nan);
        let noisy = BandRow::of(Op::Kda, "dA_log", &[0.1, 0.5, 0.9]);
        assert!(noisy.noisy);
        // A band of identical samples: the model margin on each side, judged
        // at the minimum width (0.3 · 2.3 = 0.69 > 2.3 − 1.74).
        let flat = BandRow::of(Op::Kda, "dh0", &[2.0, 2.0, 2.0]);
        assert_eq!(
            (flat.p1, flat.p99),
            (2.0 / MODEL_MARGIN, 2.0 * MODEL_MARGIN)
        );
        assert_eq!(flat.width(), MIN_REL_WIDTH * flat.p99);
        assert_eq!(judge_one(&flat, 2.2).position, Position::Inside);
        assert_eq!(judge_one(&flat, 2.5).position, Position::Above);
        assert_eq!(judge_one(&flat, 3.0).position, Position::OutAbove);
        // The margin follows the op and the tensor.
        assert_eq!(
            BandRow::of(Op::Dplr, "o", &[1.0; 3]).margin,
            MODEL_MARGIN_DPLR
        );
        assert_eq!(
            BandRow::of(Op::Kda, "ddt_bias", &[1.0; 3]).margin,
            MODEL_MARGIN_DECAY
        );
        assert_eq!(noisy.margin, MODEL_MARGIN_DECAY);
        // Far below: more than a width under p1, or a tenth of it.
        assert_eq!(judge_one(&noisy, 0.05).position, Position::Below);
        assert_eq!(judge_one(&noisy, 0.005).position, Position::FarBelow);
    }

    #[test]
    fn bars_round_up_and_cover_what_was_seen() {
        assert_eq!(round_up_2(3.41e-3), 3.5e-3);
        assert_eq!(round_up_2(3.4e-3), 3.4e-3);
        let mut v = BTreeMap::new();
        // `o`: draws agree; `dA_log`: the draws' runs agree within a draw,
        // but the draws are spread out (what a pooled fit would miss).
        v.insert(
            "o".to_string(),
            vec![
                vec![1e-3, 1.01e-3],
                vec![1.1e-3, 1.1e-3],
                vec![0.9e-3, 0.91e-3],
                vec![1.05e-3, 1.04e-3],
            ],
        );
        v.insert(
            "dA_log".to_string(),
            vec![
                vec![1e-3, 1e-3],
                vec![4e-3, 4e-3],
                vec![2e-3, 2e-3],
                vec![0.5e-3, 0.5e-3],
            ],
        );
        let rows = tolerance(&v, 1e-3).unwrap();
        let bar = |t: &str| rows.iter().find(|r| r.tensor == t).unwrap().bar;
        // Independently: ln of the draws' means and their sd, t_3(1 − 5e-4) = 12.92.
        let m: Vec<f64> = [1e-3f64, 4e-3, 2e-3, 0.5e-3]
            .iter()
            .map(|x| x.ln())
            .collect();
        let mm = m.iter().sum::<f64>() / 4.0;
        let sd = (m.iter().map(|x| (x - mm).powi(2)).sum::<f64>() / 3.0).sqrt();
        let expect = (mm + 12.924 * sd * 1.25f64.sqrt()).exp();
        assert!(
            (bar("dA_log") / expect - 1.0).abs() < 0.02,
            "{} vs {expect}",
            bar("dA_log")
        );
        assert!(bar("o") >= 1.1e-3 && bar("o") < 4e-3, "{}", bar("o"));
        assert!(tolerance(&v, 0.0).is_err());
        v.insert("dq".to_string(), vec![vec![1e-3]]);
        let e = tolerance(&v, 1e-2).unwrap_err();
        assert!(e.contains("`dq`") && e.contains("2 draws"), "{e}");
        let d = python_dict(&rows);
        assert!(
            d.starts_with('{') && d.contains("\"dA_log\": ") && d.ends_with('}'),
            "{d}"
        );
    }

    use crate::case::{Dtype, Op};
    use crate::generate::{generate, GenSpec};
    use crate::impls::{oracle_truth, Impl, ImplName};
    use deltaref::gates::Gate;
    use std::path::Path;

    /// A small bf16 KDA case (safe gate, in-kernel l2norm and gate, two
    /// sequences), drawn with `seed`.
    fn small_case(seed: u64) -> Case {
        let mut spec = GenSpec::new(Op::Kda);
        spec.shape = Some(vec![1, 96, 2, 2, 16, 16]);
        spec.lengths = Some(vec![40, 56]);
        spec.gate = Gate::LowerBound { lower_bound: -5.0 };
        spec.use_qk_l2norm_in_kernel = true;
        spec.dtype = Dtype::Bf16;
        spec.seed = seed;
        generate(&spec).unwrap()
    }

    fn fla_bf16() -> ImplRequest {
        ImplRequest {
            name: ImplName::Chunk,
            precision: Some("fla-bf16".into()),
            ..ImplRequest::default()
        }
    }

    fn resolved(case: &Case) -> (Impl, Compute) {
        let (imp, c) = fla_bf16().resolve_with_compute(case).unwrap();
        (imp, c.unwrap())
    }

    /// An emulation run with a jitter the ensemble never used.
    fn fresh_run(case: &Case, truth: &Tensors, seed: u64) -> (Tensors, BTreeMap<String, f64>) {
        let (imp, compute) = resolved(case);
        let spec = BandSpec {
            seed,
            ..BandSpec::default()
        };
        let got = imp
            .jittered(spec.jitter_of(0))
            .compute(case, compute)
            .unwrap();
        let r = ratios(truth, &got);
        (got, r)
    }

    #[test]
    fn a_zero_jitter_changes_no_bit_and_a_band_repeats_on_one_thread() {
        let case = small_case(1);
        let (imp, compute) = resolved(&case);
        let plain = imp.compute(&case, compute).unwrap();
        let zero = Jitter { seed: 5, rel: 0.0 };
        assert_eq!(imp.jittered(zero).compute(&case, compute).unwrap(), plain);
        let moved = imp
            .jittered(BandSpec::default().jitter_of(0))
            .compute(&case, compute)
            .unwrap();
        assert_ne!(moved, plain, "a jitter of 2^-20 moves some bf16 store");
        let truth = oracle_truth(&case, Path::new("small")).unwrap();
        let spec = BandSpec {
            samples: 6,
            ..BandSpec::default()
        };
        let band = |c: &Case| {
            of_case(c, Path::new("small"), &truth, &fla_bf16(), &spec)
                .unwrap()
                .rows
        };
        let many = band(&case);
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| band(&case));
        assert_eq!(many, one, "the same bits whatever the thread count");
    }

    #[test]
    fn another_seed_lands_inside_the_band_and_a_planted_fault_only_where_planted() {
        let case = small_case(2);
        let truth = oracle_truth(&case, Path::new("small")).unwrap();
        let spec = BandSpec::default();
        let band = of_case(&case, Path::new("small"), &truth, &fla_bf16(), &spec).unwrap();
        assert!(band.rows.len() >= 9, "{band}");
        let (got, r) = fresh_run(&case, &truth, 12345);
        let verdicts = judge(&band, &r);
        assert_eq!(verdicts.len(), band.rows.len());
        for v in &verdicts {
            assert!(
                v.pass && v.position != Position::FarBelow,
                "{}",
                verdict_table(&verdicts)
            );
        }
        // The same run with dq's error scaled to twice the band's p99.
        for tensor in ["dq", "dA_log"] {
            let row = band.row(tensor).unwrap();
            let k = 2.0 * row.p99 / r[tensor];
            let mut faulty = got.clone();
            let t = &truth[tensor];
            faulty.insert(tensor.to_string(), t + &((&got[tensor] - t) * k));
            let verdicts = judge(&band, &ratios(&truth, &faulty));
            for v in &verdicts {
                let planted = v.tensor == tensor;
                assert_eq!(v.pass, !planted, "{tensor}: {}", verdict_table(&verdicts));
                if planted {
                    assert_eq!(v.position, Position::OutAbove);
                    assert!((v.norm_ratio / row.p99 - 2.0).abs() < 1e-9);
                }
            }
        }
        // A far more accurate candidate (the f64 chunked engine) is reported far below.
        let exact = Impl::chunk(64)
            .unwrap()
            .compute(&case, Compute::F64)
            .unwrap();
        let verdicts = judge(&band, &ratios(&truth, &exact));
        assert!(verdicts
            .iter()
            .all(|v| v.position == Position::FarBelow && v.pass));
    }

    /// The bars from 10 input draws × 4 runs at false-alarm 1e-2 pass a
    /// fresh correct run (unseen inputs, unseen jitter) in ≥ 98 of 100
    /// draws. (A fit pooling draws × runs as if independent passed 58: the
    /// runs of one draw nearly agree, so it missed the between-draw spread.)
    #[test]
    fn tolerance_bars_pass_fresh_correct_runs() {
        let spec = BandSpec {
            samples: 4,
            ..BandSpec::default()
        };
        let mut per_draw: BTreeMap<String, Vec<Vec<f64>>> = BTreeMap::new();
        for seed in 0..10 {
            let case = small_case(seed);
            let truth = oracle_truth(&case, Path::new("draw")).unwrap();
            let (samples, _) =
                samples_of_case(&case, Path::new("draw"), &truth, &fla_bf16(), &spec).unwrap();
            for (t, v) in per_tensor(&samples) {
                per_draw.entry(t).or_default().push(v);
            }
        }
        let bars = tolerance(&per_draw, 1e-2).unwrap();
        // 100 fresh draws (unseen inputs, unseen jitter), each one test:
        // passes when every tensor is under its bar (FLA's assert_close).
        let passed = (1000..1100u64)
            .into_par_iter()
            .filter(|&seed| {
                let case = small_case(seed);
                let truth = oracle_truth(&case, Path::new("fresh")).unwrap();
                let (_, r) = fresh_run(&case, &truth, seed);
                bars.iter().all(|b| r[&b.tensor] < b.bar)
            })
            .count();
        eprintln!(
            "{passed} of 100 fresh correct runs pass; {}",
            python_dict(&bars)
        );
        assert!(
            passed >= 98,
            "{passed} of 100 fresh correct runs pass: {bars:?}"
        );
    }

    #[test]
    fn sample_jitters_differ_and_repeat() {
        let s = BandSpec::default();
        assert_ne!(s.jitter_of(0).seed, s.jitter_of(1).seed);
        assert_eq!(s.jitter_of(3), s.jitter_of(3));
        assert!(BandSpec { samples: 1, ..s }.check().is_err());
        assert!(BandSpec { jitter: 0.1, ..s }.check().is_err());
        assert!(s.check().is_ok());
    }
}
