//! Element-wise helpers of the chunked engines: one pass over contiguous
//! data instead of one `ndarray` temporary per operation.
//!
//! Every fused loop computes each element with the same operations, in the
//! same order, as the chain of array expressions it replaces, so the results
//! keep their bits.

use std::borrow::Cow;

use ndarray::{Array1, Array2, Array3, ArrayView1, ArrayView2};

use crate::fast::simd;
use crate::fast::stagger;
use crate::scalar::Scalar;

/// The elements of `a` in row-major order: borrowed when `a` is in standard
/// layout (the arrays the engines build, whole rows of them), else copied
/// (a caller's inputs may be strided).
pub(crate) fn flat<'a, T: Clone>(a: ArrayView2<'a, T>) -> Cow<'a, [T]> {
    match a.to_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().cloned().collect()),
    }
}

/// The elements of an owned array in row-major order, for writing (`a` is
/// first moved to standard layout if it is not).
pub(crate) fn flat_mut<T: Clone>(a: &mut Array2<T>) -> &mut [T] {
    if !a.is_standard_layout() {
        *a = a.as_standard_layout().into_owned();
    }
    a.as_slice_mut().expect("standard layout")
}

/// `f(a, b)` element by element for same-shape `a`, `b`: one pass, compiled
/// for the CPU's widest vectors ([`simd::dispatch`]; `f` is inlined into it).
pub(crate) fn zip_map<T: Scalar>(
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    f: impl Fn(T, T) -> T + Copy,
) -> Array2<T> {
    assert_eq!(a.dim(), b.dim(), "zip_map: operands of different shapes");
    let (xs, ys) = (flat(a), flat(b));
    let o = simd::dispatch(
        #[inline(always)]
        || {
            let mut o = stagger::vec(xs.len());
            o.extend(xs.iter().zip(ys.iter()).map(|(&x, &y)| f(x, y)));
            o
        },
    );
    stagger::array(o, a.raw_dim())
}

/// `a ← f(a, b)` element by element for same-shape `a`, `b` (as [`zip_map`]).
pub(crate) fn zip_update<T: Scalar>(
    a: &mut Array2<T>,
    b: ArrayView2<T>,
    f: impl Fn(T, T) -> T + Copy,
) {
    assert_eq!(a.dim(), b.dim(), "zip_update: operands of different shapes");
    let ys = flat(b);
    let xs = flat_mut(a);
    simd::dispatch(
        #[inline(always)]
        || {
            for (x, &y) in xs.iter_mut().zip(ys.iter()) {
                *x = f(*x, y);
            }
        },
    );
}

/// `a ← a + b` element by element for same-shape `a`, `b` (as [`zip_map`]).
pub(crate) fn add_assign<T: Scalar>(a: &mut Array2<T>, b: ArrayView2<T>) {
    zip_update(a, b, |a, b| a + b);
}

/// A `[rows, cols]` array written a block of rows at a time, in order: each
/// element written once, with no zero fill and no second pass (the chunked
/// engines' per-token results and per-chunk states).
pub(crate) struct RowStack<T> {
    data: Vec<T>,
    rows: usize,
    cols: usize,
}

impl<T: Clone> RowStack<T> {
    /// Room for `rows` rows of `cols`.
    pub(crate) fn new(rows: usize, cols: usize) -> Self {
        RowStack {
            data: Vec::with_capacity(rows * cols),
            rows: 0,
            cols,
        }
    }

    /// Appends the rows of `a` `[r, cols]`.
    pub(crate) fn push(&mut self, a: ArrayView2<T>) {
        assert_eq!(a.ncols(), self.cols, "RowStack: rows of another width");
        match a.to_slice() {
            Some(s) => self.data.extend_from_slice(s),
            None => self.data.extend(a.iter().cloned()),
        }
        self.rows += a.nrows();
    }

    /// The rows pushed, `[rows, cols]`.
    pub(crate) fn into_rows(self) -> Array2<T> {
        Array2::from_shape_vec((self.rows, self.cols), self.data).expect("whole rows")
    }

