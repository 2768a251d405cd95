//! Multiply and add counts of the engines, for `deltaref bench`'s GFLOP/s.
//!
//! Each count is the number of scalar multiplies, adds and subtracts the
//! engine's code performs (a mul+add pair is 2 ops; exponentials, divisions
//! and square roots are not counted), for the forward and for what the
//! backward adds to it in one forward+backward run
//! ([`deltaref::op::forward_backward`], which `deltaref verify` and `bench`
//! use). Only the terms that grow with the
//! problem are kept: `K·V` per token for the naive forms; `C·K·V`, `C²·K`,
//! `C²·V`, `C³` and the larger `K·V` and `C·K` terms per chunk of `C` tokens
//! for the chunked forms; a matrix product `[m, n]·[n, p]` is `2·m·n·p`.
//! Gates, norms and `O(K + V)` work per token are left out. The test
//! `verify/tests/op_count.rs` checks these against engines run on a scalar
//! that counts its own operations.

use deltaref::throughput::unfused_dot;

/// Rows per block of the chunked engines' triangular products: the blocks
/// wholly above the diagonal are skipped (`verify/tests/op_count.rs` holds
/// the counts built on it against the engines' own operation counts).
const TRI_BLOCK: usize = 16;

/// Work of the chunked engines' blocked product with a lower triangular
/// `[c, c]` factor (or of which only the lower triangle is used) relative
/// to the full product: `(nb + 1) / (2 nb)` for `nb` blocks of
/// [`TRI_BLOCK`] rows.
fn triangular_fraction(c: usize) -> f64 {
    let nb = c.div_ceil(TRI_BLOCK) as f64;
    (nb + 1.0) / (2.0 * nb)
}

/// [`triangular_fraction`] where both `[c, c]` factors are lower
/// triangular: `Σ i² / nb³` over the blocks `i = 1..=nb`,
/// `(nb + 1)(2 nb + 1) / (6 nb²)`.
fn triangular_fraction_both(c: usize) -> f64 {
    let nb = c.div_ceil(TRI_BLOCK) as f64;
    (nb + 1.0) * (2.0 * nb + 1.0) / (6.0 * nb * nb)
}

/// Operations of forward and backward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpCount {
    pub forward: f64,
    /// What the backward adds after the forward in a forward+backward run.
    /// A backward run alone does more: its own forward without the readout
    /// (the naive engines' checkpoint pass, which in a forward+backward run
    /// is the forward itself; the chunked engines' intermediates).
    pub backward: f64,
}

impl OpCount {
    /// Forward plus backward.
    pub fn total(&self) -> f64 {
        self.forward + self.backward
    }
}

/// Naive KDA, per token and head. Forward, per state element: the finish
/// `S += (βk) rᵀ` (2), the readout `o += q S` (2), the start `S *= e^g` (1)
/// and `r −= k S` (2); it is also the checkpoint pass. Backward: the replay
/// `S = e·S_prev + (kβ)·r` (3), the start backward (`ds += k dr`, two dot
/// products, `ds *= e`: 7) and the finish backward (`ds += q do`,
/// `du += k ds`, two dot products: 8).
pub fn kda_naive(k: usize, v: usize) -> OpCount {
    let kv = (k * v) as f64;
    OpCount {
        forward: 7.0 * kv,
        backward: (3.0 + 7.0 + 8.0) * kv,
    }
}

/// Naive DPLR, per token and head. Forward, per state element: the finish
/// `S = e·S + b wᵀ + k vᵀ` (5), the readout (2) and the start `w += a S` (2);
/// it is also the checkpoint pass. Backward: the replay (5), the start
/// backward (a dot product and `ds = e·ds + a dw`: 5) and the finish backward
/// (`ds += q do`, `dw += b ds`, `dv += k ds`, four dot products: 14).
pub fn dplr_naive(k: usize, v: usize) -> OpCount {
    let kv = (k * v) as f64;
    OpCount {
        forward: 9.0 * kv,
        backward: (5.0 + 5.0 + 14.0) * kv,
    }
}

/// Chunked KDA, per chunk of `c` tokens and head.
///
/// Products with a triangular `[C, C]` factor, or of which only the lower
/// triangle is used, skip the blocks above the diagonal: `f =`
/// [`triangular_fraction`]`(C)` of the full product's work (5/8 at C = 64),
/// `f2 =` [`triangular_fraction_both`]`(C)` when both factors are
/// triangular.
///
/// Forward: intra (`Aqk` and the `k kᵀ` block: 4C²K·f; `(I + L)^{-1}` by
/// substitution: C³/3; `w`: 2C²K·f; `u`: 2C²V·f; nine element-wise `[C, K]`
/// ops), then the state pass (`w h`, `qg h`, `kgᵀ v_new`: 6CKV; `Aqk v_new`:
/// 2C²V·f; two `[K, V]` ops). Backward, from the forward's intermediates:
/// six `[C,K]×[K,V]`-sized products (12CKV), `dAqk`, `dv_new`, `dAkk`'s `V`
/// half and `dv` (8C²V·f), `dAkk`'s `K` half, `dkd` and the intra-block
/// gradients (12C²K·f), `dL` through the inverse (2C³·f + 2C³·f2), about
/// 30 element-wise `[C, K]` ops and five `[K, V]` ops.
pub fn kda_chunk(c: usize, k: usize, v: usize) -> OpCount {
    let (f, f2) = (triangular_fraction(c), triangular_fraction_both(c));
    let (c, k, v) = (c as f64, k as f64, v as f64);
    let forward = 6.0 * c * c * k * f
        + c * c * c
        + 4.0 * c * c * v * f
        + 9.0 * c * k
        + 6.0 * c * k * v
        + 2.0 * k * v;
    OpCount {
        forward,
        backward: 12.0 * c * k * v
            + 8.0 * c * c * v * f
            + 12.0 * c * c * k * f
            + 2.0 * c * c * c * (f + f2)
            + 30.0 * c * k
            + 5.0 * k * v,
    }
}

