//! Precision emulation: the storage dtype of each stage a kernel writes to
//! memory, and the arithmetic variants kernels use (exp2, the safe-gate
//! midpoint factorisation). The exact policy changes nothing; presets mirror
//! FLA's kernels and the known failure modes of SPEC §9.

use ndarray::{ArrayBase, DataMut, Dimension};

use crate::dtype::Dtype;
use crate::scalar::Scalar;

// How a stage stores a value: a public type without a public path (see the module).
mod store;
pub(crate) use store::Store;

/// The stages a chunked/CP kernel stores (FLA's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// The inputs themselves (q, k, v, g, beta, …) as the kernel reads them.
    Inputs,
    /// Γ, the in-chunk cumulative log-decay.
    GCumsum,
    /// The WY inverse as FLA stores it (its `Akk`): `(I + L)^{-1}`, before
    /// β is applied (DPLR: `P = (I − Aab)^{-1}`).
    Akk,
    Aqk,
    W,
    U,
    /// `qg`, `kg`.
    Gated,
    /// `h`, the state entering each chunk.
    H,
    VNew,
    /// The CP transition chain `M` as it is accumulated.
    MChain,
    SExt,
    /// The merged CP initial state.
    Merged,
    /// State gradients `dh`.
    Dh,
    Dv,
    /// The pre-processing outputs the kernels read: q/k after the in-kernel
    /// l2norm and β after the in-kernel sigmoid (FLA's `l2norm_fwd` and
    /// `fused_beta_sigmoid` return the input dtype).
    Activations,
    /// The backward's low-precision `tl.dot` operands that are not stored
    /// tensors: `Aqkᵀ·do` before the state pass adds to it, `−dw`,
    /// `k ⊙ exp(Γ)` and the masked `dAkk` between the two products with
    /// `Akk`, the products `h·dh` of the decay gradient (FLA
    /// `chunk_kda_bwd_kernel_wy_dqkg_fused`); DPLR: the gated tensors'
    /// gradients `dqg`, `dkg`, `dbg`, `dw`, `dag` (`chunk_dplr_bwd_o`,
    /// `chunk_dplr_bwd_wy`).
    BwdOperands,
    /// `β k` before the decay multiplies it in `w`'s operand: with bf16 `β`
    /// (the input itself; the in-kernel sigmoid returns fp32) `b_k * b_b`
    /// multiplies two bf16 tensors and rounds to bf16 (`recompute_w_u_fwd`).
    KBeta,
    /// `β k` as the intra-chunk backward's column side reads it: `b_k * b_b`
    /// of two bf16 tensors, rounded to bf16, times `dAkk` in `∂/∂k` of every
    /// earlier row of the chunk (between 16-token sub-chunks, and inside one
    /// with safe_gate; `chunk_kda_bwd_kernel_intra`).
    KBetaBwd,
    /// The fp32 `tl.dot` operands of the forward's intra-chunk blocks
    /// (`Aqk` and `L`, the `Akk` before the solve) between different 16-token
    /// sub-chunks — q/k gated to the first row of the row's sub-chunk — and,
    /// with safe_gate, inside one (gated to its anchor), which Triton's
    /// default input precision rounds to tf32
    /// (`chunk_kda_fwd_kernel_inter_solve_fused`,
    /// `chunk_kda_fwd_kernel_intra_sub_chunk`).
    FwdDots,
    /// The sums `Σ_v h·dh` of the decay gradient: FLA's `tl.sum(b_h * b_dh,
    /// axis=0)` reduces bf16 products in bf16 (Triton's `tl.sum` keeps a
    /// float input's dtype) over each block of 64 values (`BV`), 8 lanes of
    /// 8 values ([`Dtype::lane_sum`]); the blocks then add into an fp32
    /// accumulator (`chunk_kda_bwd_kernel_wy_dqkg_fused`).
    HdhSum,
    /// The fp32 `tl.dot` operands between different 16-token sub-chunks of
    /// the intra-chunk backward (`chunk_kda_bwd_kernel_intra`: `dAqk`,
    /// `dAkk` and the gated q/k), which Triton's default input precision
    /// rounds to tf32.
    IntraDots,
    /// The results handed back to the caller: `o` and the per-token
    /// gradients in the token dtype (`o.type_as(q)`, `dq.to(q)`, …);
    /// `final_state`, `dh0`, `dA_log`, `ddt_bias` stay fp32.
    Outputs,
    /// The gate input alone (`g`, DPLR's `gk`) stored in its own dtype and
    /// cast to fp32 in the kernel (e.g. `g` kept in fp16 while the other
    /// inputs are bf16); it replaces [`Stage::Inputs`] for the gate.
    GateInput,
}

