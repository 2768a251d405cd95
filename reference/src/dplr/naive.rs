//! DPLR's naive recurrent engine, one token at a time (SPEC §4), on the
//! naive engines' driver ([`crate::fast::naive`]); this file is DPLR's
//! per-row arithmetic.
//!
//! Each token has two halves: *start* reads the low-rank term from the
//! undecayed state (`w = aᵀ S_{t−1}`), *finish* writes the state
//! (`S_t = Diag(e^gk) S_{t−1} + b wᵀ + k vᵀ`) and reads out `o = S_tᵀ q`.
//! The checkpoint pass keeps `w [L, V]`, which makes recomputing a token
//! elementwise, and the reverse sweep fuses, row by row, the backward of
//! token `t`'s start (and decay) with the backward of token `t − 1`'s
//! finish.

use ndarray::{ArrayView2, ArrayViewMut2, CowArray, Ix2};

use super::{Dplr, DplrHead, DplrHeadGrads, DplrHeadGradsMut};
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
    crate::fast::naive::engine!(Dplr);
}

impl<T: Scalar> Recurrence<T> for Naive {
    type Op = Dplr;
    type Tokens<'a> = Tokens<'a, T>;

    #[inline(always)]
    fn tokens<'a>(x: &'a DplrHead<T>) -> Tokens<'a, T> {
        Tokens {
            q: contiguous_rows(x.q.view()),
            k: contiguous_rows(x.k.view()),
            v: contiguous_rows(x.v.view()),
            a: contiguous_rows(x.a.view()),
            b: contiguous_rows(x.b.view()),
            scale: x.scale,
            decay: Rows::exp(contiguous_rows(x.gk.view()).view()),
        }
    }

    fn o_dim(x: &DplrHead<T>) -> (usize, usize) {
        (x.len(), x.v_dim())
    }

    fn zero_grads(x: &DplrHead<T>) -> DplrHeadGrads<T> {
        DplrHeadGrads::zeros(x.len(), x.k_dim(), x.v_dim())
    }

    fn sink(g: &mut DplrHeadGrads<T>) -> DplrHeadGradsMut<'_, T> {
        g.view_mut()
    }

    fn dh0<'a>(g: &'a mut DplrHeadGradsMut<'_, T>) -> ArrayViewMut2<'a, T> {
        g.dh0.view_mut()
    }
}

/// What a sweep does to row `i` of the state, one `[K]` slice per
/// coefficient: the finish of token `t − 1` (`S_i ← e_i S_i + b_i w + k_i
/// v`, then `o += q_i S_i`) and the start of token `t` (`w' += a_i S_i`,
/// from `w' = 0`). Those of absent halves are empty.
#[derive(Clone, Copy)]
pub(crate) struct Coefs<'a, T> {
    e: &'a [T],
    b: &'a [T],
    k: &'a [T],
    q: &'a [T],
    a: &'a [T],
    /// `v` of the finished token.
    v: &'a [T],
}

impl<T: Scalar> SweepRows<T> for Coefs<'_, T> {
    /// `[e_i, b_i, k_i]`
    type Fin = [T; 3];
    /// `a_i`
    type Start = T;
    const EXTRA: bool = true;
    const NEXT0: bool = false;

    #[inline(always)]
    fn len(&self) -> usize {
        self.e.len().max(self.a.len())
    }
    #[inline(always)]
    fn fin(&self, i: usize) -> [T; 3] {
        [self.e[i], self.b[i], self.k[i]]
    }
    #[inline(always)]
    fn q(&self, i: usize) -> T {
        self.q[i]
    }
    #[inline(always)]
    fn start(&self, i: usize) -> T {
        self.a[i]
    }
    #[inline(always)]
    fn extra(&self) -> &[T] {
        self.v
    }
    #[inline(always)]
    fn next0(&self) -> &[T] {
        &[]
    }
    #[inline(always)]
    fn finish([e, b, k]: [T; 3], x: T, w: T, v: T) -> T {
        e * x + b * w + k * v
    }
    #[inline(always)]
    fn begin(a: T, x: T, w: T) -> (T, T) {
        (x, w + a * x)
    }
}

