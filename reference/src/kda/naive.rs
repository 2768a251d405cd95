//! KDA's naive recurrent engine: one token at a time, exactly SPEC §3, on
//! the naive engines' driver ([`crate::fast::naive`]); this file is KDA's
//! per-row arithmetic.
//!
//! Each token has two halves: *start* decays the state and forms the residual
//! (`S ← Diag(e^g) S`, `r = v − Sᵀk`), *finish* writes it (`S ← S + β k rᵀ`)
//! and reads out `o = Sᵀq`. The checkpoint pass keeps the residuals `r [L,
//! V]`, which makes recomputing a token one elementwise `S ← e^g ⊙ S + β k
//! rᵀ`. The reverse sweep is the hand-derived reverse-time recurrence; it
//! fuses, row by row, the backward of the start of token `t` with the
//! backward of the finish of token `t − 1`.

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, CowArray, Ix2};

use super::{Kda, KdaHead, KdaHeadGrads, KdaHeadGradsMut};
use crate::fast::naive::{Back, Recurrence, SweepRows};
use crate::fast::scratch::Rows;
use crate::fast::sums::{dot, RowSums, SweepSums};
use crate::fast::sweep::{chunks, chunks_mut, prefetch, spread, Group, Pairs};
use crate::fast::views::{contiguous_rows, row, row_mut};
use crate::op::Engine;
use crate::scalar::Scalar;

/// The naive recurrent engine.
#[derive(Clone, Copy, Debug, Default)]
pub struct Naive;

impl<T: Scalar> Engine<T> for Naive {
    crate::fast::naive::engine!(Kda);
}

impl<T: Scalar> Recurrence<T> for Naive {
    type Op = Kda;
    type Tokens<'a> = Tokens<'a, T>;

    #[inline(always)]
    fn tokens<'a>(x: &'a KdaHead<T>) -> Tokens<'a, T> {
        Tokens {
            q: contiguous_rows(x.q.view()),
            k: contiguous_rows(x.k.view()),
            v: contiguous_rows(x.v.view()),
            scale: x.scale,
            beta: x.beta.view(),
            decay: Rows::exp(contiguous_rows(x.g.view()).view()),
        }
    }

    fn o_dim(x: &KdaHead<T>) -> (usize, usize) {
        (x.len(), x.v_dim())
    }

    fn zero_grads(x: &KdaHead<T>) -> KdaHeadGrads<T> {
        KdaHeadGrads::zeros(x.len(), x.k_dim(), x.v_dim())
    }

    fn sink(g: &mut KdaHeadGrads<T>) -> KdaHeadGradsMut<'_, T> {
        g.view_mut()
    }

    fn dh0<'a>(g: &'a mut KdaHeadGradsMut<'_, T>) -> ArrayViewMut2<'a, T> {
        g.dh0.view_mut()
    }
}

/// What a sweep does to row `i` of the state, one `[K]` slice per
/// coefficient: the finish of token `t − 1` (`S_i += c_i r` with `c = β k`,
/// then `o += q_i S_i`) and the start of token `t` (`S_i *= e_i`, then
/// `r' −= k_i S_i`, from `r' = v`). Those of absent halves are empty.
#[derive(Clone, Copy)]
pub(crate) struct Coefs<'a, T> {
    c: &'a [T],
    q: &'a [T],
    e: &'a [T],
    k: &'a [T],
    /// `v` of the started token.
    v: &'a [T],
}

impl<T: Scalar> SweepRows<T> for Coefs<'_, T> {
    /// `c_i = k_i β`
    type Fin = T;
    /// `(e_i, k_i)`
    type Start = (T, T);
    const EXTRA: bool = false;
    const NEXT0: bool = true;

    #[inline(always)]
    fn len(&self) -> usize {
        self.c.len().max(self.e.len())
    }
    #[inline(always)]
    fn fin(&self, i: usize) -> T {
        self.c[i]
    }
    #[inline(always)]
    fn q(&self, i: usize) -> T {
        self.q[i]
    }
    #[inline(always)]
    fn start(&self, i: usize) -> (T, T) {
        (self.e[i], self.k[i])
    }
    #[inline(always)]
    fn extra(&self) -> &[T] {
        &[]
    }
    #[inline(always)]
    fn next0(&self) -> &[T] {
        self.v
    }
    #[inline(always)]
    fn finish(c: T, x: T, r: T, _: T) -> T {
        x + c * r
    }
    #[inline(always)]
    fn begin((e, k): (T, T), x: T, r: T) -> (T, T) {
        let x = x * e;
        (x, r - k * x)
    }
}