impl Stage {
    pub const ALL: [Stage; 23] = [
        Stage::Inputs,
        Stage::GCumsum,
        Stage::Akk,
        Stage::Aqk,
        Stage::W,
        Stage::U,
        Stage::Gated,
        Stage::H,
        Stage::VNew,
        Stage::MChain,
        Stage::SExt,
        Stage::Merged,
        Stage::Dh,
        Stage::Dv,
        Stage::Activations,
        Stage::KBeta,
        Stage::KBetaBwd,
        Stage::FwdDots,
        Stage::BwdOperands,
        Stage::HdhSum,
        Stage::IntraDots,
        Stage::Outputs,
        Stage::GateInput,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Inputs => "inputs",
            Stage::GateInput => "g",
            Stage::GCumsum => "g_cumsum",
            Stage::Akk => "Akk",
            Stage::Aqk => "Aqk",
            Stage::W => "w",
            Stage::U => "u",
            Stage::Gated => "qg/kg",
            Stage::H => "h",
            Stage::VNew => "v_new",
            Stage::MChain => "M",
            Stage::SExt => "S_ext",
            Stage::Merged => "merged",
            Stage::Dh => "dh",
            Stage::Dv => "dv",
            Stage::Activations => "activations",
            Stage::KBeta => "k-beta",
            Stage::KBetaBwd => "k-beta-bwd",
            Stage::FwdDots => "fwd-dots",
            Stage::BwdOperands => "bwd-operands",
            Stage::HdhSum => "hdh-sum",
            Stage::IntraDots => "intra-dots",
            Stage::Outputs => "outputs",
        }
    }

    pub fn parse(s: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|st| st.name() == s)
    }
}

/// One thing a policy asks of an engine: a stage rounded, or an arithmetic
/// variant. Engines declare the features they implement; a policy asking
/// for one the engine lacks is refused rather than silently ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Feature {
    Round(Stage),
    /// `exp` as `exp2(x·log2 e)`.
    Exp2,
    /// The safe-gate sub-chunk factorisation of `exp(Γ_r − Γ_c)`.
    SafeGate,
    /// FLA #1085 as a fault: the safe-gate midpoint offset read with a token
    /// stride of `K` instead of `H·K` ([`Policy::midpoint_stride_fault`]).
    MidpointStride,
}

impl Feature {
    pub fn name(self) -> &'static str {
        match self {
            Feature::Round(s) => s.name(),
            Feature::Exp2 => "exp2",
            Feature::SafeGate => "safe-gate",
            Feature::MidpointStride => "midpoint-stride",
        }
    }
}

/// Where rounding happens and which arithmetic variants are used.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Storage dtype per stage (`None`: kept in the compute scalar).
    pub stages: Vec<(Stage, Dtype)>,
    /// `exp(x)` as `exp2(x·log2 e)` (FLA's kernels work in base 2).
    pub exp2: bool,
    /// `exp(Γ_r − Γ_c)` factored through the midpoint of each 16-token
    /// sub-chunk (FLA `safe_gate`).
    pub safe_gate_midpoint: bool,
    /// DPLR's `lower_bound` without `safe_gate`: FLA turns its safe-gate
    /// scheme on by itself at the chunk sizes where
    /// `gate_bound_is_safe(bound, chunk_size)` holds, so the engine (which
    /// knows its chunk size) resolves it ([`Policy::safe_gate_at`]).
    pub safe_gate_bound: Option<f64>,
    /// FLA #1085 (a fault, DPLR): under the safe gate, each chunk's midpoint
    /// offset read with a token stride of `K` instead of `H·K`, i.e. from the
    /// row `i_h + i_t·BT + mid` of the flattened `[T·H, K]` gate cumsum (another
    /// token's, another head's, when H > 1).
    pub midpoint_stride_fault: bool,
    /// One member of the ensemble of equally correct kernels (`None`: the
    /// emulation's own fp32 values are stored): see [`Jitter`].
    pub jitter: Option<Jitter>,
}