/// One head's tensors as the sweeps read them, row by row: in standard
/// layout (borrowed when they already are), with the decay `e^gk` computed
/// once.
pub(crate) struct Tokens<'a, T: Scalar> {
    q: CowArray<'a, T, Ix2>,
    k: CowArray<'a, T, Ix2>,
    v: CowArray<'a, T, Ix2>,
    a: CowArray<'a, T, Ix2>,
    b: CowArray<'a, T, Ix2>,
    /// `q`'s factor ([`DplrHead::scale`]), applied as `q` is read.
    scale: T,
    /// `e^gk [L, K]`
    decay: Rows<T>,
}

impl<'t, T: Scalar> crate::fast::naive::Tokens<T> for Tokens<'t, T> {
    type Op = Dplr;
    type Rows<'b>
        = Coefs<'b, T>
    where
        Self: 'b;
    /// `q · scale` of the finished token.
    type Buf = Vec<T>;
    type Back<'a>
        = Backward<'a, 't, T>
    where
        Self: 'a;

    #[inline(always)]
    fn dims(&self) -> (usize, usize, usize) {
        (self.k.nrows(), self.k.ncols(), self.v.ncols())
    }

    #[inline(always)]
    fn buf(&self) -> Vec<T> {
        vec![T::zero(); self.k.ncols()]
    }

    #[inline(always)]
    fn prefetch(&self, n: usize) {
        for a in [&self.q, &self.k, &self.a, &self.b, &self.v] {
            prefetch(row(a, n));
        }
    }

    #[inline(always)]
    fn rows<'b>(
        &'b self,
        q_buf: &'b mut Vec<T>,
        fin: Option<usize>,
        read: bool,
        start: Option<usize>,
    ) -> Coefs<'b, T> {
        let none = &[][..];
        if let (Some(t), true) = (fin, read) {
            for (c, &q) in q_buf.iter_mut().zip(row(&self.q, t)) {
                *c = q * self.scale;
            }
        }
        let (e, b, k, v) = match fin {
            Some(t) => (
                self.decay.row(t),
                row(&self.b, t),
                row(&self.k, t),
                row(&self.v, t),
            ),
            None => (none, none, none, none),
        };
        Coefs {
            e,
            b,
            k,
            q: if read { &q_buf[..] } else { none },
            a: start.map_or(none, |t| row(&self.a, t)),
            v,
        }
    }

    /// `S_t = Diag(e^gk) S_{t−1} + b wᵀ + k vᵀ` from the kept `w_t`, on
    /// [`Pairs`] states: the forward sweep's operations without the
    /// reductions.
    #[inline(always)]
    fn replay(&self, t: usize, w: &[T], s_prev: &[T], s: &mut [T]) {
        if t + 1 < self.k.nrows() {
            for a in [&self.b, &self.k, &self.v] {
                prefetch(row(a, t + 1));
            }
        }
        let (e, b, k, v) = (
            self.decay.row(t),
            row(&self.b, t),
            row(&self.k, t),
            row(&self.v, t),
        );
        let vd = w.len();
        for g in (Pairs { k: e.len(), v: vd }).groups() {
            let coef = |h: usize| {
                let i = g.row + h.min(g.rows - 1);
                [e[i], b[i], k[i]]
            };
            let (s, p) = (&mut s[g.range(vd)], &s_prev[g.range(vd)]);
            match g.rows {
                2 => replay_group::<T, 8>(s, p, w, v, [coef(0), coef(1)]),
                _ => replay_group::<T, 4>(s, p, w, v, [coef(0); 2]),
            }
        }
    }

    #[inline(always)]
    fn back<'a>(&'a self, ws: &'a Rows<T>, d_o: ArrayView2<'a, T>) -> Backward<'a, 't, T> {
        let (kd, vd) = (self.k.ncols(), self.v.ncols());
        Backward {
            tokens: self,
            ws,
            d_o,
            dw: vec![T::zero(); vd],
            dw_next: vec![T::zero(); vd],
            spread: Spread::new(vd),
            sums: SweepSums::new(kd),
        }
    }
}

