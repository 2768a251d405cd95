//! The chunked engines' matrix products, `out[i, j] = Σ_p a[i, p]·b[p, j]`.
//!
//! Every element is one sum started from zero and accumulated in order
//! `p = 0, 1, …` with a separate multiply and add. The order is part of this
//! definition, not of the CPU or the blocking: the results are the same bits
//! on every machine, at every vector width ([`crate::simd::dispatch`]) and
//! thread count. (A BLAS kernel picks FMA where the CPU has it and splits
//! long sums into blocks, so its bits depend on the machine.)
//!
//! The kernel keeps a block of `MR × NR` sums in registers and walks `p`
//! once for the block, reading a row of `NR` columns of `b` and one element
//! of `a` per row: `b`'s panel stays in L1 while the row blocks of `a` pass.

use ndarray::{Array2, ArrayView2, ArrayViewMut2, CowArray, Ix2};

use crate::scalar::Scalar;
use crate::simd;

/// `a b` for `a [M, P]` and `b [P, N]` (any strides). Returns `[M, N]`.
pub fn dot<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>) -> Array2<T> {
    stacked(b.ncols(), &[(a, b)])
}

/// The products `aᵢ bᵢ` (`aᵢ [mᵢ, P]`, `bᵢ [P, N]`) stacked by rows into
/// one `[Σ mᵢ, N]` array, written once (no zero fill).
pub fn stacked<'a, T: Scalar>(
    n: usize,
    parts: &[(ArrayView2<'a, T>, ArrayView2<'a, T>)],
) -> Array2<T> {
    let m: usize = parts.iter().map(|(a, _)| a.nrows()).sum();
    let mut out: Vec<T> = Vec::with_capacity(m * n);
    let mut r0 = 0;
    for (a, b) in parts {
        assert_eq!(b.ncols(), n, "gemm: stacked product width");
        // SAFETY: rows `r0 .. r0 + mᵢ` of the `[m, n]` row-major block.
        unsafe {
            product(
                a.view(),
                b.view(),
                out.as_mut_ptr().add(r0 * n),
                [n as isize, 1],
            )
        };
        r0 += a.nrows();
    }
    // SAFETY: the parts wrote rows `0 .. m`, every element of each.
    unsafe { out.set_len(m * n) };
    Array2::from_shape_vec((m, n), out).expect("[M, N]")
}

/// Writes `a b` into `out [M, N]` (any strides), overwriting it.
pub fn dot_to<T: Scalar>(a: ArrayView2<T>, b: ArrayView2<T>, mut out: ArrayViewMut2<T>) {
    assert_eq!(out.dim(), (a.nrows(), b.ncols()), "gemm: output shape");
    let so = out.strides();
    let so = [so[0], so[1]];
    // SAFETY: `out` is an `[M, N]` view with strides `so`.
    unsafe { product(a, b, out.as_mut_ptr(), so) }
}

/// `a b` written to the `[M, N]` block at `out` with strides `out_strides`.
///
/// # Safety
/// `out` with `out_strides` must address `[M, N]` writable elements.
unsafe fn product<T: Scalar>(
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    out: *mut T,
    out_strides: [isize; 2],
) {
    let ((m, p), (p2, n)) = (a.dim(), b.dim());
    assert_eq!(p, p2, "gemm: [{m}, {p}]·[{p2}, {n}]");
    if m == 0 || n == 0 {
        return;
    }
    // The kernel reads rows of `b` as contiguous vectors.
    let b = rows_contiguous(b);
    let (b_ptr, b_row) = (b.as_ptr(), b.strides()[0]);
    let (sa, [out_row, out_col]) = (a.strides(), out_strides);
    let mats = Mats {
        a: a.as_ptr(),
        a_row: sa[0],
        a_col: sa[1],
        b: b_ptr,
        b_row,
        out,
        out_row,
        out_col,
        p,
    };
    simd::dispatch(
        #[inline(always)]
        || {
            // SAFETY: every offset the kernels form is inside the shapes
            // [m, p], [p, n] and [m, n] with the operands' strides.
            unsafe {
                if simd::width() == simd::Width::Avx512 {
                    mats.run::<4, 16>(m, n)
                } else {
                    mats.run::<4, 8>(m, n)
                }
            }
        },
    );
}