/// What a correct kernel with the same storage points is free to differ in:
/// the fp32 value it holds just before a store. Its reductions (`tl.dot`
/// on tensor cores, `tl.sum`, split-K state passes, atomic adds) add in an
/// order and with an internal alignment the emulation does not reproduce,
/// and its `exp2` is an approximation (`ex2.approx`), so its pre-store value
/// differs from the emulation's in the last fp32 bits. A jittered store
/// first moves the value by a relative amount drawn uniformly from
/// `[-rel, rel)` and then rounds it to the stage's storage, round to
/// nearest even as the kernel does: a value near a rounding boundary rounds
/// either way, and the differences grow through everything downstream.
///
/// The draw is a hash of `(seed, stage, the value's bits)`, not a stream:
/// a run stays deterministic for its seed and independent of the thread
/// count (no shared state), and equal values of one stage move alike.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Jitter {
    pub seed: u64,
    /// The largest relative move (e.g. `2^-21`: 4 fp32 ulps at the top of a binade).
    pub rel: f64,
}

/// SplitMix64's finaliser: a well-mixed 64-bit function of a 64-bit input.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Jitter {
    /// `x · (1 + rel·u)`, `u ∈ [-1, 1)` drawn from `(seed, stage, x)`.
    pub fn apply(self, stage: Stage, x: f64) -> f64 {
        let h = mix64(self.seed ^ mix64((stage as u64) << 56 ^ x.to_bits()));
        // The top 53 bits as a uniform [0, 1), then [-1, 1).
        let u = (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64) * 2.0 - 1.0;
        x * (1.0 + self.rel * u)
    }
}

impl Store {
    /// A plain store to `dtype` (no jitter).
    pub fn plain(stage: Stage, dtype: Dtype) -> Store {
        Store {
            dtype,
            stage,
            jitter: None,
        }
    }

    /// `x` as this store writes it.
    pub fn round<T: Scalar>(self, x: T) -> T {
        match (self.dtype, self.jitter) {
            (Dtype::F64, _) => x,
            (d, None) => d.round(x),
            (d, Some(j)) => T::c(d.round_f64(j.apply(self.stage, x.f64()))),
        }
    }

    /// [`Dtype::lane_sum`] with every partial sum stored by this store.
    pub fn lane_sum<T: Scalar>(self, xs: &[T], per_lane: usize) -> T {
        crate::dtype::lane_sum_with(xs, per_lane, |x| self.round(x))
    }
}

impl Default for Policy {
    fn default() -> Self {
        Policy::exact()
    }
}

/// FLA's bf16 kernels' base policy: bf16 inputs, then `stages` in order,
/// then (`cp`) the context-parallel quantities in fp32 (the `M` chain
/// accumulates in fp32, `S_ext` and the merged state are fp32). The
/// operator adds its own variants (exp2, the safe gate, the outputs).
pub(crate) fn fla_bf16(stages: &[(Stage, Dtype)], cp: bool) -> Policy {
    let mut p = Policy::exact().with(Stage::Inputs, Dtype::Bf16);
    for &(s, d) in stages {
        p = p.with(s, d);
    }
    if cp {
        for s in [Stage::MChain, Stage::SExt, Stage::Merged] {
            p = p.with(s, Dtype::F32);
        }
    }
    p
}

impl Policy {
    /// No rounding, plain exp: the oracle.
    pub fn exact() -> Self {
        Policy {
            stages: vec![],
            exp2: false,
            safe_gate_midpoint: false,
            safe_gate_bound: None,
            midpoint_stride_fault: false,
            jitter: None,
        }
    }