/// [`Tokens::replay`] of one row group (`N / 4` rows), `coef[h] = (e, b, k)`
/// of its row `h`: `s = (e·p + b·w) + k·v`.
#[inline(always)]
fn replay_group<T: Scalar, const N: usize>(
    s: &mut [T],
    p: &[T],
    w: &[T],
    v: &[T],
    coef: [[T; 3]; 2],
) {
    let (rows, full) = (N / 4, w.len() / 4 * 4);
    let lane = |c: usize| -> [T; N] { std::array::from_fn(|l| coef[l / 4][c]) };
    let (e, b, k) = (lane(0), lane(1), lane(2));
    let quads = w.chunks_exact(4).zip(v.chunks_exact(4));
    for ((s, p), (w, v)) in s.chunks_exact_mut(N).zip(p.chunks_exact(N)).zip(quads) {
        let out: [T; N] = std::array::from_fn(|l| e[l] * p[l] + b[l] * w[l % 4] + k[l] * v[l % 4]);
        s.copy_from_slice(&out);
    }
    let tail = w.len() - full;
    for (h, [e, b, k]) in coef.into_iter().take(rows).enumerate() {
        let at = full * rows + h * tail;
        for j in 0..tail {
            s[at + j] = e * p[at + j] + b * w[full + j] + k * v[full + j];
        }
    }
}

/// The reverse sweeps and the gradients they fill.
pub(crate) struct Backward<'a, 't, T: Scalar> {
    tokens: &'a Tokens<'t, T>,
    /// `w = aᵀ S_{t−1}`, `[L, V]`.
    ws: &'a Rows<T>,
    /// `do [L, V]`
    d_o: ArrayView2<'a, T>,
    /// `dw = dS_tᵀ b` of the token whose start backward comes next.
    dw: Vec<T>,
    /// `dw` of the token before, accumulated by its finish backward.
    dw_next: Vec<T>,
    /// The `[V]` vectors of the current sweep as a row pair reads them.
    spread: Spread<T>,
    /// The sweep's row sums: `[S_{t−1} row · dw]` of the start, then
    /// `[S_{t−2} row · do, ds · v, ds · w, ds · S_{t−2} row]` of the finish.
    sums: SweepSums<T, 5>,
}

/// `dw`, `do`, `v` and `w` through [`spread`], `[2V]` each.
struct Spread<T> {
    dw: Vec<T>,
    d_o: Vec<T>,
    v: Vec<T>,
    w: Vec<T>,
}

impl<T: Scalar> Spread<T> {
    fn new(v: usize) -> Self {
        let z = || vec![T::zero(); 2 * v];
        Spread {
            dw: z(),
            d_o: z(),
            v: z(),
            w: z(),
        }
    }
}

