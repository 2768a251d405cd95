//! The chunked engines' matrix products, `out[i, j] = Σ_p a[i, p]·b[p, j]`.
//!
//! Every element is one sum started from zero (or, for [`dot_add`], from the
//! element's value in the output) and accumulated in order `p = 0, 1, …`,
//! each term added by a fused multiply-add `s ← a·b + s` (one rounding).
//! The order is part of this definition, not of the CPU or the blocking,
//! and IEEE 754 defines the fused operation exactly: the vector kernels use
//! the CPU's FMA instructions, the baseline build `mul_add` (libm's
//! correctly rounded `fma`), so the results are the same bits on every
//! machine, at every vector width ([`crate::fast::simd::dispatch`]) and thread
//! count. (A BLAS kernel splits long sums into blocks and picks
//! FMA only where the CPU has it, so its bits depend on the machine.) FMA
//! issues one instruction per term where a separate multiply and add issue
//! two, which is most of these products' time.
//!
//! The kernel keeps a block of `MR × NR` sums in registers and walks `p`
//! once for the block, reading a row of `NR` columns of `b` and one element
//! of `a` per row: `b`'s panel stays in L1 while the row blocks of `a` pass.

use ndarray::{Array2, ArrayView2, ArrayViewMut2, CowArray, Ix2};

use crate::fast::simd;
use crate::scalar::Scalar;

/// `a b` for `a [M, P]` and `b [P, N]` (any strides). Returns `[M, N]`.
pub(crate) fn dot<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>) -> Array2<T> {
    stacked(b.ncols(), &[(a, b)])
}

/// The products `aᵢ bᵢ` (`aᵢ [mᵢ, P]`, `bᵢ [P, N]`) stacked by rows into
/// one `[Σ mᵢ, N]` array, written once (no zero fill).
pub(crate) fn stacked<'a, T: Scalar>(
    n: usize,
    parts: &[(ArrayView2<'a, T>, ArrayView2<'a, T>)],
) -> Array2<T> {
    stacked_with::<T, true>(n, parts)
}

/// Adds the products `aᵢ bᵢ` (`aᵢ [mᵢ, P]`, `bᵢ [P, N]`) to the rows of
/// `out [Σ mᵢ, N]`, part by part, as [`dot_add`] does.
pub(crate) fn stacked_add<'a, T: Scalar>(
    parts: &[(ArrayView2<'a, T>, ArrayView2<'a, T>)],
    mut out: ArrayViewMut2<T>,
) {
    let mut r0 = 0;
    for (a, b) in parts {
        let r1 = r0 + a.nrows();
        dot_add(a.view(), b.view(), out.slice_mut(ndarray::s![r0..r1, ..]));
        r0 = r1;
    }
    assert_eq!(r0, out.nrows(), "gemm: stacked sum's rows");
}

/// [`stacked`], each term added by a fused multiply-add (`FUSED`) or by a
/// separate multiply and add.
fn stacked_with<'a, T: Scalar, const FUSED: bool>(
    n: usize,
    parts: &[(ArrayView2<'a, T>, ArrayView2<'a, T>)],
) -> Array2<T> {
    let m: usize = parts.iter().map(|(a, _)| a.nrows()).sum();
    let mut out: Vec<T> = crate::fast::stagger::vec(m * n);
    // The block starts after the padding, where the spare capacity does.
    let block = out.spare_capacity_mut().as_mut_ptr().cast::<T>();
    let mut r0 = 0;
    for (a, b) in parts {
        assert_eq!(b.ncols(), n, "gemm: stacked product width");
        // SAFETY: rows `r0 .. r0 + mᵢ` of the `[m, n]` row-major block.
        unsafe {
            product::<T, FUSED>(
                a.view(),
                b.view(),
                block.add(r0 * n),
                [n as isize, 1],
                Start::Zero,
            )
        };
        r0 += a.nrows();
    }
    // SAFETY: the parts wrote rows `0 .. m` after the padding, every
    // element of each.
    unsafe { out.set_len(out.len() + m * n) };
    crate::fast::stagger::array(out, ndarray::Ix2(m, n))
}

/// Writes `a b` into `out [M, N]` (any strides), overwriting it.
pub(crate) fn dot_to<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>, out: ArrayViewMut2<T>) {
    into_view(a, b, out, Start::Zero)
}

/// `out ← out + a b` for `out [M, N]` (any strides): each element's sum
/// starts from its value in `out` instead of zero and goes on in order, so
/// `dot_to(a₁, b₁, out)` then `dot_add(a₂, b₂, out)` has the bits of one
/// product over the joined inner dimension, `[a₁ a₂]·[b₁; b₂]`: one
/// rounding per term, none for the sum of the parts.
pub(crate) fn dot_add<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>, out: ArrayViewMut2<T>) {
    into_view(a, b, out, Start::Out)
}

