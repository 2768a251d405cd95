//! What `deltaref bench` needs from the engines to turn its timings into
//! GFLOP/s (its operation counts and the machine's peak live in the verify
//! crate, `deltaref_verify::bench::op_count`): how much of a full product
//! the chunked engines' blocked triangular products do, and the product
//! kernel the peak is measured with.

use ndarray::{Array2, ArrayView2};

/// Work of the chunked engines' blocked product with a lower triangular
/// `[c, c]` factor (or of which only the lower triangle is used) relative
/// to the full product: `(nb + 1) / (2 nb)` for `nb` blocks of 16 rows.
pub fn triangular_fraction(c: usize) -> f64 {
    crate::fast::tri::fraction(c)
}

/// [`triangular_fraction`] where both `[c, c]` factors are lower
/// triangular: `(nb + 1)(2 nb + 1) / (6 nb²)`.
pub fn triangular_fraction_both(c: usize) -> f64 {
    crate::fast::tri::fraction_both(c)
}

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