impl<T: Scalar> Back<T, Dplr> for Backward<'_, '_, T> {
    /// Sweep `t` runs the start backward of token `t` and the finish
    /// backward of token `t − 1`, a row group at a time.
    #[inline(always)]
    fn block(
        &mut self,
        start: usize,
        end: usize,
        prev: &[T],
        ds: &mut [T],
        gr: &mut DplrHeadGradsMut<T>,
    ) {
        let x = self.tokens;
        let (kd, vd) = (x.k.ncols(), x.v.ncols());
        let kv = kd * vd;
        let state = |t: usize| &prev[(t - start) * kv..(t - start + 1) * kv];
        for t in (start..=end).rev() {
            if t >= 2 {
                // The finish backward of the next sweep reads token t − 2.
                let p = t - 2;
                for a in [&x.q, &x.k, &x.b, &x.v] {
                    prefetch(row(a, p));
                }
                prefetch(row(&self.d_o, p));
            }
            // Built inline (not through a closure): every call here must
            // compile for the dispatched vector width.
            let start_back = if t < end {
                Some(StartBack {
                    t,
                    a: row(&x.a, t),
                    e: x.decay.row(t),
                    dw: &self.dw,
                    s_prev: state(t),
                })
            } else {
                None
            };
            let finish_back = if t > start {
                let p = t - 1;
                let (w, v, d_o) = (self.ws.row(p), row(&x.v, p), row(&self.d_o, p));
                Some(FinishBack {
                    t: p,
                    q: row(&x.q, p),
                    scale: x.scale,
                    k: row(&x.k, p),
                    b: row(&x.b, p),
                    e: x.decay.row(p),
                    w,
                    v,
                    d_o,
                    wdo: dot(w, d_o),
                    vdo: dot(v, d_o),
                    s_prev: state(p),
                })
            } else {
                None
            };
            let (b, a) = (start_back.as_ref(), finish_back.as_ref());
            let sp = &mut self.spread;
            if b.is_some() {
                spread(&self.dw, &mut sp.dw);
            }
            if let Some(a) = a {
                spread(a.d_o, &mut sp.d_o);
                spread(a.v, &mut sp.v);
                spread(a.w, &mut sp.w);
            }
            // The finish backward accumulates `dw` of the token before and
            // `dv` of the finished token (its gradient row) over the rows.
            let dv = a.map_or(&mut [][..], |a| row_mut(&mut gr.dv, a.t));
            let acc = [&mut self.dw_next[..], dv];
            let [dw_next, dv] = acc;
            for g in (Pairs { k: kd, v: vd }).groups() {
                let (ds, sums) = (&mut ds[g.range(vd)], &mut self.sums);
                match g.rows {
                    2 => back_group::<T, 8>(g, ds, b, a, Some(sp), dw_next, dv, sums),
                    _ => back_group::<T, 4>(g, ds, b, a, None, dw_next, dv, sums),
                }
            }
            self.sums.finish();
            let [s_dw, s_do, ds_v, ds_w, ds_s] = &self.sums.done;
            if let Some(b) = b {
                row_mut(&mut gr.da, b.t).copy_from_slice(s_dw);
            }
            if let Some(a) = a {
                a.grads([s_do, ds_v, ds_w, ds_s], gr);
                std::mem::swap(&mut self.dw, &mut self.dw_next);
                self.dw_next.iter_mut().for_each(|d| *d = T::zero());
            }
        }
    }
}

/// The backward of the finish of token `t` (`S_t = Diag(e) S_{t−1} + b wᵀ +
/// k vᵀ`, `o = S_tᵀ q`): `dq = S_t do`, `dS_t += q doᵀ`, `dk = dS_t v`,
/// `db = dS_t w`, `dgk = e ⊙ Σ_j dS_t ⊙ S_{t−1}`, `dw = dS_tᵀ b`,
/// `dv = dS_tᵀ k`.
struct FinishBack<'a, T> {
    t: usize,
    q: &'a [T],
    /// `q`'s factor.
    scale: T,
    k: &'a [T],
    b: &'a [T],
    e: &'a [T],
    w: &'a [T],
    v: &'a [T],
    d_o: &'a [T],
    /// `w · do`
    wdo: T,
    /// `v · do`
    vdo: T,
    /// `S_{t−1}` ([`Pairs`] layout)
    s_prev: &'a [T],
}

impl<T: Scalar> FinishBack<'_, T> {
    #[inline(always)]
    fn rows<'s>(&'s self, g: Group, n: usize, sp: Option<&'s Spread<T>>) -> FinishRows<'s, T> {
        let last = g.row + g.rows - 1;
        let pick = |x: &[T]| [x[g.row], x[last]];
        FinishRows {
            q: pick(self.q).map(|q| q * self.scale),
            b: pick(self.b),
            k: pick(self.k),
            s_prev: &self.s_prev[g.range(n)],
            d_o: self.d_o,
            v: self.v,
            w: self.w,
            d_o_n: sp.map_or(self.d_o, |s| &s.d_o),
            v_n: sp.map_or(self.v, |s| &s.v),
            w_n: sp.map_or(self.w, |s| &s.w),
        }
    }

    /// `dq`, `dk`, `db` and `dgk` of token `t` from the rows' reductions
    /// `[S_{t−1} row · do, ds · v, ds · w, ds · S_{t−1} row]`.
    #[inline(always)]
    fn grads(&self, sums: [&[T]; 4], gr: &mut DplrHeadGradsMut<T>) {
        let [s_do, ds_v, ds_w, ds_s] = sums;
        let t = self.t;
        let coefs = self.e.iter().zip(self.b).zip(self.k);
        // o_j = Σ_i q_i S_t[i, j] with S_t row i = e S_{t−1} row + b_i w + k_i v.
        for (dq, (((&e, &b), &k), &s_do)) in row_mut(&mut gr.dq, t).iter_mut().zip(coefs.zip(s_do))
        {
            *dq = e * s_do + b * self.wdo + k * self.vdo;
        }
        row_mut(&mut gr.dk, t).copy_from_slice(ds_v);
        row_mut(&mut gr.db, t).copy_from_slice(ds_w);
        for ((dgk, &e), &ds_s) in row_mut(&mut gr.dgk, t).iter_mut().zip(self.e).zip(ds_s) {
            *dgk = e * ds_s;
        }
    }
}