/// `b` as the kernel reads it, with contiguous rows: borrowed when they
/// already are, else copied row-major. A caller that multiplies by several
/// slices of one transposed operand packs it once with this.
pub fn rows_contiguous<T: Scalar>(b: ArrayView2<'_, T>) -> CowArray<'_, T, Ix2> {
    if b.strides()[1] == 1 || b.ncols() <= 1 {
        return b.into();
    }
    let (p, n) = b.dim();
    let mut out: Vec<T> = Vec::with_capacity(p * n);
    let (src, [s_row, s_col]) = (b.as_ptr(), [b.strides()[0], b.strides()[1]]);
    let dst = out.as_mut_ptr();
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
    unsafe { out.set_len(p * n) };
    Array2::from_shape_vec((p, n), out).expect("[P, N]").into()
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
}

impl<T: Scalar> Mats<T> {
    /// All of `out [m, n]`: `MR × NR` blocks, then the edges with narrower
    /// blocks (the sums do not depend on the block shape).
    #[inline(always)]
    unsafe fn run<const MR: usize, const NR: usize>(&self, m: usize, n: usize) {
        let mut j = 0;
        while j + NR <= n {
            self.rows::<NR, MR>(j, m);
            j += NR;
        }
        while j + 4 <= n {
            self.rows::<4, MR>(j, m);
            j += 4;
        }
        while j < n {
            self.rows::<1, MR>(j, m);
            j += 1;
        }
    }

    /// Columns `j .. j + NR` of every row.
    #[inline(always)]
    unsafe fn rows<const NR: usize, const MR: usize>(&self, j: usize, m: usize) {
        let mut i = 0;
        while i + MR <= m {
            self.block::<MR, NR>(i, j);
            i += MR;
        }
        while i < m {
            self.block::<1, NR>(i, j);
            i += 1;
        }
    }

    /// The `MR × NR` block of `out` at `(i, j)`. (Indexed loops: LLVM keeps
    /// the block in vector registers this way, not with iterators.)
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn block<const MR: usize, const NR: usize>(&self, i: usize, j: usize) {
        let mut acc = [[T::zero(); NR]; MR];
        let a = self.a.offset(i as isize * self.a_row);
        let b = self.b.add(j);
        for k in 0..self.p as isize {
            let b_k: [T; NR] = std::ptr::read_unaligned(b.offset(k * self.b_row).cast());
            for r in 0..MR {
                let a_rk = *a.offset(r as isize * self.a_row + k * self.a_col);
                for c in 0..NR {
                    acc[r][c] += a_rk * b_k[c];
                }
            }
        }
        let out = self
            .out
            .offset(i as isize * self.out_row + j as isize * self.out_col);
        for (r, acc_r) in acc.iter().enumerate() {
            let row = out.offset(r as isize * self.out_row);
            if self.out_col == 1 {
                std::ptr::write_unaligned(row.cast::<[T; NR]>(), *acc_r);
            } else {
                for (c, &s) in acc_r.iter().enumerate() {
                    *row.offset(c as isize * self.out_col) = s;
                }
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
    fn sequential(a: ArrayView2<f64>, b: ArrayView2<f64>) -> Array2<f64> {
        Array2::from_shape_fn((a.nrows(), b.ncols()), |(i, j)| {
            let mut s = 0.0;
            for k in 0..a.ncols() {
                s += a[[i, k]] * b[[k, j]];
            }
            s
        })
    }

    fn same_bits(x: &Array2<f64>, y: &Array2<f64>) -> bool {
        x.shape() == y.shape() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
    }

    #[test]
    fn every_element_is_the_sequential_sum() {
        // Full blocks, edges of every width, empty sums, empty results.
        for (m, p, n) in [
            (32, 64, 64),
            (7, 5, 3),
            (13, 33, 37),
            (4, 0, 16),
            (0, 3, 2),
            (9, 1, 1),
        ] {
            let (a, b) = (draw("a", m, p), draw("b", p, n));
            assert!(
                same_bits(&dot(a.view(), b.view()), &sequential(a.view(), b.view())),
                "{m} {p} {n}"
            );
            // Transposed and strided operands read the same elements.
            let (at, bt) = (a.t().to_owned(), b.t().to_owned());
            assert!(
                same_bits(&dot(at.t(), bt.t()), &sequential(a.view(), b.view())),
                "{m} {p} {n} t"
            );
        }
        let a = draw("a", 20, 30);
        let b = draw("b", 40, 50);
        let (av, bv) = (a.slice(s![..;2, 1..;3]), b.slice(s![..;4, ..;2]));
        assert!(same_bits(&dot(av, bv), &sequential(av, bv)));
        // Reversed axes (negative strides) too.
        let (ar, br) = (a.slice(s![..;-1, ..10]), b.slice(s![..10;-1, ..;-1]));
        assert!(same_bits(&dot(ar, br), &sequential(ar, br)));
        // f32 fills other register blocks.
        let (a32, b32) = (
            a.mapv(|x| x as f32),
            b.slice(s![..30, ..]).mapv(|x| x as f32),
        );
        let want = Array2::from_shape_fn((20, 50), |(i, j)| {
            let mut s = 0.0f32;
            for k in 0..30 {
                s += a32[[i, k]] * b32[[k, j]];
            }
            s
        });
        assert!(dot(a32.view(), b32.view())
            .iter()
            .zip(&want)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
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