    /// The rows pushed as blocks of `k` rows, `[rows / k, k, cols]`.
    pub(crate) fn into_blocks(self, k: usize) -> Array3<T> {
        let blocks = self.rows.checked_div(k).unwrap_or(0);
        Array3::from_shape_vec((blocks, k, self.cols), self.data).expect("whole blocks")
    }
}

/// `1 / x` of each element (one pass at the CPU's vector width): with `x =
/// exp(d)`, `exp(−d)` within an ulp and a division instead of an
/// exponential.
pub(crate) fn reciprocals<T: Scalar>(x: ArrayView2<T>) -> Array2<T> {
    zip_map(x, x, |x, _| T::one() / x)
}

/// `exp` of each element of `x` in place, at the CPU's vector width
/// ([`Scalar::exp_bounded`], within an ulp); every `|x|` must be at most
/// [`crate::scalar::exp_bound`]; NaN stays NaN.
pub(crate) fn exps_bounded<T: Scalar>(x: &mut Array2<T>) {
    let x = flat_mut(x);
    let bound = crate::scalar::exp_bound::<T>();
    debug_assert!(
        !x.iter().any(|v| v.f64().abs() > bound),
        "exps_bounded: |x| over {bound}"
    );
    simd::dispatch(
        #[inline(always)]
        || x.iter_mut().for_each(|v| *v = v.exp_bounded()),
    );
}

/// `exp` of each element of `x` (any range) with libm's bits
/// ([`Scalar::exp_into`]: vectorised in `f64`), in a new array.
pub(crate) fn exps<T: Scalar>(x: ArrayView2<T>) -> Array2<T> {
    let src = flat(x);
    let mut out = Array2::zeros(x.raw_dim());
    let dst = flat_mut(&mut out);
    simd::dispatch(
        #[inline(always)]
        || T::exp_into(&src, dst),
    );
    out
}

/// `x ⊙ f` for each pair `(x, f)` of same-shape arrays.
pub(crate) fn products<T: Scalar, const N: usize>(
    pairs: [(ArrayView2<T>, ArrayView2<T>); N],
) -> [Array2<T>; N] {
    pairs.map(|(x, f)| zip_map(x, f, |x, f| x * f))
}

/// `s ← ((s ⊙ e) + x₁) + x₂ …` for `s`, `xᵢ` `[K, V]` and `e [K]` (one decay
/// per row): a state carried over one chunk.
pub(crate) fn decay_add<T: Scalar>(s: &mut Array2<T>, e: &Array1<T>, terms: &[&Array2<T>]) {
    let vd = s.ncols();
    let terms: Vec<_> = terms.iter().map(|x| flat(x.view())).collect();
    let s = flat_mut(s);
    simd::dispatch(
        #[inline(always)]
        || {
            for (row, &e) in s.chunks_exact_mut(vd).zip(e) {
                row.iter_mut().for_each(|x| *x *= e);
            }
            for x in &terms {
                for (y, &x) in s.iter_mut().zip(x.iter()) {
                    *y += x;
                }
            }
        },
    );
}

/// `s ← (s ⊙ e) + a₁ b₁ + a₂ b₂ …` for `s [K, V]`, `e [K]` (one decay per
/// row) and `aᵢ [K, nᵢ]`, `bᵢ [nᵢ, V]`: each element's sum goes on from its
/// decayed value through every product's terms ([`crate::fast::gemm::dot_add`]),
/// with no separate product to store and add.
pub(crate) fn decay_add_products<T: Scalar>(
    s: &mut Array2<T>,
    e: &Array1<T>,
    products: &[(ArrayView2<T>, ArrayView2<T>)],
) {
    decay_add(s, e, &[]);
    for (a, b) in products {
        crate::fast::gemm::dot_add(a.view(), b.view(), s.view_mut());
    }
}

/// Cumulative sum down the rows of `g [c, K]`, in place: row `r` becomes
/// `row_r + row_{r−1}` (already summed), column by column in order (Γ from
/// the per-token log-decays).
pub(crate) fn cumsum_rows<T: Scalar>(g: &mut Array2<T>) {
    let (c, kd) = g.dim();
    let data = flat_mut(g);
    simd::dispatch(
        #[inline(always)]
        || {
            for r in 1..c {
                let (done, rest) = data.split_at_mut(r * kd);
                for (x, &y) in rest[..kd].iter_mut().zip(&done[(r - 1) * kd..]) {
                    *x += y;
                }
            }
        },
    );
}