/// The finish's `[K]` coefficients of a sweep, computed per token: `c = β k`
/// and `q · scale`.
pub(crate) struct FinishCoefs<T> {
    c: Vec<T>,
    q: Vec<T>,
}

/// One head's tensors as the sweeps read them, row by row: in standard
/// layout (borrowed when they already are), with the decay `e^g` computed
/// once.
pub(crate) struct Tokens<'a, T: Scalar> {
    q: CowArray<'a, T, Ix2>,
    k: CowArray<'a, T, Ix2>,
    v: CowArray<'a, T, Ix2>,
    /// `q`'s factor ([`KdaHead::scale`]), applied as `q` is read.
    scale: T,
    beta: ArrayView1<'a, T>,
    /// `e^g [L, K]`
    decay: Rows<T>,
}

impl<'t, T: Scalar> crate::fast::naive::Tokens<T> for Tokens<'t, T> {
    type Op = Kda;
    type Rows<'b>
        = Coefs<'b, T>
    where
        Self: 'b;
    type Buf = FinishCoefs<T>;
    type Back<'a>
        = Backward<'a, 't, T>
    where
        Self: 'a;

    #[inline(always)]
    fn dims(&self) -> (usize, usize, usize) {
        (self.k.nrows(), self.k.ncols(), self.v.ncols())
    }

    #[inline(always)]
    fn buf(&self) -> FinishCoefs<T> {
        let kd = self.k.ncols();
        FinishCoefs {
            c: vec![T::zero(); kd],
            q: vec![T::zero(); kd],
        }
    }

    #[inline(always)]
    fn prefetch(&self, n: usize) {
        for a in [row(&self.q, n), row(&self.k, n), row(&self.v, n)] {
            prefetch(a);
        }
    }

    #[inline(always)]
    fn rows<'b>(
        &'b self,
        buf: &'b mut FinishCoefs<T>,
        fin: Option<usize>,
        read: bool,
        start: Option<usize>,
    ) -> Coefs<'b, T> {
        if let Some(t) = fin {
            let (k, beta) = (row(&self.k, t), self.beta[t]);
            for (c, &ki) in buf.c.iter_mut().zip(k) {
                *c = ki * beta;
            }
            if read {
                for (c, &qi) in buf.q.iter_mut().zip(row(&self.q, t)) {
                    *c = qi * self.scale;
                }
            }
        }
        let (e, k, v) = match start {
            Some(t) => (self.decay.row(t), row(&self.k, t), row(&self.v, t)),
            None => (&[][..], &[][..], &[][..]),
        };
        let buf = &*buf;
        Coefs {
            c: if fin.is_some() { &buf.c } else { &[] },
            q: if read { &buf.q } else { &[] },
            e,
            k,
            v,
        }
    }

    /// `S_t = Diag(e^g) S_{t−1} + β k rᵀ` from the kept residual `r_t`, on
    /// [`Pairs`] states: the forward sweep's operations, `(e·s) + (kβ)·r`,
    /// without the reduction.
    #[inline(always)]
    fn replay(&self, t: usize, r: &[T], s_prev: &[T], s: &mut [T]) {
        let vd = r.len();
        if t + 1 < self.k.nrows() {
            prefetch(row(&self.k, t + 1));
        }
        let (e, k, beta) = (self.decay.row(t), row(&self.k, t), self.beta[t]);
        let pairs = Pairs { k: k.len(), v: vd };
        for g in pairs.groups() {
            let coef = |h: usize| {
                let i = g.row + h.min(g.rows - 1);
                (e[i], k[i] * beta)
            };
            let (s, p) = (&mut s[g.range(vd)], &s_prev[g.range(vd)]);
            let coef = [coef(0), coef(1)];
            match g.rows {
                // A pair's chunk of `f32` is half an AVX-512 register: given
                // one chunk an iteration, LLVM widens the loop itself and
                // guards it with runtime overlap checks (the f32 replay took
                // 46 % of the backward); two chunks an iteration fill it.
                2 if size_of::<T>() < 8 => replay_group::<T, 8, 16>(s, p, r, coef),
                2 => replay_group::<T, 8, 8>(s, p, r, coef),
                _ => replay_group::<T, 4, 4>(s, p, r, coef),
            }
        }
    }

    #[inline(always)]
    fn back<'a>(&'a self, rs: &'a Rows<T>, d_o: ArrayView2<'a, T>) -> Backward<'a, 't, T> {
        let (kd, vd) = (self.k.ncols(), self.v.ncols());
        Backward {
            tokens: self,
            rs,
            d_o,
            du: vec![T::zero(); vd],
            dr: vec![T::zero(); vd],
            spread: Spread::new(vd),
            sums: SweepSums::new(kd),
        }
    }
}