    /// Whether the safe-gate midpoint scheme applies at `chunk_size`: asked
    /// for outright, or licensed by a [`Policy::safe_gate_bound`] that FLA's
    /// `gate_bound_is_safe` accepts at this chunk size.
    pub fn safe_gate_at(&self, chunk_size: usize) -> bool {
        self.safe_gate_midpoint
            || self
                .safe_gate_bound
                .is_some_and(|lb| crate::gates::gate_bound_is_safe(lb, chunk_size))
    }

    /// The same policy with the safe-gate midpoint scheme on or off
    /// (`--precision …,midpoint=on|off`): off also drops a bound's license.
    pub fn with_midpoint(mut self, on: bool) -> Self {
        self.safe_gate_midpoint = on;
        if !on {
            self.safe_gate_bound = None;
        }
        self
    }

    /// The same policy as one member of the ensemble of correct kernels.
    pub fn jittered(mut self, jitter: Jitter) -> Self {
        self.jitter = Some(jitter);
        self
    }

    /// How `stage` stores a value (`None`: kept in the compute scalar).
    pub fn store(&self, stage: Stage) -> Option<Store> {
        self.storage(stage)
            .filter(|s| *s != Dtype::F64)
            .map(|dtype| Store {
                dtype,
                stage,
                jitter: self.jitter,
            })
    }

    pub fn is_exact(&self) -> bool {
        self.stages.iter().all(|(_, s)| *s == Dtype::F64)
            && !self.exp2
            && !self.safe_gate_midpoint
            && self.safe_gate_bound.is_none()
            && !self.midpoint_stride_fault
    }

    /// What this policy asks of an engine: every stage with a storage other
    /// than f64, then the arithmetic variants, in [`Stage::ALL`] order.
    pub fn features(&self) -> Vec<Feature> {
        let mut f: Vec<Feature> = Stage::ALL
            .into_iter()
            .filter(|s| self.storage(*s).is_some_and(|d| d != Dtype::F64))
            .map(Feature::Round)
            .collect();
        f.extend(self.exp2.then_some(Feature::Exp2));
        let safe = self.safe_gate_midpoint || self.safe_gate_bound.is_some();
        f.extend(safe.then_some(Feature::SafeGate));
        f.extend(
            self.midpoint_stride_fault
                .then_some(Feature::MidpointStride),
        );
        f
    }

    /// The same policy with `feature` made exact (its stage kept in the
    /// compute scalar, or the variant off).
    pub fn without(&self, feature: Feature) -> Policy {
        let mut p = self.clone();
        match feature {
            Feature::Round(s) => p.stages.retain(|(st, _)| *st != s),
            Feature::Exp2 => p.exp2 = false,
            Feature::SafeGate => p = p.with_midpoint(false),
            Feature::MidpointStride => p.midpoint_stride_fault = false,
        }
        p
    }

    /// Only `feature` of this policy (everything else exact).
    pub fn only(&self, feature: Feature) -> Policy {
        let mut p = Policy::exact();
        match feature {
            Feature::Round(s) => {
                p.stages = self
                    .stages
                    .iter()
                    .filter(|(st, _)| *st == s)
                    .copied()
                    .collect()
            }
            Feature::Exp2 => p.exp2 = self.exp2,
            Feature::SafeGate => {
                p.safe_gate_midpoint = self.safe_gate_midpoint;
                p.safe_gate_bound = self.safe_gate_bound;
            }
            Feature::MidpointStride => p.midpoint_stride_fault = self.midpoint_stride_fault,
        }
        p
    }

    pub fn storage(&self, stage: Stage) -> Option<Dtype> {
        self.stages
            .iter()
            .rev()
            .find(|(s, _)| *s == stage)
            .map(|(_, d)| *d)
    }

    /// Sets (or overrides) one stage's storage.
    pub fn with(mut self, stage: Stage, storage: Dtype) -> Self {
        self.stages.push((stage, storage));
        self
    }

    /// Rounds `a` in place to `stage`'s storage.
    pub fn round<T: Scalar, S: DataMut<Elem = T>, D: Dimension>(
        &self,
        stage: Stage,
        a: &mut ArrayBase<S, D>,
    ) {
        if let Some(s) = self.store(stage) {
            a.mapv_inplace(|x| s.round(x));
        }
    }