/// Reverse cumulative sum down the rows of `g [c, K]`, in place: the
/// gradient of an in-chunk cumulative sum (`Γ_r = Σ_{i≤r} g_i`).
pub(crate) fn reverse_cumsum_rows<T: Scalar>(g: &mut Array2<T>) {
    let (c, kd) = g.dim();
    let data = flat_mut(g);
    simd::dispatch(
        #[inline(always)]
        || {
            for r in (0..c.saturating_sub(1)).rev() {
                let (head, tail) = data.split_at_mut((r + 1) * kd);
                for (x, &y) in head[r * kd..].iter_mut().zip(&tail[..kd]) {
                    *x += y;
                }
            }
        },
    );
}

/// `exp(x)` of each `x`, when every result is a normal number (`None`
/// otherwise): the per-column factors of [`scale_columns`], which must not
/// underflow where the direct exponentials would not.
pub(crate) fn normal_exps<T: Scalar>(x: impl Iterator<Item = T>) -> Option<Vec<T>> {
    let e: Vec<T> = x.map(|x| x.exp()).collect();
    e.iter().all(|&v| v >= T::min_positive_value()).then_some(e)
}

/// Row `m = c / 2` of `Γ [c, K]`: the row both chunked engines' decay
/// factors `exp(Γ − Γ_m)`, `exp(Γ_m − Γ)` go through.
pub(crate) fn mid_row<T>(g: &Array2<T>) -> ArrayView1<'_, T> {
    g.row(g.nrows() / 2)
}

/// `x[r, c] − g_m[c]` for the [`mid_row`] `g_m` of `g` (`x`, `g` `[c, K]`),
/// or `None` when an element's magnitude exceeds `limit` (NaN does not).
/// Two passes that vectorise, where `x − g_m` broadcast by `ndarray` and an
/// early-exit search did not.
pub(crate) fn minus_mid_row<T: Scalar>(
    g: &Array2<T>,
    x: &Array2<T>,
    limit: f64,
) -> Option<Array2<T>> {
    assert_eq!(
        g.dim(),
        x.dim(),
        "minus_mid_row: operands of different shapes"
    );
    let mid = mid_row(g).to_vec();
    let xs = flat(x.view());
    let (o, over) = simd::dispatch(
        #[inline(always)]
        || {
            let mut o = stagger::vec(xs.len());
            let pad = o.len();
            for row in xs.chunks_exact(mid.len().max(1)) {
                o.extend(row.iter().zip(&mid).map(|(&x, &m)| x - m));
            }
            let over = o[pad..]
                .iter()
                .fold(false, |over, d| over | (d.f64().abs() > limit));
            (o, over)
        },
    );
    (!over).then(|| stagger::array(o, x.raw_dim()))
}

/// `exp` of the last row of `g [c, K]` (`exp(Γ_last)`), `[K]`.
pub(crate) fn exps_of_last_row<T: Scalar>(g: &Array2<T>) -> Array1<T> {
    g.row(g.nrows() - 1).mapv(|v| v.exp())
}

/// `(exp(Γ_m), exp(Γ_last − Γ_m))`, `[K]` each, for the [`mid_row`] `m`
/// and the last row of `g [c, K]`: the per-column factors that
/// [`scale_columns`] turns `exp(Γ − Γ_m)` and `exp(Γ_m − Γ)` into `exp(Γ)`
/// and `exp(Γ_last − Γ)` with. `None` unless every one is normal.
pub(crate) fn mid_row_exps<T: Scalar>(g: &Array2<T>) -> Option<(Vec<T>, Vec<T>)> {
    let (mid, last) = (mid_row(g), g.row(g.nrows() - 1));
    let e_mid = normal_exps(mid.iter().copied())?;
    let e_last = normal_exps(last.iter().zip(&mid).map(|(&l, &m)| l - m))?;
    Some((e_mid, e_last))
}