/// [`Tokens::replay`] of one row group (`N / 4` rows), `coef[h] = (e, kβ)`
/// of its row `h`, `M / N` chunks of four columns an iteration (`M` a
/// multiple of `N`).
#[inline(always)]
fn replay_group<T: Scalar, const N: usize, const M: usize>(
    s: &mut [T],
    p: &[T],
    r: &[T],
    coef: [(T, T); 2],
) {
    let (rows, cols) = (N / 4, 4 * M / N);
    let (e, c): ([T; M], [T; M]) = (
        std::array::from_fn(|l| coef[l % N / 4].0),
        std::array::from_fn(|l| coef[l % N / 4].1),
    );
    for ((s, p), r) in s
        .chunks_exact_mut(M)
        .zip(p.chunks_exact(M))
        .zip(r.chunks_exact(cols))
    {
        let pv: [T; M] = p.try_into().expect("M");
        let out: [T; M] = std::array::from_fn(|l| pv[l] * e[l] + c[l] * r[l / N * 4 + l % 4]);
        s.copy_from_slice(&out);
    }
    if M > N {
        let done = r.len() / cols * cols;
        let at = done * rows;
        return replay_group::<T, N, N>(&mut s[at..], &p[at..], &r[done..], coef);
    }
    let full = r.len() / 4 * 4;
    let tail = r.len() - full;
    for (h, &(e, c)) in coef.iter().take(rows).enumerate() {
        let at = full * rows + h * tail;
        for j in 0..tail {
            s[at + j] = p[at + j] * e + c * r[full + j];
        }
    }
}

/// The reverse sweeps and the gradients they fill.
pub(crate) struct Backward<'a, 't, T: Scalar> {
    tokens: &'a Tokens<'t, T>,
    /// The residuals `r [L, V]`.
    rs: &'a Rows<T>,
    /// `do [L, V]`
    d_o: ArrayView2<'a, T>,
    /// `du = dS_tᵀ k`, accumulated by the finish backward.
    du: Vec<T>,
    /// `d(S'ᵀk) = −β du`, consumed by the start backward.
    dr: Vec<T>,
    /// The `[V]` vectors of the current sweep as a row pair reads them.
    spread: Spread<T>,
    /// The sweep's row sums: `[S_{t−1} row · dr, ds · S_{t−1} row]` of the
    /// start, `[S_{t−2} row · do, ds · r]` of the finish.
    sums: SweepSums<T, 4>,
}

/// `dr`, `do` and `r` through [`spread`], `[2V]` each.
struct Spread<T> {
    dr: Vec<T>,
    d_o: Vec<T>,
    r: Vec<T>,
}

impl<T: Scalar> Spread<T> {
    fn new(v: usize) -> Self {
        let z = || vec![T::zero(); 2 * v];
        Spread {
            dr: z(),
            d_o: z(),
            r: z(),
        }
    }
}