/// `a b` into the view `out`, each sum started from `start`.
fn into_view<T: Scalar>(
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    mut out: ArrayViewMut2<T>,
    start: Start,
) {
    assert_eq!(out.dim(), (a.nrows(), b.ncols()), "gemm: output shape");
    let so = out.strides();
    let so = [so[0], so[1]];
    // SAFETY: `out` is an `[M, N]` view with strides `so`.
    unsafe { product::<T, true>(a, b, out.as_mut_ptr(), so, start) }
}

/// Where each element's sum starts: zero (a product), or the element's
/// value in the output (a product added to it).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Start {
    Zero,
    Out,
}

/// `a b` written to the `[M, N]` block at `out` with strides `out_strides`,
/// by fused multiply-adds (`FUSED`) or a separate multiply and add per term,
/// each sum started from `start`.
///
/// # Safety
/// `out` with `out_strides` must address `[M, N]` writable elements,
/// initialised ones with `Start::Out`.
unsafe fn product<T: Scalar, const FUSED: bool>(
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    out: *mut T,
    out_strides: [isize; 2],
    start: Start,
) {
    let ((m, p), (p2, n)) = (a.dim(), b.dim());
    assert_eq!(p, p2, "gemm: [{m}, {p}]·[{p2}, {n}]");
    if m == 0 || n == 0 {
        return;
    }
    // The kernel reads rows of `b` as contiguous vectors.
    let b = rows_contiguous(b);
    let mats = Mats::new(a, b.view(), out, out_strides, start);
    // SAFETY: every offset the kernels form is inside the shapes [m, p],
    // [p, n] and [m, n] with the operands' strides.
    unsafe {
        if FUSED {
            mats.run_fused(m, n)
        } else {
            mats.run_unfused(m, n)
        }
    }
}

/// `a b` for `a [M, P]` and `b [P, N]` by the same blocking with a separate
/// multiply and add per term (two roundings), for the peak microbenchmark
/// ([`crate::ops::peak_gflops`]): the mul+add throughput of the CPU without
/// FMA. Returns `[M, N]`.
pub(crate) fn dot_unfused(a: ArrayView2<f64>, b: ArrayView2<f64>) -> Array2<f64> {
    stacked_with::<f64, false>(b.ncols(), &[(a, b)])
}