/// `f ⊙ e` for `f [c, K]` and `e [K]` broadcast over the rows: rebuilds an
/// exponential from its factor through a chunk's middle row `m`, e.g.
/// `exp(Γ) = exp(Γ − Γ_m)·exp(Γ_m)` (within an ulp of the direct one), which
/// costs `K` exponentials per chunk instead of `c·K`.
pub(crate) fn scale_columns<T: Scalar>(f: &Array2<T>, e: &[T]) -> Array2<T> {
    assert_eq!(f.ncols(), e.len(), "scale_columns: one factor per column");
    let xs = flat(f.view());
    let o = simd::dispatch(
        #[inline(always)]
        || {
            let mut o = stagger::vec(xs.len());
            for row in xs.chunks_exact(e.len()) {
                o.extend(row.iter().zip(e).map(|(&x, &e)| x * e));
            }
            o
        },
    );
    stagger::array(o, f.raw_dim())
}

/// `x ⊙ scale_columns(f, e)` in one pass: `x[r, c]·(f[r, c]·e[c])`, the
/// same operations as forming the scaled `f` first (`x`, `f` `[R, C]`,
/// `e [C]`).
pub(crate) fn times_scaled_columns<T: Scalar>(
    x: ArrayView2<T>,
    f: &Array2<T>,
    e: &[T],
) -> Array2<T> {
    assert_eq!(
        x.dim(),
        f.dim(),
        "times_scaled_columns: operands of different shapes"
    );
    assert_eq!(
        f.ncols(),
        e.len(),
        "times_scaled_columns: one factor per column"
    );
    let (xs, fs) = (flat(x), flat(f.view()));
    let o = simd::dispatch(
        #[inline(always)]
        || {
            let mut o = stagger::vec(xs.len());
            let rows = xs.chunks_exact(e.len().max(1));
            for (xr, fr) in rows.zip(fs.chunks_exact(e.len().max(1))) {
                o.extend(xr.iter().zip(fr).zip(e).map(|((&x, &f), &e)| x * (f * e)));
            }
            o
        },
    );
    stagger::array(o, x.raw_dim())
}

/// `f[r, c] · e[r]`: each row of `f [R, C]` scaled by its factor `e [R]`.
pub(crate) fn scale_rows<T: Scalar>(f: ArrayView2<T>, e: &[T]) -> Array2<T> {
    assert_eq!(f.nrows(), e.len(), "scale_rows: one factor per row");
    let xs = flat(f);
    let o = simd::dispatch(
        #[inline(always)]
        || {
            let mut o = stagger::vec(xs.len());
            for (row, &e) in xs.chunks_exact(f.ncols().max(1)).zip(e) {
                o.extend(row.iter().map(|&x| x * e));
            }
            o
        },
    );
    stagger::array(o, f.raw_dim())
}

/// What [`gate_grads`] reads, `[c, K]` each: the chunk's raw `q`, `k`, `b`;
/// `e^Γ`, `e^Γx`, `dl = e^{Γlast − Γ}`; the gated operands `ax`, `kgl`,
/// `bgl`; the gradients of the gated operands as stored (`dax`, `dqg`,
/// `dkgl`, `dbgl`) and the fp32 accumulators of `dkg`, `dbg`.
pub(crate) struct GateOperands<'a, T> {
    pub(crate) q: ArrayView2<'a, T>,
    pub(crate) k: ArrayView2<'a, T>,
    pub(crate) b: ArrayView2<'a, T>,
    pub(crate) eg: ArrayView2<'a, T>,
    pub(crate) egx: ArrayView2<'a, T>,
    pub(crate) dl: ArrayView2<'a, T>,
    pub(crate) ax: ArrayView2<'a, T>,
    pub(crate) kgl: ArrayView2<'a, T>,
    pub(crate) bgl: ArrayView2<'a, T>,
    pub(crate) dax: ArrayView2<'a, T>,
    pub(crate) dqg: ArrayView2<'a, T>,
    pub(crate) dkgl: ArrayView2<'a, T>,
    pub(crate) dbgl: ArrayView2<'a, T>,
    pub(crate) dkg_acc: ArrayView2<'a, T>,
    pub(crate) dbg_acc: ArrayView2<'a, T>,
}