impl<T: Scalar> Back<T, Kda> for Backward<'_, '_, T> {
    /// Sweep `t` runs the start backward of token `t` and the finish
    /// backward of token `t − 1`, a row group at a time.
    #[inline(always)]
    fn block(
        &mut self,
        start: usize,
        end: usize,
        prev: &[T],
        ds: &mut [T],
        gr: &mut KdaHeadGradsMut<T>,
    ) {
        let x = self.tokens;
        let (kd, vd) = (x.k.ncols(), x.v.ncols());
        let kv = kd * vd;
        let state = |t: usize| &prev[(t - start) * kv..(t - start + 1) * kv];
        for t in (start..=end).rev() {
            if t >= 2 {
                // The finish backward of the next sweep reads token t − 2.
                let p = t - 2;
                for a in [row(&self.d_o, p), row(&x.q, p), row(&x.k, p)] {
                    prefetch(a);
                }
            }
            // Built inline (not through a closure): every call here must
            // compile for the dispatched vector width.
            let start_back = if t < end {
                Some(StartBack {
                    t,
                    k: row(&x.k, t),
                    e: x.decay.row(t),
                    dr: &self.dr,
                    s_prev: state(t),
                })
            } else {
                None
            };
            let finish_back = if t > start {
                let p = t - 1;
                let (r, d_o) = (self.rs.row(p), row(&self.d_o, p));
                Some(FinishBack {
                    t: p,
                    q: row(&x.q, p),
                    scale: x.scale,
                    k: row(&x.k, p),
                    e: x.decay.row(p),
                    beta: x.beta[p],
                    r,
                    d_o,
                    rdo: dot(r, d_o),
                    s_prev: state(p),
                })
            } else {
                None
            };
            let (b, a) = (start_back.as_ref(), finish_back.as_ref());
            let sp = &mut self.spread;
            if b.is_some() {
                spread(&self.dr, &mut sp.dr);
            }
            if let Some(a) = a {
                spread(a.d_o, &mut sp.d_o);
                spread(a.r, &mut sp.r);
            }
            for g in (Pairs { k: kd, v: vd }).groups() {
                let ds = &mut ds[g.range(vd)];
                let (du, sums) = (&mut self.du, &mut self.sums);
                match g.rows {
                    2 => back_group::<T, 8>(g, ds, b, a, Some(sp), du, sums),
                    _ => back_group::<T, 4>(g, ds, b, a, None, du, sums),
                }
            }
            self.sums.finish();
            let [s_dr, ds_s, s_do, ds_r] = &self.sums.done;
            if let Some(b) = b {
                b.grads(
                    s_dr,
                    ds_s,
                    row_mut(&mut gr.dk, b.t),
                    row_mut(&mut gr.dg, b.t),
                );
            }
            if let Some(a) = a {
                // dk of the finished token is set here and completed by its
                // own start backward in the next sweep.
                let (dq, dk) = (row_mut(&mut gr.dq, a.t), row_mut(&mut gr.dk, a.t));
                a.grads(s_do, ds_r, dq, dk);
            }
            if let Some(a) = finish_back {
                a.close(&mut self.du, &mut self.dr, gr);
            }
        }
    }
}

/// The backward of the finish of token `t`: with `S_t = S' + k uᵀ`,
/// `u = β r` and `o = S_tᵀ q`, it gives `dq = S_t do`, `dS_t += q doᵀ`,
/// `du = dS_tᵀ k`, `dk = dS_t u`, then `dβ`, `dv` and `d(S'ᵀk) = −β du`.
struct FinishBack<'a, T> {
    t: usize,
    q: &'a [T],
    /// `q`'s factor.
    scale: T,
    k: &'a [T],
    e: &'a [T],
    beta: T,
    r: &'a [T],
    d_o: &'a [T],
    /// `r · do`
    rdo: T,
    /// `S_{t−1}` ([`Pairs`] layout)
    s_prev: &'a [T],
}

impl<T: Scalar> FinishBack<'_, T> {
    #[inline(always)]
    fn rows<'s>(&'s self, g: Group, n: usize, sp: Option<&'s Spread<T>>) -> FinishRows<'s, T> {
        let last = g.row + g.rows - 1;
        FinishRows {
            q: [self.q[g.row] * self.scale, self.q[last] * self.scale],
            k: [self.k[g.row], self.k[last]],
            s_prev: &self.s_prev[g.range(n)],
            d_o: self.d_o,
            r: self.r,
            d_o_n: sp.map_or(self.d_o, |s| &s.d_o),
            r_n: sp.map_or(self.r, |s| &s.r),
        }
    }

    /// `dq` and `dk` from the rows' reductions `S_{t−1} row · do` and
    /// `ds · r`.
    #[inline(always)]
    fn grads(&self, s_do: &[T], ds_r: &[T], dq: &mut [T], dk: &mut [T]) {
        // dq_i = S_t row · do with S_t row = e·S_{t−1} row + k_i β r.
        let beta = self.beta;
        let rows = dq.iter_mut().zip(dk).zip(self.e).zip(self.k);
        for ((((dq, dk), &e), &k), (&s_do, &ds_r)) in rows.zip(s_do.iter().zip(ds_r)) {
            *dq = e * s_do + k * beta * self.rdo;
            *dk = beta * ds_r;
        }
    }

    /// After all rows: `dβ = du · r`, `dv = β du`, and `dr = −β du` for the
    /// start backward; `du` is cleared for the next token.
    #[inline(always)]
    fn close(&self, du: &mut [T], dr: &mut [T], gr: &mut KdaHeadGradsMut<T>) {
        let (t, beta) = (self.t, self.beta);
        // The sum runs in order (its bits); the rest is element-wise.
        let mut dbeta = T::zero();
        for (&duj, &rj) in du.iter().zip(self.r) {
            dbeta += duj * rj;
        }
        gr.dbeta[t] = dbeta;
        let dv = row_mut(&mut gr.dv, t);
        for ((duj, drj), dvj) in du.iter_mut().zip(dr.iter_mut()).zip(dv) {
            *dvj = beta * *duj;
            *drj = -beta * *duj;
            *duj = T::zero();
        }
    }
}