/// `b` as the kernel reads it, with contiguous rows: borrowed when they
/// already are, else copied row-major. A caller that multiplies by several
/// slices of one transposed operand packs it once with this.
pub(crate) fn rows_contiguous<T: Scalar>(b: ArrayView2<'_, T>) -> CowArray<'_, T, Ix2> {
    if b.strides()[1] == 1 || b.ncols() <= 1 {
        return b.into();
    }
    let (p, n) = b.dim();
    let mut out: Vec<T> = crate::fast::stagger::vec(p * n);
    let (src, [s_row, s_col]) = (b.as_ptr(), [b.strides()[0], b.strides()[1]]);
    // After the padding, where the spare capacity starts.
    let dst = out.spare_capacity_mut().as_mut_ptr().cast::<T>();
    let at = |k: usize, j: usize| k as isize * s_row + j as isize * s_col;
    let full = |x: usize| x / TILE * TILE;
    // Shuffles move the f64 tiles 2–5× faster than the generic copy
    // (measured transposing 64×64 and 32×64); only data moves, so no bit
    // changes.
    let f64_tiles = cfg!(target_arch = "x86_64")
        && std::any::TypeId::of::<T>() == std::any::TypeId::of::<f64>()
        && simd::width() == simd::Width::Avx512;
    simd::dispatch(
        #[inline(always)]
        || {
            // SAFETY: every (k, j) read is inside `b`'s shape and every
            // write inside `out`'s capacity (`k < p`, `j < n`).
            unsafe {
                if s_row == 1 {
                    // `xᵀ` of a row-major `x`: transpose whole tiles in
                    // registers, reading and writing rows of 8 (indexed
                    // loops: the transposition needs both indices).
                    for k0 in (0..full(p)).step_by(TILE) {
                        for j0 in (0..full(n)).step_by(TILE) {
                            if f64_tiles {
                                #[cfg(target_arch = "x86_64")]
                                transpose_tile_avx512(
                                    src.offset(at(k0, j0)).cast(),
                                    s_col,
                                    dst.add(k0 * n + j0).cast(),
                                    n,
                                );
                                continue;
                            }
                            let mut t = [[T::zero(); TILE]; TILE];
                            #[allow(clippy::needless_range_loop)]
                            for jj in 0..TILE {
                                let row: [T; TILE] =
                                    std::ptr::read_unaligned(src.offset(at(k0, j0 + jj)).cast());
                                for kk in 0..TILE {
                                    t[kk][jj] = row[kk];
                                }
                            }
                            for (kk, t_k) in t.iter().enumerate() {
                                std::ptr::write_unaligned(dst.add((k0 + kk) * n + j0).cast(), *t_k);
                            }
                        }
                    }
                }
                // The rest (all of it for other layouts), element by element.
                let tiled = if s_row == 1 {
                    (full(p), full(n))
                } else {
                    (0, 0)
                };
                for k in 0..p {
                    let j_from = if k < tiled.0 { tiled.1 } else { 0 };
                    for j in j_from..n {
                        dst.add(k * n + j).write(*src.offset(at(k, j)));
                    }
                }
            }
        },
    );
    // SAFETY: the tiles and the rest cover all `p · n` elements.
    unsafe { out.set_len(out.len() + p * n) };
    crate::fast::stagger::array(out, ndarray::Ix2(p, n)).into()
}

/// Side of the square tiles [`rows_contiguous`] transposes in registers.
const TILE: usize = 8;

/// Writes the transpose of the 8×8 f64 tile at `src` (rows `src_row`
/// apart) to `dst` (rows `dst_row` apart): pairs of rows interleaved, then
/// 128-bit and 256-bit lanes exchanged (24 shuffles for 8 loads and 8
/// stores).
///
/// # Safety
/// The CPU has AVX-512F; both tiles are inside their allocations.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_tile_avx512(src: *const f64, src_row: isize, dst: *mut f64, dst_row: usize) {
    use std::arch::x86_64::*;
    let r: [__m512d; 8] =
        std::array::from_fn(|i| _mm512_loadu_pd(src.offset(i as isize * src_row)));
    // t[2i] = (r[2i][0], r[2i+1][0], r[2i][2], r[2i+1][2], …), t[2i+1] the odd elements.
    let t: [__m512d; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_pd(a, b)
        } else {
            _mm512_unpackhi_pd(a, b)
        }
    });
    // 128-bit lanes: u holds 4-row columns of rows 0–3 (u[0..4]) and 4–7 (u[4..8]).
    let lanes_lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    let lanes_hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    let u: [__m512d; 8] = std::array::from_fn(|i| {
        let (base, idx) = (i / 4 * 4, if i % 4 < 2 { lanes_lo } else { lanes_hi });
        _mm512_permutex2var_pd(t[base + i % 2], idx, t[base + 2 + i % 2])
    });
    // 256-bit halves: output row kk joins rows 0–3 and 4–7 of column kk.
    let halves_lo = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
    let halves_hi = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    for kk in 0..8 {
        let idx = if kk < 4 { halves_lo } else { halves_hi };
        let o = _mm512_permutex2var_pd(u[kk % 4], idx, u[4 + kk % 4]);
        _mm512_storeu_pd(dst.add(kk * dst_row), o);
    }
}

/// The three operands as pointers and element strides (`b`'s columns are
/// contiguous).
struct Mats<T> {
    a: *const T,
    a_row: isize,
    a_col: isize,
    b: *const T,
    b_row: isize,
    out: *mut T,
    out_row: isize,
    out_col: isize,
    p: usize,
    start: Start,
}

impl<T: Scalar> Mats<T> {
    /// `a [M, P]`, `b [P, N]` with contiguous rows, and the `[M, N]` block at
    /// `out` with strides `out_strides`, whose sums start from `start`.
    fn new(
        a: ArrayView2<T>,
        b: ArrayView2<T>,
        out: *mut T,
        out_strides: [isize; 2],
        start: Start,
    ) -> Self {
        debug_assert!(b.is_empty() || b.strides()[1] == 1 || b.ncols() <= 1);
        let sa = a.strides();
        Mats {
            a: a.as_ptr(),
            a_row: sa[0],
            a_col: sa[1],
            b: b.as_ptr(),
            b_row: b.strides()[0],
            out,
            out_row: out_strides[0],
            out_col: out_strides[1],
            p: a.ncols(),
            start,
        }
    }

    /// All of `out [m, n]` with fused multiply-adds, at the CPU's
    /// [`simd::width`].
    unsafe fn run_fused(&self, m: usize, n: usize) {
        self.run_fused_at(simd::width(), m, n)
    }