    /// `a` as `stage` stores it: borrowed where the stage keeps the compute
    /// scalar, else a rounded copy.
    pub fn stored<'a, T: Scalar>(
        &self,
        stage: Stage,
        a: ndarray::ArrayView2<'a, T>,
    ) -> ndarray::CowArray<'a, T, ndarray::Ix2> {
        if self.storage(stage).is_some_and(|s| s != Dtype::F64) {
            let mut owned = a.to_owned();
            self.round(stage, &mut owned);
            owned.into()
        } else {
            a.into()
        }
    }

    /// The in-chunk cumulative sum of `g [c, K]` down the rows, in place;
    /// with a [`Stage::GCumsum`] storage every partial sum is rounded to it,
    /// as a kernel accumulating in that dtype does (`tl.cumsum` in fp32).
    pub fn cumsum_rows<T: Scalar>(&self, g: &mut ndarray::Array2<T>) {
        match self.store(Stage::GCumsum) {
            Some(s) => {
                g.mapv_inplace(|x| s.round(x));
                g.accumulate_axis_inplace(ndarray::Axis(0), |&prev, cur| {
                    *cur = s.round(*cur + prev)
                });
            }
            None => crate::fast::fused::cumsum_rows(g),
        }
    }

    /// `exp(x)`, in base 2 when the policy says so.
    pub fn exp<T: Scalar>(&self, x: T) -> T {
        if self.exp2 {
            (x * T::c(std::f64::consts::LOG2_E)).exp2()
        } else {
            x.exp()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cumsum_rounds_every_partial_sum_to_the_stage_storage() {
        let g = ndarray::arr2(&[[1.0f64], [1e-9], [1e-9], [0.5]]);
        let mut exact = g.clone();
        Policy::exact().cumsum_rows(&mut exact);
        let (a, b) = (1.0 + 1e-9, 1.0 + 1e-9 + 1e-9);
        assert_eq!(exact, ndarray::arr2(&[[1.0], [a], [b], [b + 0.5]]));
        // Each column on its own, several columns wide.
        let wide = ndarray::Array2::from_shape_fn((5, 3), |(r, c)| (r * 3 + c) as f64 * 0.1 - 0.35);
        let mut summed = wide.clone();
        Policy::exact().cumsum_rows(&mut summed);
        for c in 0..3 {
            let mut acc = 0.0;
            for r in 0..5 {
                acc = if r == 0 {
                    wide[[0, c]]
                } else {
                    acc + wide[[r, c]]
                };
                assert_eq!(summed[[r, c]], acc, "{r} {c}");
            }
        }
        // In f32 each 1e-9 step is lost against 1.
        let mut f32_ = g.clone();
        Policy::exact()
            .with(Stage::GCumsum, Dtype::F32)
            .cumsum_rows(&mut f32_);
        assert_eq!(f32_, ndarray::arr2(&[[1.0], [1.0], [1.0], [1.5]]));
        // With 2 mantissa bits 1 + 0.125 ties to 1 at every step, so the
        // sum stays 1; rounding only the exact sums would give 1.25 last.
        let mut coarse = ndarray::arr2(&[[1.0f64], [0.125], [0.125]]);
        Policy::exact()
            .with(Stage::GCumsum, Dtype::E5m2)
            .cumsum_rows(&mut coarse);
        assert_eq!(coarse, ndarray::arr2(&[[1.0], [1.0], [1.0]]));
    }

    #[test]
    fn exact_policy_is_the_identity() {
        let p = Policy::exact();
        let mut a = ndarray::arr1(&[0.1f64, 1.0 / 3.0]);
        let b = a.clone();
        p.round(Stage::Akk, &mut a);
        assert_eq!(a, b);
        assert_eq!(p.exp(0.7f64), 0.7f64.exp());
        let q = Policy::exact().with(Stage::Akk, Dtype::Bf16);
        q.round(Stage::Akk, &mut a);
        assert_eq!(a[1], half::bf16::from_f64(1.0 / 3.0).to_f64());
        assert!(!q.is_exact());
    }
}