/// Chunked DPLR, per chunk of `c` tokens and head, with `f` and `f2` as in
/// [`kda_chunk`].
///
/// Forward: intra (four A blocks: 8C²K·f; `(I − Aab)^{-1}`: C³/3; `w`:
/// 2C²K·f; `u = P (Aak V)`: 4C²V·f; twelve element-wise `[C, K]` ops), then
/// the state pass (`w S`, `qg S`, the two state updates: 8CKV; `Aqk V`,
/// `Aqb v2`: 4C²V·f; three `[K, V]` ops). Backward, from the forward's
/// intermediates: eight `CKV` products (16CKV), nine `C²V` products
/// (18C²V·f), ten `C²K` products (20C²K·f), `dAab` through the inverse
/// (2C³·f + 2C³·f2), about 40 element-wise `[C, K]` ops and four `[K, V]` ops.
pub fn dplr_chunk(c: usize, k: usize, v: usize) -> OpCount {
    let (f, f2) = (triangular_fraction(c), triangular_fraction_both(c));
    let (c, k, v) = (c as f64, k as f64, v as f64);
    let forward = 10.0 * c * c * k * f
        + c * c * c
        + 8.0 * c * c * v * f
        + 12.0 * c * k
        + 8.0 * c * k * v
        + 3.0 * k * v;
    OpCount {
        forward,
        backward: 16.0 * c * k * v
            + 18.0 * c * c * v * f
            + 20.0 * c * c * k * f
            + 2.0 * c * c * c * (f + f2)
            + 40.0 * c * k
            + 4.0 * k * v,
    }
}

/// The operands of the peak microbenchmark: `[M, P]·[P, N]` products whose
/// operands (16 KiB each) stay in L1.
const PEAK_SHAPE: (usize, usize, usize) = (64, 32, 64);

/// `iters` products of [`PEAK_SHAPE`] by the engines' product kernel with a
/// separate multiply and add per term ([`unfused_dot`]: the engines'
/// products fuse them), at the vector width the engines run at. It keeps
/// more sums in
/// flight than a chain of `x = x·m + a` can (measured here: 88 against 117
/// GFLOP/s per core with AVX-512), so it finds the mul+add pipes' limit
/// rather than their latency.
fn products(iters: u64) -> f64 {
    let (m, p, n) = PEAK_SHAPE;
    let a = ndarray::Array2::from_shape_fn((m, p), |(i, j)| 1.0 + (i * p + j) as f64 * 1e-3);
    let b = ndarray::Array2::from_shape_fn((p, n), |(i, j)| 1.0 - (i * n + j) as f64 * 1e-4);
    let mut sum = 0.0;
    for _ in 0..iters {
        sum += unfused_dot(std::hint::black_box(a.view()), b.view())[[0, 0]];
    }
    sum
}

/// What [`peak_gflops`] measures, for the reports.
pub fn peak_description() -> String {
    format!(
        "f64 mul+add without FMA: {} product kernel on L1 operands, {} threads",
        deltaref::throughput::vector_width(),
        rayon::current_num_threads()
    )
}

/// Wall seconds of `iters` rounds on every rayon thread at once.
fn timed_products(iters: u64) -> f64 {
    let t = std::time::Instant::now();
    let sums = rayon::broadcast(|_| products(iters));
    std::hint::black_box(sums);
    t.elapsed().as_secs_f64()
}

/// Runs of [`peak_gflops`]: on a shared machine the best of many short
/// runs finds the cores free more reliably than one long run.
const PEAK_RUNS: u32 = 10;

/// The machine's measured mul+add throughput without FMA, in GFLOP/s: the
/// best of `PEAK_RUNS` (10) runs, `seconds` in all, of the product kernel on `f64`
/// on every rayon thread at once (2 ops per term `a·b` added).
pub fn peak_gflops(seconds: f64) -> f64 {
    let mut iters = 1u64 << 10;
    while timed_products(iters) < 0.005 {
        iters *= 2;
    }
    let per_iter = timed_products(iters) / iters as f64;
    let iters = ((seconds / f64::from(PEAK_RUNS) / per_iter) as u64).max(1);
    let (m, p, n) = PEAK_SHAPE;
    let ops = (2 * m * p * n * rayon::current_num_threads()) as f64 * iters as f64;
    (0..PEAK_RUNS)
        .map(|_| ops / timed_products(iters) / 1e9)
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_triangular_fractions_count_the_blocks() {
        // nb = 1, 2, 4 blocks: (nb+1)/(2nb) = 1, 3/4, 5/8;
        // (nb+1)(2nb+1)/(6nb²) = 1, 15/24, 45/96.
        assert_eq!(triangular_fraction(16), 1.0);
        assert_eq!(triangular_fraction(32), 0.75);
        assert_eq!(triangular_fraction(64), 0.625);
        assert_eq!(triangular_fraction_both(16), 1.0);
        assert_eq!(triangular_fraction_both(32), 0.625);
        assert_eq!(triangular_fraction_both(64), 0.46875);
    }
}