    /// [`Self::run_fused`] at `width` (which the CPU must have): the vector
    /// kernel for `f64` and `f32` with AVX-512 or AVX2 (both with FMA), else
    /// `mul_add` element by element (the same bits).
    unsafe fn run_fused_at(&self, width: simd::Width, m: usize, n: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use simd::Width::{Avx2, Avx512};
            match (width, self.cast::<f64>(), self.cast::<f32>()) {
                (Avx512, Some(x), _) => return x86::run_avx512::<x86::F64x8>(x, m, n),
                (Avx512, _, Some(x)) => return x86::run_avx512::<x86::F32x16>(x, m, n),
                (Avx2, Some(x), _) => return x86::run_avx2::<x86::F64x4>(x, m, n),
                (Avx2, _, Some(x)) => return x86::run_avx2::<x86::F32x8>(x, m, n),
                _ => {}
            }
        }
        match width {
            simd::Width::Baseline => self.run::<4, 8, true>(m, n),
            _ => simd::dispatch(
                #[inline(always)]
                || self.run::<4, 8, true>(m, n),
            ),
        }
    }

    /// All of `out [m, n]` with a separate multiply and add per term.
    unsafe fn run_unfused(&self, m: usize, n: usize) {
        simd::dispatch(
            #[inline(always)]
            || {
                if simd::width() == simd::Width::Avx512 {
                    self.run::<4, 16, false>(m, n)
                } else {
                    self.run::<4, 8, false>(m, n)
                }
            },
        )
    }

    /// `self` as the operands of `U` when `T` is `U`.
    fn cast<U: Scalar>(&self) -> Option<&Mats<U>> {
        let same = std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>();
        // SAFETY: `Mats<T>` and `Mats<U>` are the same type when `T` is `U`.
        same.then(|| unsafe { &*(self as *const Mats<T>).cast::<Mats<U>>() })
    }

    /// All of `out [m, n]`: `MR × NR` blocks, then the edges with narrower
    /// blocks (the sums do not depend on the block shape). `FUSED` picks
    /// `mul_add` over a separate multiply and add.
    #[inline(always)]
    unsafe fn run<const MR: usize, const NR: usize, const FUSED: bool>(&self, m: usize, n: usize) {
        let mut j = 0;
        while j + NR <= n {
            self.rows::<NR, MR, FUSED>(j, m);
            j += NR;
        }
        self.edge_columns::<MR, FUSED>(j, m, n);
    }

    /// Columns `j .. n` (fewer than a block's) of every row, 4 then 1 at a time.
    #[inline(always)]
    unsafe fn edge_columns<const MR: usize, const FUSED: bool>(
        &self,
        mut j: usize,
        m: usize,
        n: usize,
    ) {
        while j + 4 <= n {
            self.rows::<4, MR, FUSED>(j, m);
            j += 4;
        }
        while j < n {
            self.rows::<1, MR, FUSED>(j, m);
            j += 1;
        }
    }

    /// Columns `j .. j + NR` of every row.
    #[inline(always)]
    unsafe fn rows<const NR: usize, const MR: usize, const FUSED: bool>(&self, j: usize, m: usize) {
        // The start as a constant: a branch inside the block keeps LLVM from
        // holding the sums in registers (the no-FMA kernel ran at 40–70 % of
        // its speed).
        match self.start {
            Start::Zero => self.rows_from::<NR, MR, FUSED, false>(j, m),
            Start::Out => self.rows_from::<NR, MR, FUSED, true>(j, m),
        }
    }

    /// [`Self::rows`], the sums started from `out` (`FROM_OUT`) or zero.
    #[inline(always)]
    unsafe fn rows_from<
        const NR: usize,
        const MR: usize,
        const FUSED: bool,
        const FROM_OUT: bool,
    >(
        &self,
        j: usize,
        m: usize,
    ) {
        let mut i = 0;
        while i + MR <= m {
            self.block::<MR, NR, FUSED, FROM_OUT>(i, j);
            i += MR;
        }
        while i < m {
            self.block::<1, NR, FUSED, FROM_OUT>(i, j);
            i += 1;
        }
    }

    /// The `MR × NR` block of `out` at `(i, j)`. (Indexed loops: LLVM keeps
    /// the block in vector registers this way, not with iterators.)
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn block<const MR: usize, const NR: usize, const FUSED: bool, const FROM_OUT: bool>(
        &self,
        i: usize,
        j: usize,
    ) {
        let mut acc = [[T::zero(); NR]; MR];
        if FROM_OUT {
            for r in 0..MR {
                let row = self.out_at(i + r, j);
                for c in 0..NR {
                    acc[r][c] = *row.offset(c as isize * self.out_col);
                }
            }
        }
        let a = self.a.offset(i as isize * self.a_row);
        let b = self.b.add(j);
        for k in 0..self.p as isize {
            let b_k: [T; NR] = std::ptr::read_unaligned(b.offset(k * self.b_row).cast());
            for r in 0..MR {
                let a_rk = *a.offset(r as isize * self.a_row + k * self.a_col);
                for c in 0..NR {
                    acc[r][c] = if FUSED {
                        a_rk.mul_add(b_k[c], acc[r][c])
                    } else {
                        acc[r][c] + a_rk * b_k[c]
                    };
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            let row = self.out_at(i + r, j);
            if self.out_col == 1 {
                std::ptr::write_unaligned(row.cast::<[T; NR]>(), *acc_r);
            } else {
                self.write_strided(row, acc_r);
            }
        }
    }

    /// Where `out[i, j]` is.
    #[inline(always)]
    unsafe fn out_at(&self, i: usize, j: usize) -> *mut T {
        self.out
            .offset(i as isize * self.out_row + j as isize * self.out_col)
    }

    /// Writes `sums` to the row of `out` that starts at `row`, when its
    /// columns are not contiguous.
    #[inline(always)]
    unsafe fn write_strided(&self, row: *mut T, sums: &[T]) {
        for (c, &s) in sums.iter().enumerate() {
            *row.offset(c as isize * self.out_col) = s;
        }
    }
}

/// The vector kernels: `4 × 2` vectors of sums in registers (`4 × 16` f64
/// or `4 × 32` f32 with AVX-512, half as many columns with AVX2): eight
/// independent FMA chains, enough to cover the instruction's latency on two
/// FMA pipes.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Mats;
    use crate::scalar::Scalar;

    /// A vector register of `LANES` elements of `T`.
    pub(super) trait Lanes: Copy {
        type T: Scalar;
        const LANES: usize;
        unsafe fn zero() -> Self;
        unsafe fn splat(x: Self::T) -> Self;
        unsafe fn load(p: *const Self::T) -> Self;
        unsafe fn store(self, p: *mut Self::T);
        /// `a·b + self`, rounded once.
        unsafe fn fmadd(self, a: Self, b: Self) -> Self;
    }

    macro_rules! lanes {
        ($name:ident, $t:ty, $n:expr, $v:ty, $zero:ident, $splat:ident, $load:ident, $store:ident, $fmadd:ident) => {
            #[derive(Clone, Copy)]
            pub(super) struct $name($v);

            impl Lanes for $name {
                type T = $t;
                const LANES: usize = $n;
                #[inline(always)]
                unsafe fn zero() -> Self {
                    $name($zero())
                }
                #[inline(always)]
                unsafe fn splat(x: $t) -> Self {
                    $name($splat(x))
                }
                #[inline(always)]
                unsafe fn load(p: *const $t) -> Self {
                    $name($load(p))
                }
                #[inline(always)]
                unsafe fn store(self, p: *mut $t) {
                    $store(p, self.0)
                }
                #[inline(always)]
                unsafe fn fmadd(self, a: Self, b: Self) -> Self {
                    $name($fmadd(a.0, b.0, self.0))
                }
            }
        };
    }

    lanes!(
        F64x8,
        f64,
        8,
        __m512d,
        _mm512_setzero_pd,
        _mm512_set1_pd,
        _mm512_loadu_pd,
        _mm512_storeu_pd,
        _mm512_fmadd_pd
    );
    lanes!(
        F32x16,
        f32,
        16,
        __m512,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_fmadd_ps
    );
    lanes!(
        F64x4,
        f64,
        4,
        __m256d,
        _mm256_setzero_pd,
        _mm256_set1_pd,
        _mm256_loadu_pd,
        _mm256_storeu_pd,
        _mm256_fmadd_pd
    );
    lanes!(
        F32x8,
        f32,
        8,
        __m256,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_fmadd_ps
    );

    /// # Safety
    /// The CPU has AVX-512F; the operands are as [`Mats::run_fused`] needs.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn run_avx512<V: Lanes>(x: &Mats<V::T>, m: usize, n: usize) {
        run::<V>(x, m, n)
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; the operands are as [`Mats::run_fused`] needs.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_avx2<V: Lanes>(x: &Mats<V::T>, m: usize, n: usize) {
        run::<V>(x, m, n)
    }

    /// Blocks of `4` rows and `2·LANES` columns; the rows and columns left
    /// over by the generic kernel (`mul_add`, compiled here to the same FMA
    /// instructions).
    #[inline(always)]
    unsafe fn run<V: Lanes>(x: &Mats<V::T>, m: usize, n: usize) {
        let nv = n / (2 * V::LANES) * (2 * V::LANES);
        match x.start {
            super::Start::Zero => vector_columns::<V, false>(x, m, nv),
            super::Start::Out => vector_columns::<V, true>(x, m, nv),
        }
        x.edge_columns::<4, true>(nv, m, n);
    }

    /// The `2·LANES` sums of the row of `out` that starts at `row`, as
    /// vectors.
    #[inline(always)]
    unsafe fn start_row<V: Lanes>(x: &Mats<V::T>, row: *const V::T) -> [V; 2] {
        if x.out_col == 1 {
            return [V::load(row), V::load(row.add(V::LANES))];
        }
        let sums: [V::T; 32] = std::array::from_fn(|c| {
            if c < 2 * V::LANES {
                *row.offset(c as isize * x.out_col)
            } else {
                <V::T as num_traits::Zero>::zero()
            }
        });
        [V::load(sums.as_ptr()), V::load(sums.as_ptr().add(V::LANES))]
    }

    /// Columns `..nv` (whole blocks of `2·LANES`) of every row: `4 × 2·LANES`
    /// blocks, then the rows left one at a time; the sums started from `out`
    /// (`FROM_OUT`) or zero, a constant as in [`Mats::rows`].
    #[inline(always)]
    unsafe fn vector_columns<V: Lanes, const FROM_OUT: bool>(x: &Mats<V::T>, m: usize, nv: usize) {
        let m4 = m / 4 * 4;
        for j in (0..nv).step_by(2 * V::LANES) {
            for i in (0..m4).step_by(4) {
                block::<V, FROM_OUT>(x, i, j);
            }
        }
        for i in m4..m {
            for j in (0..nv).step_by(4) {
                x.block::<1, 4, true, FROM_OUT>(i, j);
            }
        }
    }

    /// The `4 × 2·LANES` block of sums at `(i, j)`.
    #[inline(always)]
    unsafe fn block<V: Lanes, const FROM_OUT: bool>(x: &Mats<V::T>, i: usize, j: usize) {
        let mut acc = [[V::zero(); 2]; 4];
        if FROM_OUT {
            for (r, acc_r) in acc.iter_mut().enumerate() {
                *acc_r = start_row::<V>(x, x.out_at(i + r, j));
            }
        }
        let a = x.a.offset(i as isize * x.a_row);
        let b = x.b.add(j);
        for k in 0..x.p as isize {
            let b_k = b.offset(k * x.b_row);
            let b_k = [V::load(b_k), V::load(b_k.add(V::LANES))];
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let a_rk = V::splat(*a.offset(r as isize * x.a_row + k * x.a_col));
                for (s, &b_kc) in acc_r.iter_mut().zip(&b_k) {
                    *s = s.fmadd(a_rk, b_kc);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            let row = x.out_at(i + r, j);
            if x.out_col == 1 {
                acc_r[0].store(row);
                acc_r[1].store(row.add(V::LANES));
            } else {
                let mut sums = [<V::T as num_traits::Zero>::zero(); 32];
                acc_r[0].store(sums.as_mut_ptr());
                acc_r[1].store(sums.as_mut_ptr().add(V::LANES));
                x.write_strided(row, &sums[..2 * V::LANES]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use ndarray::s;

    use super::*;
    use crate::rng::Stream;

    fn draw(name: &str, r: usize, c: usize) -> Array2<f64> {
        Array2::from_shape_vec((r, c), Stream::new(5, name).normals(r * c)).unwrap()
    }

    /// The definition, one element at a time.
    fn sequential<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>) -> Array2<T> {
        Array2::from_shape_fn((a.nrows(), b.ncols()), |(i, j)| {
            let mut s = T::zero();
            for k in 0..a.ncols() {
                s = a[[i, k]].mul_add(b[[k, j]], s);
            }
            s
        })
    }

    /// `a b` by the kernel of `width`.
    fn fused_at<T: Scalar>(width: simd::Width, a: ArrayView2<T>, b: ArrayView2<T>) -> Array2<T> {
        let (m, n) = (a.nrows(), b.ncols());
        let b = rows_contiguous(b);
        let mut out = Array2::from_elem((m, n), T::nan());
        let mats = Mats::new(a, b.view(), out.as_mut_ptr(), [n as isize, 1], Start::Zero);
        // SAFETY: `out` is the `[m, n]` row-major array just made; the
        // tests pass only widths this CPU runs (`widths`).
        unsafe { mats.run_fused_at(width, m, n) };
        out
    }

    /// The widths this CPU runs.
    fn widths() -> Vec<simd::Width> {
        let mut w = vec![simd::Width::Baseline];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("fma") {
            if std::arch::is_x86_feature_detected!("avx2") {
                w.push(simd::Width::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                w.push(simd::Width::Avx512);
            }
        }
        w
    }

    fn same_bits<T: Scalar>(x: &Array2<T>, y: &Array2<T>) -> bool {
        x.shape() == y.shape()
            && x.iter()
                .zip(y)
                .all(|(p, q)| p.to_f64().unwrap().to_bits() == q.to_f64().unwrap().to_bits())
    }

    #[test]
    fn every_element_is_the_fused_sequential_sum_at_every_width() {
        // Full blocks of both types at both vector widths, edges of every
        // size, empty sums, empty results.
        let shapes = [
            (32, 64, 64),
            (7, 5, 3),
            (13, 33, 37),
            (10, 17, 77),
            (4, 0, 16),
            (0, 3, 2),
            (9, 1, 1),
        ];
        for width in widths() {
            for (m, p, n) in shapes {
                let (a, b) = (draw("a", m, p), draw("b", p, n));
                let want = sequential(a.view(), b.view());
                assert!(
                    same_bits(&fused_at(width, a.view(), b.view()), &want),
                    "{width:?} f64 {m} {p} {n}"
                );
                let (a32, b32) = (a.mapv(|x| x as f32), b.mapv(|x| x as f32));
                assert!(
                    same_bits(
                        &fused_at(width, a32.view(), b32.view()),
                        &sequential(a32.view(), b32.view())
                    ),
                    "{width:?} f32 {m} {p} {n}"
                );
            }
        }
    }

    #[test]
    fn every_layout_reads_the_same_elements() {
        for (m, p, n) in [(32, 64, 64), (13, 33, 37), (9, 1, 1)] {
            let (a, b) = (draw("a", m, p), draw("b", p, n));
            let want = sequential(a.view(), b.view());
            assert!(same_bits(&dot(a.view(), b.view()), &want), "{m} {p} {n}");
            let (at, bt) = (a.t().to_owned(), b.t().to_owned());
            assert!(same_bits(&dot(at.t(), bt.t()), &want), "{m} {p} {n} t");
        }
        let a = draw("a", 20, 30);
        let b = draw("b", 40, 50);
        let (av, bv) = (a.slice(s![..;2, 1..;3]), b.slice(s![..;4, ..;2]));
        assert!(same_bits(&dot(av, bv), &sequential(av, bv)));
        // Reversed axes (negative strides) too.
        let (ar, br) = (a.slice(s![..;-1, ..10]), b.slice(s![..10;-1, ..;-1]));
        assert!(same_bits(&dot(ar, br), &sequential(ar, br)));
    }

    /// `−1·1 + (1 + 2⁻³⁰)(1 − 2⁻³⁰)`: the second product is `1 − 2⁻⁶⁰`,
    /// which rounds to 1 on its own, so only a fused add keeps the `−2⁻⁶⁰`.
    #[test]
    fn each_term_is_rounded_once() {
        let e = 2f64.powi(-30);
        let a = ndarray::arr2(&[[-1.0, 1.0 + e]]);
        let b = ndarray::arr2(&[[1.0], [1.0 - e]]);
        for width in widths() {
            assert_eq!(
                fused_at(width, a.view(), b.view())[[0, 0]],
                -(e * e),
                "{width:?}"
            );
        }
        assert_eq!(dot(a.view(), b.view())[[0, 0]], -(e * e));
        assert_eq!(dot_unfused(a.view(), b.view())[[0, 0]], 0.0);
    }

    /// The peak's kernel: a separate multiply and add, in the same order.
    #[test]
    fn the_unfused_kernel_rounds_twice() {
        let (a, b) = (draw("a", 13, 33), draw("b", 33, 37));
        let want = Array2::from_shape_fn((13, 37), |(i, j)| {
            (0..33).fold(0.0, |s, k| s + a[[i, k]] * b[[k, j]])
        });
        assert!(same_bits(&dot_unfused(a.view(), b.view()), &want));
        assert!(!same_bits(&dot(a.view(), b.view()), &want));
    }

    /// `a b` added to `out` by the kernel of `width`.
    fn added_at<T: Scalar>(
        width: simd::Width,
        a: ArrayView2<T>,
        b: ArrayView2<T>,
        mut out: ArrayViewMut2<T>,
    ) {
        assert_eq!(out.dim(), (a.nrows(), b.ncols()));
        let b = rows_contiguous(b);
        let so = [out.strides()[0], out.strides()[1]];
        let mats = Mats::new(a, b.view(), out.as_mut_ptr(), so, Start::Out);
        // SAFETY: `out` is an initialised `[M, N]` view with strides `so`;
        // the tests pass only widths this CPU runs (`widths`).
        unsafe { mats.run_fused_at(width, a.nrows(), b.ncols()) };
    }

    /// `a₂ b₂` added by the kernel of `width` to `a₁ b₁`, into a contiguous
    /// and a strided output (the transpose of a row-major block), has the
    /// bits of the sequential sum over the joined inner dimension.
    fn check_added<T: Scalar>(width: simd::Width, [a1, a2, b1, b2]: [&Array2<T>; 4]) {
        let want = sequential(
            ndarray::concatenate![ndarray::Axis(1), *a1, *a2].view(),
            ndarray::concatenate![ndarray::Axis(0), *b1, *b2].view(),
        );
        let what = format!("{width:?} {:?} {:?}", a1.dim(), a2.dim());
        let mut out = sequential(a1.view(), b1.view());
        added_at(width, a2.view(), b2.view(), out.view_mut());
        assert!(same_bits(&out, &want), "{what}");
        let mut out_t = sequential(a1.view(), b1.view()).t().to_owned();
        added_at(
            width,
            a2.view(),
            b2.view(),
            out_t.view_mut().reversed_axes(),
        );
        assert!(same_bits(&out_t.t().to_owned(), &want), "{what} strided");
    }

    /// Each element goes on from its value in `out`, at every width, f64
    /// and f32, with edges and an empty sum.
    #[test]
    fn an_added_product_continues_each_sum() {
        for width in widths() {
            for (m, p1, p2, n) in [
                (32, 64, 32, 64),
                (13, 7, 33, 37),
                (9, 3, 0, 1),
                (5, 0, 4, 20),
            ] {
                let (a1, a2) = (draw("a1", m, p1), draw("a2", m, p2));
                let (b1, b2) = (draw("b1", p1, n), draw("b2", p2, n));
                check_added(width, [&a1, &a2, &b1, &b2]);
                let [a1, a2, b1, b2] = [a1, a2, b1, b2].map(|x| x.mapv(|v| v as f32));
                check_added(width, [&a1, &a2, &b1, &b2]);
            }
        }
        let (a, b) = (draw("a", 6, 8), draw("b", 8, 10));
        let mut out = Array2::zeros((6, 10));
        dot_add(a.view(), b.view(), out.view_mut());
        assert!(same_bits(&out, &sequential(a.view(), b.view())));
        // Part by part down the rows.
        let (a1, a2) = (draw("a1", 4, 8), draw("a2", 3, 5));
        let (b1, b2) = (draw("b1", 8, 10), draw("b2", 5, 10));
        let mut out = draw("o", 7, 10);
        let mut want = out.clone();
        stacked_add(
            &[(a1.view(), b1.view()), (a2.view(), b2.view())],
            out.view_mut(),
        );
        dot_add(a1.view(), b1.view(), want.slice_mut(s![..4, ..]));
        dot_add(a2.view(), b2.view(), want.slice_mut(s![4.., ..]));
        assert!(same_bits(&out, &want));
    }

    #[test]
    fn dot_to_writes_only_its_block() {
        let (a, b) = (draw("a", 6, 8), draw("b", 8, 10));
        let mut out = Array2::from_elem((9, 12), 7.0);
        dot_to(a.view(), b.view(), out.slice_mut(s![2..8, 1..11]));
        assert!(same_bits(
            &out.slice(s![2..8, 1..11]).to_owned(),
            &sequential(a.view(), b.view())
        ));
        out.slice_mut(s![2..8, 1..11]).fill(7.0);
        assert!(out.iter().all(|&x| x == 7.0));
    }

    #[test]
    fn packing_keeps_the_elements() {
        let x = draw("x", 9, 11);
        // Whole tiles and edges of a transpose (the AVX-512 tiles where the
        // CPU has them), a transposed block of a wider array, f32.
        let y = draw("y", 37, 70);
        for v in [
            x.t(),
            x.view(),
            x.slice(s![..;2, ..;3]),
            y.t(),
            y.slice(s![3..35, 5..69]).reversed_axes(),
        ] {
            assert_eq!(rows_contiguous(v).to_owned(), v.to_owned());
        }
        let y32 = y.mapv(|v| v as f32);
        assert_eq!(rows_contiguous(y32.t()).to_owned(), y32.t().to_owned());
    }
}