/// The backward of the start of token `t` (`S' = Diag(e) S_{t−1}`,
/// `r = v − S'ᵀk`): `dS' = dS_t + k drᵀ`, `dk += S' dr`, `dg = Σ_j dS' ⊙ S'`,
/// `dS_{t−1} = Diag(e) dS'`.
struct StartBack<'a, T> {
    t: usize,
    k: &'a [T],
    e: &'a [T],
    /// `d(S'ᵀk)`
    dr: &'a [T],
    /// `S_{t−1}` ([`Pairs`] layout)
    s_prev: &'a [T],
}

impl<T: Scalar> StartBack<'_, T> {
    #[inline(always)]
    fn rows<'s>(&'s self, g: Group, n: usize, sp: Option<&'s Spread<T>>) -> StartRows<'s, T> {
        let last = g.row + g.rows - 1;
        StartRows {
            k: [self.k[g.row], self.k[last]],
            e: [self.e[g.row], self.e[last]],
            s_prev: &self.s_prev[g.range(n)],
            dr: self.dr,
            dr_n: sp.map_or(self.dr, |s| &s.dr),
        }
    }

    /// `dk` and `dg` from the rows' reductions `S_{t−1} row · dr` and
    /// `ds · S_{t−1} row`.
    #[inline(always)]
    fn grads(&self, s_dr: &[T], ds_s: &[T], dk: &mut [T], dg: &mut [T]) {
        // With S' = e·S_{t−1}: dk += S' dr, dg = Σ dS' ⊙ S'.
        let rows = dk.iter_mut().zip(dg).zip(self.e);
        for (((dk, dg), &e), (&s_dr, &ds_s)) in rows.zip(s_dr.iter().zip(ds_s)) {
            *dk += e * s_dr;
            *dg = e * ds_s;
        }
    }
}

/// Row group `g` of reverse sweep `t` (`N / 4` rows): the start backward of
/// token `t`, then the finish backward of token `t − 1`. Both are
/// elementwise along a row, so running them in one pass gives the bits of
/// running them one after the other, with the reductions overlapping instead
/// of each waiting on its own adds.
#[inline(always)]
fn back_group<T: Scalar, const N: usize>(
    g: Group,
    ds: &mut [T],
    start: Option<&StartBack<T>>,
    finish: Option<&FinishBack<T>>,
    sp: Option<&Spread<T>>,
    du: &mut [T],
    out: &mut SweepSums<T, 4>,
) {
    let n = du.len();
    let st = match start {
        Some(b) => b.rows(g, n, sp),
        None => StartRows::default(),
    };
    let fi = match finish {
        Some(a) => a.rows(g, n, sp),
        None => FinishRows::default(),
    };
    let sums = match (start.is_some(), finish.is_some()) {
        (true, true) => back_group_pass::<T, N, true, true>(ds, &st, &fi, du),
        (true, false) => back_group_pass::<T, N, true, false>(ds, &st, &fi, du),
        (false, true) => back_group_pass::<T, N, false, true>(ds, &st, &fi, du),
        (false, false) => return,
    };
    sums.store(g.row, out);
}