/// The backward of the start of token `t` (`w = aᵀ S_{t−1}`) and of its
/// decay: `da = S_{t−1} dw`, `dS_{t−1} = Diag(e) dS_t + a dwᵀ`.
struct StartBack<'a, T> {
    t: usize,
    a: &'a [T],
    e: &'a [T],
    /// `dw = dS_tᵀ b`
    dw: &'a [T],
    /// `S_{t−1}` ([`Pairs`] layout)
    s_prev: &'a [T],
}

impl<T: Scalar> StartBack<'_, T> {
    #[inline(always)]
    fn rows<'s>(&'s self, g: Group, n: usize, sp: Option<&'s Spread<T>>) -> StartRows<'s, T> {
        let last = g.row + g.rows - 1;
        StartRows {
            e: [self.e[g.row], self.e[last]],
            a: [self.a[g.row], self.a[last]],
            s_prev: &self.s_prev[g.range(n)],
            dw: self.dw,
            dw_n: sp.map_or(self.dw, |s| &s.dw),
        }
    }
}

/// Row group `g` of reverse sweep `t` (`N / 4` rows): the start backward of
/// token `t` (updating `ds`), then the finish backward of token `t − 1`
/// (updating `ds`, `dw_next` and `dv`). Both are elementwise along a row, so
/// running them in one pass gives the bits of running them one after the
/// other, with the reductions overlapping instead of each waiting on its own
/// adds. The group's sums are kept unfinished in `out`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn back_group<T: Scalar, const N: usize>(
    g: Group,
    ds: &mut [T],
    start: Option<&StartBack<T>>,
    finish: Option<&FinishBack<T>>,
    sp: Option<&Spread<T>>,
    dw_next: &mut [T],
    dv: &mut [T],
    out: &mut SweepSums<T, 5>,
) {
    let n = ds.len() / g.rows;
    let st = match start {
        Some(b) => b.rows(g, n, sp),
        None => StartRows::default(),
    };
    let fi = match finish {
        Some(a) => a.rows(g, n, sp),
        None => FinishRows::default(),
    };
    let sums = match (start.is_some(), finish.is_some()) {
        (true, true) => back_group_pass::<T, N, true, true>(ds, &st, &fi, dw_next, dv),
        (true, false) => back_group_pass::<T, N, true, false>(ds, &st, &fi, dw_next, dv),
        (false, true) => back_group_pass::<T, N, false, true>(ds, &st, &fi, dw_next, dv),
        (false, false) => return,
    };
    sums.store(g.row, out);
}

/// The rows of a [`StartBack`] group: `ds ← e_i ds + a_i dw`,
/// `da_i = S_{t−1} row · dw`.
#[derive(Default)]
struct StartRows<'a, T> {
    e: [T; 2],
    a: [T; 2],
    s_prev: &'a [T],
    dw: &'a [T],
    /// `dw` as the group's chunks meet it (through [`spread`] for a pair).
    dw_n: &'a [T],
}

/// The rows of a [`FinishBack`] group: `ds += q_i do`, `dw += b_i ds`,
/// `dv += k_i ds`, with `S_{t−1} row · do`, `ds · v`, `ds · w` and
/// `ds · S_{t−1} row`.
#[derive(Default)]
struct FinishRows<'a, T> {
    q: [T; 2],
    b: [T; 2],
    k: [T; 2],
    s_prev: &'a [T],
    d_o: &'a [T],
    v: &'a [T],
    w: &'a [T],
    /// `do`, `v` and `w` as the group's chunks meet them.
    d_o_n: &'a [T],
    v_n: &'a [T],
    w_n: &'a [T],
}