/// The gradients through a chunk's gates, `[c, K]` each: `dq`, `dk`, `da`,
/// `db`, `dΓ` and `dΓx` (before the A blocks add theirs), and the two
/// chunk-end terms of `dΓlast` (`[K]` each, added in this order).
pub(crate) struct GateGrads<T> {
    pub(crate) rows: [Array2<T>; 6],
    pub(crate) last: [Array1<T>; 2],
}

/// [`GateGrads`] in one pass over the chunk: `dq = dqg·e^Γ`,
/// `dΓ = dqg·(q·e^Γ) − dkgl·(k·dl) − dbgl·(b·dl)`, `dk = dkgl·dl`,
/// `db = dbgl·dl`, `da = dax·e^Γx`, `dΓx = dax·ax`; `dΓlast` gets the
/// column sums of `dkg_acc·kgl` and `dbg_acc·bgl`, row by row from zero.
///
/// Exactly `−dkgl·(k·dl)` and the `kgl` column sum cancel, but FLA's
/// chunk-end term `dgk_last` sums the fp32 accumulators times the stored
/// bf16 `kg`, `bg`, while the per-token `−dk·k` multiplies the stored bf16
/// `dkg` by `k·e^{Γlast−Γ}` in fp32: the mismatch lands on every position of
/// the chunk. The decay gradient's `dq·q` (`chunk_dplr_bwd_kernel_intra`)
/// reads the raw `q` in fp32.
pub(crate) fn gate_grads<T: Scalar>(x: GateOperands<T>) -> GateGrads<T> {
    let (c, kd) = x.q.dim();
    let n = c * kd;
    let ins = [
        x.q, x.k, x.b, x.eg, x.egx, x.dl, x.ax, x.kgl, x.bgl, x.dax, x.dqg, x.dkgl, x.dbgl,
        x.dkg_acc, x.dbg_acc,
    ]
    .map(flat);
    let [q, k, b, eg, egx, dl, ax, kgl, bgl, dax, dqg, dkg, dbg, dkg_acc, dbg_acc] =
        ins.each_ref().map(|a| &a[..n]);
    // The rows are written once each below (no zero fill first).
    let mut rows = [(); 6].map(|_| stagger::vec(n));
    let mut last = [(); 2].map(|_| vec![T::zero(); kd]);
    // Slices of known lengths (`n`, `kd`): the loops below then have no
    // bounds checks and vectorise.
    let [dq, dk, da, db, dgamma, dgx] = rows.each_mut().map(|r| &mut r.spare_capacity_mut()[..n]);
    let [last_k, last_b] = last.each_mut().map(|l| &mut l[..kd]);
    simd::dispatch(
        #[inline(always)]
        || {
            for i in 0..n {
                dq[i].write(dqg[i] * eg[i]);
                dk[i].write(dkg[i] * dl[i]);
                db[i].write(dbg[i] * dl[i]);
                da[i].write(dax[i] * egx[i]);
                dgx[i].write(dax[i] * ax[i]);
                let g = dqg[i] * (q[i] * eg[i]);
                let g = g - dkg[i] * (k[i] * dl[i]);
                dgamma[i].write(g - dbg[i] * (b[i] * dl[i]));
            }
            let k_rows = dkg_acc.chunks_exact(kd).zip(kgl.chunks_exact(kd));
            let b_rows = dbg_acc.chunks_exact(kd).zip(bgl.chunks_exact(kd));
            for ((ka, kg), (ba, bg)) in k_rows.zip(b_rows) {
                for d in 0..kd {
                    last_k[d] += ka[d] * kg[d];
                    last_b[d] += ba[d] * bg[d];
                }
            }
        },
    );
    for r in &mut rows {
        // SAFETY: the loop above wrote the `n` elements of every row
        // vector's spare capacity, which starts after its padding.
        unsafe { r.set_len(r.len() + n) };
    }
    let shape = |v: Vec<T>| stagger::array(v, ndarray::Ix2(c, kd));
    GateGrads {
        rows: rows.map(shape),
        last: last.map(Array1::from),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exps_in_place_are_the_bounded_exp_of_each_element() {
        // 37 columns: whole vectors and a remainder at every width.
        let x = Array2::from_shape_fn((5, 37), |(r, c)| (r as f64 - 2.0) * 31.7 + c as f64 * 0.61);
        let mut e = x.clone();
        e[[3, 5]] = f64::NAN;
        exps_bounded(&mut e);
        for ((r, c), v) in e.indexed_iter() {
            if (r, c) == (3, 5) {
                assert!(v.is_nan());
            } else {
                assert_eq!(v.to_bits(), x[[r, c]].exp_bounded().to_bits(), "[{r}, {c}]");
            }
        }
    }

    #[test]
    fn column_factors_rebuild_the_exponentials_or_refuse_to_underflow() {
        let g = ndarray::arr2(&[[-0.5, -3.0], [-1.25, -7.5], [-2.0, -9.0]]);
        let m = g.row(1);
        let e_mid = normal_exps(m.iter().copied()).expect("normal");
        let rebuilt = scale_columns(&(&g - &m).mapv(f64::exp), &e_mid);
        for (x, y) in rebuilt.iter().zip(g.mapv(f64::exp).iter()) {
            assert!((x - y).abs() <= 2.0 * f64::EPSILON * y, "{x} {y}");
        }
        let (e_mid, e_last) = mid_row_exps(&g).expect("normal");
        assert_eq!(e_mid, m.mapv(f64::exp).to_vec());
        let rebuilt_tl = scale_columns(&(&m - &g).mapv(f64::exp), &e_last);
        let last = g.row(2);
        for (x, y) in rebuilt_tl.iter().zip((&last - &g).mapv(f64::exp).iter()) {
            assert!((x - y).abs() <= 2.0 * f64::EPSILON * y, "{x} {y}");
        }
        let mut deep = g.clone();
        deep.row_mut(1).fill(-800.0);
        assert!(mid_row_exps(&deep).is_none());
        // exp(-746) is below the smallest subnormal and exp(-709) is
        // subnormal: the direct form must be used for such a chunk.
        assert!(normal_exps([-1.0, -746.0].into_iter()).is_none());
        assert!(normal_exps([-709.0_f64].into_iter()).is_none());
        assert!(normal_exps([-87.0_f32, -88.0].into_iter()).is_none());
    }

    #[test]
    fn scaled_rows_and_columns_are_the_broadcast_products() {
        let f = ndarray::arr2(&[[1.5, -2.0, 0.25], [3.0, 0.5, -1.0]]);
        let (er, ec) = ([0.1, -3.0], [2.0, 0.3, -7.0]);
        let want_r = &f * &ndarray::aview1(&er).insert_axis(ndarray::Axis(1));
        let want_c = &f * &ndarray::aview1(&ec).insert_axis(ndarray::Axis(0));
        assert_eq!(scale_rows(f.view(), &er), want_r);
        assert_eq!(scale_columns(&f, &ec), want_c);
        // A transposed (not standard layout) operand reads the same elements.
        let ft = f.t().to_owned();
        assert_eq!(scale_rows(ft.t(), &er), want_r);
        // Differences from the middle row, refused past the limit.
        let g = ndarray::arr2(&[[-1.0, -2.0], [-1.5, -4.0], [-2.25, -9.0]]);
        let want = &g - &g.row(1).insert_axis(ndarray::Axis(0));
        assert_eq!(minus_mid_row(&g, &g, 5.0), Some(want));
        assert_eq!(minus_mid_row(&g, &g, 4.9), None);
        let nan = g.mapv(|v| if v == -9.0 { f64::NAN } else { v });
        assert!(minus_mid_row(&g, &nan, 4.9).is_some());
        // One pass of x ⊙ (f ⊙ e) has the bits of the two passes.
        let x = ndarray::arr2(&[[0.7, 1.1, -3.0], [2.5, -0.9, 0.125]]);
        let two_passes = zip_map(x.view(), scale_columns(&f, &ec).view(), |x, g| x * g);
        let one = times_scaled_columns(x.view(), &f, &ec);
        assert!(one
            .iter()
            .zip(&two_passes)
            .all(|(a, b): (&f64, &f64)| a.to_bits() == b.to_bits()));
    }
}
