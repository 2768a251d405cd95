//! The storage dtypes of a case's float tensors.

use half::{bf16, f16};
use ndarray::ArrayD;
use safetensors::tensor::Dtype as StDtype;

/// Storage dtypes a case may use for float tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F64,
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn parse(s: &str) -> Option<Dtype> {
        match s {
            "f64" | "float64" => Some(Dtype::F64),
            "f32" | "float32" => Some(Dtype::F32),
            "bf16" | "bfloat16" => Some(Dtype::Bf16),
            "f16" | "float16" => Some(Dtype::F16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "f64",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Rounds an f64 to this dtype (round to nearest even) and back.
    pub fn round(self, x: f64) -> f64 {
        match self {
            Dtype::F64 => x,
            Dtype::F32 => x as f32 as f64,
            Dtype::Bf16 => bf16::from_f64(x).to_f64(),
            Dtype::F16 => f16::from_f64(x).to_f64(),
        }
    }

    pub(super) fn st(self) -> StDtype {
        match self {
            Dtype::F64 => StDtype::F64,
            Dtype::F32 => StDtype::F32,
            Dtype::Bf16 => StDtype::BF16,
            Dtype::F16 => StDtype::F16,
        }
    }

    pub(super) fn encode(self, x: &ArrayD<f64>) -> Vec<u8> {
        let it = x.iter().copied();
        match self {
            Dtype::F64 => it.flat_map(f64::to_le_bytes).collect(),
            Dtype::F32 => it.flat_map(|v| (v as f32).to_le_bytes()).collect(),
            Dtype::Bf16 => it.flat_map(|v| bf16::from_f64(v).to_le_bytes()).collect(),
            Dtype::F16 => it.flat_map(|v| f16::from_f64(v).to_le_bytes()).collect(),
        }
    }
}