/// The pass of [`back_group`] for the halves present (`START`, `FINISH`)
/// over `N / 4` rows in the [`Pairs`] layout; returns the rows' sums in
/// [`dot`]'s order: `[S_{t−1} row · dw]` of the start, then
/// `[S_{t−2} row · do, ds · v, ds · w, ds · S_{t−2} row]` of the finish.
#[inline(always)]
fn back_group_pass<T: Scalar, const N: usize, const START: bool, const FINISH: bool>(
    ds: &mut [T],
    st: &StartRows<T>,
    fi: &FinishRows<T>,
    dw_next: &mut [T],
    dv: &mut [T],
) -> RowSums<T, N, 5> {
    let rows = N / 4;
    let n = ds.len() / rows;
    let (full, nq) = (n / 4 * 4, n / 4);
    let per_row = |c: [T; 2]| -> [T; N] { std::array::from_fn(|l| c[l / 4]) };
    let (se, sa) = (per_row(st.e), per_row(st.a));
    let (fq, fb, fk) = (per_row(fi.q), per_row(fi.b), per_row(fi.k));
    let (s1, dw) = if START {
        (chunks::<T, N>(st.s_prev, nq), chunks::<T, N>(st.dw_n, nq))
    } else {
        (&[][..], &[][..])
    };
    let (s2, d_o, v, w) = if FINISH {
        (
            chunks::<T, N>(fi.s_prev, nq),
            chunks::<T, N>(fi.d_o_n, nq),
            chunks::<T, N>(fi.v_n, nq),
            chunks::<T, N>(fi.w_n, nq),
        )
    } else {
        (&[][..], &[][..], &[][..], &[][..])
    };
    let (dw_q, dv_q) = if FINISH {
        (chunks_mut::<T, 4>(dw_next, nq), chunks_mut::<T, 4>(dv, nq))
    } else {
        (&mut [][..], &mut [][..])
    };
    let ds_groups = chunks_mut::<T, N>(ds, nq);
    let mut sums = RowSums::<T, N, 5>::new();
    for c in 0..nq {
        let mut d = ds_groups[c];
        if START {
            let (s, dw) = (s1[c], dw[c]);
            for l in 0..N {
                sums.lanes[0][l] += s[l] * dw[l];
                d[l] = se[l] * d[l] + sa[l] * dw[l];
            }
        }
        if FINISH {
            let (s, d_o, v, w) = (s2[c], d_o[c], v[c], w[c]);
            let (mut pb, mut pk) = ([T::zero(); N], [T::zero(); N]);
            for l in 0..N {
                sums.lanes[1][l] += s[l] * d_o[l];
                d[l] += fq[l] * d_o[l];
                sums.lanes[2][l] += d[l] * v[l];
                sums.lanes[3][l] += d[l] * w[l];
                sums.lanes[4][l] += d[l] * s[l];
                pb[l] = fb[l] * d[l];
                pk[l] = fk[l] * d[l];
            }
            // dw and dv gain row 2p's products, then row 2p+1's: each
            // element's order is the row order of the one-row pass.
            for (u, p) in [(&mut dw_q[c], pb), (&mut dv_q[c], pk)] {
                for h in 0..rows {
                    for l in 0..4 {
                        u[l] += p[h * 4 + l];
                    }
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
                sums.tails[0][h] += st.s_prev[x] * st.dw[c];
                ds[x] = st.e[h] * ds[x] + st.a[h] * st.dw[c];
            }
            if FINISH {
                sums.tails[1][h] += fi.s_prev[x] * fi.d_o[c];
                ds[x] += fi.q[h] * fi.d_o[c];
                sums.tails[2][h] += ds[x] * fi.v[c];
                sums.tails[3][h] += ds[x] * fi.w[c];
                sums.tails[4][h] += ds[x] * fi.s_prev[x];
                dw_next[c] += fi.b[h] * ds[x];
                dv[c] += fi.k[h] * ds[x];
            }
        }
    }
    sums
}
