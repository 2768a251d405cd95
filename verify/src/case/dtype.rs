//! The storage dtypes of a case's float tensors: the oracle's [`Dtype`]
//! restricted to [`Dtype::CASE_FILE`], and their safetensors encoding.

use deltaref::dtype::{to_bf16, to_f16};
use deltaref::Dtype;
use ndarray::ArrayD;
use safetensors::tensor::Dtype as StDtype;

/// The safetensors dtype `d` is stored as; an error naming `tensor` for a
/// dtype a case file cannot hold (tf32, e5m2).
pub(super) fn st(tensor: &str, d: Dtype) -> Result<StDtype, String> {
    match d.require(&format!("tensor `{tensor}`"), &Dtype::CASE_FILE)? {
        Dtype::F64 => Ok(StDtype::F64),
        Dtype::F32 => Ok(StDtype::F32),
        Dtype::Bf16 => Ok(StDtype::BF16),
        _ => Ok(StDtype::F16),
    }
}

/// Bytes per element stored in `d`: its safetensors dtype's (`st`);
/// f64's for a dtype a case file cannot hold, which `st` refuses where
/// a tensor is written.
pub fn stored_width(d: Dtype) -> usize {
    st("", d).map_or(8, |s| s.bitsize() / 8)
}

/// `x`'s little-endian bytes in `d`, one of [`Dtype::CASE_FILE`] (checked by [`st`]).
pub(super) fn encode(d: Dtype, x: &ArrayD<f64>) -> Vec<u8> {
    let it = x.iter().copied();
    // Sized up front: a growing buffer would hold up to twice the tensor's
    // bytes, and three times while a reallocation copies it.
    let mut out = Vec::with_capacity(x.len() * stored_width(d));
    match d {
        Dtype::F64 => out.extend(it.flat_map(f64::to_le_bytes)),
        Dtype::Bf16 => out.extend(it.flat_map(|v| to_bf16(v).to_le_bytes())),
        Dtype::F16 => out.extend(it.flat_map(|v| to_f16(v).to_le_bytes())),
        _ => out.extend(it.flat_map(|v| (v as f32).to_le_bytes())),
    }
    out
}
