//! Precision emulation: the storage dtype of each stage a kernel writes to
//! memory, and the arithmetic variants kernels use (exp2, the safe-gate
//! midpoint factorisation). The exact policy changes nothing; presets mirror
//! FLA's kernels and the known failure modes of SPEC §9.

use half::{bf16, f16};
use ndarray::{ArrayBase, DataMut, Dimension};

use crate::scalar::Scalar;

/// A storage dtype; values are rounded to it (round to nearest even).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F64,
    F32,
    Bf16,
    F16,
    /// TF32: 10 explicit mantissa bits (a tensor-core input rounding).
    Tf32,
}

impl Storage {
    pub fn parse(s: &str) -> Option<Storage> {
        match s {
            "f64" => Some(Storage::F64),
            "f32" => Some(Storage::F32),
            "bf16" => Some(Storage::Bf16),
            "f16" => Some(Storage::F16),
            "tf32" => Some(Storage::Tf32),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Storage::F64 => "f64",
            Storage::F32 => "f32",
            Storage::Bf16 => "bf16",
            Storage::F16 => "f16",
            Storage::Tf32 => "tf32",
        }
    }

    pub fn round_f64(self, x: f64) -> f64 {
        match self {
            Storage::F64 => x,
            Storage::F32 => x as f32 as f64,
            Storage::Bf16 => bf16::from_f64(x).to_f64(),
            Storage::F16 => f16::from_f64(x).to_f64(),
            Storage::Tf32 => {
                // Round f32's 23-bit mantissa to 10 bits, nearest even.
                let b = (x as f32).to_bits();
                let lsb = (b >> 13) & 1;
                f32::from_bits((b.wrapping_add(0x0FFF + lsb)) & !0x1FFF) as f64
            }
        }
    }

    pub fn round<T: Scalar>(self, x: T) -> T {
        match self {
            Storage::F64 => x,
            _ => T::c(self.round_f64(x.f64())),
        }
    }
}

/// The stages a chunked/CP kernel stores (FLA's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// The inputs themselves (q, k, v, g, beta, …) as the kernel reads them.
    Inputs,
    /// Γ, the in-chunk cumulative log-decay.
    GCumsum,
    /// The WY inverse `Akk` (`Tm = (I + L)^{-1} Diag(β)`).
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
}

impl Stage {
    pub const ALL: [Stage; 14] = [
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
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Inputs => "inputs",
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
        }
    }
}

/// Where rounding happens and which arithmetic variants are used.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Storage per stage (`None`: kept in the compute scalar).
    pub stages: Vec<(Stage, Storage)>,
    /// `exp(x)` as `exp2(x·log2 e)` (FLA's kernels work in base 2).
    pub exp2: bool,
    /// `exp(Γ_r − Γ_c)` factored through the midpoint of each 16-token
    /// sub-chunk (FLA `safe_gate`).
    pub safe_gate_midpoint: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy::exact()
    }
}

impl Policy {
    /// No rounding, plain exp: the oracle.
    pub fn exact() -> Self {
        Policy {
            stages: vec![],
            exp2: false,
            safe_gate_midpoint: false,
        }
    }

    pub fn is_exact(&self) -> bool {
        self.stages.iter().all(|(_, s)| *s == Storage::F64)
            && !self.exp2
            && !self.safe_gate_midpoint
    }

    pub fn storage(&self, stage: Stage) -> Option<Storage> {
        self.stages
            .iter()
            .rev()
            .find(|(s, _)| *s == stage)
            .map(|(_, d)| *d)
    }

    /// Sets (or overrides) one stage's storage.
    pub fn with(mut self, stage: Stage, storage: Storage) -> Self {
        self.stages.push((stage, storage));
        self
    }

    /// Rounds `a` in place to `stage`'s storage.
    pub fn round<T: Scalar, S: DataMut<Elem = T>, D: Dimension>(
        &self,
        stage: Stage,
        a: &mut ArrayBase<S, D>,
    ) {
        if let Some(s) = self.storage(stage).filter(|s| *s != Storage::F64) {
            a.mapv_inplace(|x| s.round(x));
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
    fn storage_rounding_matches_half_and_tf32_keeps_10_bits() {
        let x = 1.0 + 2f64.powi(-12) + 2f64.powi(-20);
        assert_eq!(Storage::Bf16.round_f64(x), 1.0);
        assert_eq!(Storage::F16.round_f64(x), 1.0);
        assert_eq!(Storage::F32.round_f64(x), x);
        // TF32 keeps 10 mantissa bits: 1 + 2^-10 survives, 1 + 2^-12 does not.
        assert_eq!(
            Storage::Tf32.round_f64(1.0 + 2f64.powi(-10)),
            1.0 + 2f64.powi(-10)
        );
        assert_eq!(Storage::Tf32.round_f64(1.0 + 2f64.powi(-12)), 1.0);
        // Ties go to even: 1 + 2^-11 (halfway) rounds down to 1.
        assert_eq!(Storage::Tf32.round_f64(1.0 + 2f64.powi(-11)), 1.0);
        assert_eq!(
            Storage::Tf32.round_f64(1.0 + 3.0 * 2f64.powi(-11)),
            1.0 + 2f64.powi(-9)
        );
    }

    #[test]
    fn exact_policy_is_the_identity() {
        let p = Policy::exact();
        let mut a = ndarray::arr1(&[0.1f64, 1.0 / 3.0]);
        let b = a.clone();
        p.round(Stage::Akk, &mut a);
        assert_eq!(a, b);
        assert_eq!(p.exp(0.7f64), 0.7f64.exp());
        let q = Policy::exact().with(Stage::Akk, Storage::Bf16);
        q.round(Stage::Akk, &mut a);
        assert_eq!(a[1], bf16::from_f64(1.0 / 3.0).to_f64());
        assert!(!q.is_exact());
    }
}