/// The rows of a [`StartBack`] group: `ds += k_i dr`, then `ds *= e_i`, with
/// `S_{t−1} row · dr` and `ds · S_{t−1} row` taken between the two.
#[derive(Default)]
struct StartRows<'a, T> {
    k: [T; 2],
    e: [T; 2],
    s_prev: &'a [T],
    dr: &'a [T],
    /// `dr` as the group's chunks meet it (through [`spread`] for a pair).
    dr_n: &'a [T],
}

/// The rows of a [`FinishBack`] group: `ds += q_i do`, `du += k_i ds`, with
/// `S_{t−1} row · do` and `ds · r`.
#[derive(Default)]
struct FinishRows<'a, T> {
    q: [T; 2],
    k: [T; 2],
    s_prev: &'a [T],
    d_o: &'a [T],
    r: &'a [T],
    /// `do` and `r` as the group's chunks meet them.
    d_o_n: &'a [T],
    r_n: &'a [T],
}

/// The pass of [`back_group`] for the halves present (`START`, `FINISH`)
/// over `N / 4` rows in the [`Pairs`] layout; returns, per row, the
/// reductions in [`dot`]'s order: `[S_{t−1} row · dr, ds · S_{t−1} row]` of
/// the start, then `[S_{t−2} row · do, ds · r]` of the finish.
#[inline(always)]
fn back_group_pass<T: Scalar, const N: usize, const START: bool, const FINISH: bool>(
    ds: &mut [T],
    st: &StartRows<T>,
    fi: &FinishRows<T>,
    du: &mut [T],
) -> RowSums<T, N, 4> {
    let (n, rows) = (du.len(), N / 4);
    let (full, nq) = (n / 4 * 4, n / 4);
    let per_row = |c: [T; 2]| -> [T; N] { std::array::from_fn(|l| c[l / 4]) };
    let (sk, se, fq, fk) = (per_row(st.k), per_row(st.e), per_row(fi.q), per_row(fi.k));
    // Whole chunks, each slice cut to the loop's length so that no index
    // in it is checked.
    let (s1, dr) = if START {
        (chunks::<T, N>(st.s_prev, nq), chunks::<T, N>(st.dr_n, nq))
    } else {
        (&[][..], &[][..])
    };
    let (s2, d_o, r) = if FINISH {
        (
            chunks::<T, N>(fi.s_prev, nq),
            chunks::<T, N>(fi.d_o_n, nq),
            chunks::<T, N>(fi.r_n, nq),
        )
    } else {
        (&[][..], &[][..], &[][..])
    };
    let ds_groups = chunks_mut::<T, N>(ds, nq);
    let du_quads = chunks_mut::<T, 4>(du, nq);
    let mut sums = RowSums::<T, N, 4>::new();
    for c in 0..nq {
        let mut d = ds_groups[c];
        if START {
            let (s, dr) = (s1[c], dr[c]);
            for l in 0..N {
                d[l] += sk[l] * dr[l];
                sums.lanes[0][l] += s[l] * dr[l];
                sums.lanes[1][l] += d[l] * s[l];
                d[l] *= se[l];
            }
        }
        if FINISH {
            let (s, d_o, r) = (s2[c], d_o[c], r[c]);
            let mut p = [T::zero(); N];
            for l in 0..N {
                sums.lanes[2][l] += s[l] * d_o[l];
                d[l] += fq[l] * d_o[l];
                p[l] = fk[l] * d[l];
                sums.lanes[3][l] += d[l] * r[l];
            }
            // du gains row 2p's products, then row 2p+1's: each element's
            // order is the row order of the one-row pass.
            let u = &mut du_quads[c];
            for h in 0..rows {
                for l in 0..4 {
                    u[l] += p[h * 4 + l];
                }
            }
        }
        ds_groups[c] = d;
    }
    let tail = n - full;
    for h in 0..rows {
        let at = full * rows + h * tail;
        for j in 0..tail {
            let (x, c) = (at + j, full + j);
            if START {
                ds[x] += st.k[h] * st.dr[c];
                sums.tails[0][h] += st.s_prev[x] * st.dr[c];
                sums.tails[1][h] += ds[x] * st.s_prev[x];
                ds[x] *= st.e[h];
            }
            if FINISH {
                sums.tails[2][h] += fi.s_prev[x] * fi.d_o[c];
                ds[x] += fi.q[h] * fi.d_o[c];
                du[c] += fi.k[h] * ds[x];
                sums.tails[3][h] += ds[x] * fi.r[c];
            }
        }
    }
    sums
}
