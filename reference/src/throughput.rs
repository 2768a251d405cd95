//! What `deltaref bench` needs from the engines to turn its timings into
//! GFLOP/s (its operation counts and the machine's peak live in the verify
//! crate, `deltaref_verify::bench::op_count`): the product kernel the peak
//! is measured with, and the vector width it runs at.

use ndarray::{Array2, ArrayView2};

/// `a b` for `a [M, P]` and `b [P, N]` by the engines' product kernel and
/// blocking, at the vector width the engines run at, with a separate
/// multiply and add per term (two roundings) where the engines fuse them:
/// the kernel that measures the machine's mul+add throughput without FMA.
/// Returns `[M, N]`.
pub fn unfused_dot(a: ArrayView2<f64>, b: ArrayView2<f64>) -> Array2<f64> {
    crate::fast::gemm::dot_unfused(a, b)
}

/// The vector instructions the engines run with: `"AVX-512"`, `"AVX2"` or
/// `"baseline"` (the CPU's widest, capped by `DELTAREF_NO_AVX512` and
/// `DELTAREF_NO_SIMD`).
pub fn vector_width() -> &'static str {
    crate::fast::simd::width().name()
}
