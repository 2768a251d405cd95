//! The naive recurrent DPLR form, one token at a time (SPEC §4), with a
//! checkpointed hand-derived backward (`O(√L · K · V)` memory).
//!
//! Each token has two halves: *start* reads the low-rank term from the
//! undecayed state (`w = aᵀ S_{t−1}`), *finish* writes the state
//! (`S_t = Diag(e^gk) S_{t−1} + b wᵀ + k vᵀ`) and reads out `o = S_tᵀ q`. As
//! in the KDA engine, the finish of one token and the start of the next run
//! in one sweep over the state, a tile of columns at a time. The checkpoint
//! pass keeps `w [L, V]`, which makes recomputing a token elementwise, and
//! the reverse sweep fuses, row by row, the backward of token `t`'s start
//! (and decay) with the backward of token `t − 1`'s finish. A
//! forward+backward run reads out `o` during the checkpoint pass instead of
//! running the forward again.
//!
//! Engine calls run through [`simd::dispatch`], hence the `#[inline(always)]`
//! on everything they call per token.

use ndarray::{Array2, ArrayD, ArrayView2, ArrayViewMut2, CowArray, Ix2};

use super::{
    Dplr, DplrGrads, DplrHead, DplrHeadGrads, DplrHeadGradsMut, DplrInputs, DplrOptions,
    DplrOutputs,
};
use crate::error::Result;
use crate::fast::scratch::{self, Rows};
use crate::fast::simd;
use crate::fast::sums::{dot, RowSums, SweepSums};
use crate::fast::sweep::{
    chunks, chunks_mut, contiguous_rows, prefetch, reverse_blocks, row, row_mut, run_tokens,
    spread, state, Group, Pairs, TILE,
};
use crate::op::{self, Engine, HeadSink};
use crate::scalar::Scalar;

#[derive(Clone, Copy, Debug, Default)]
pub struct Naive;

pub fn forward<T: Scalar>(x: &DplrInputs<T>, opt: &DplrOptions) -> Result<DplrOutputs<T>> {
    op::forward(&Naive, x, opt)
}

pub fn backward<T: Scalar>(
    x: &DplrInputs<T>,
    opt: &DplrOptions,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<DplrGrads<T>> {
    op::backward(&Naive, x, opt, d_o, dht)
}

/// What a sweep does to row `i` of the state, one `[K]` slice per
/// coefficient: the finish of token `t − 1` (`S_i ← e_i S_i + b_i w + k_i
/// v`, then `o += q_i S_i`) and the start of token `t` (`w' += a_i S_i`).
/// Those of absent halves are empty.
#[derive(Clone, Copy)]
struct Coefs<'a, T> {
    e: &'a [T],
    b: &'a [T],
    k: &'a [T],
    q: &'a [T],
    a: &'a [T],
}

impl<T> Coefs<'_, T> {
    /// `K`: one of the halves is present.
    fn len(&self) -> usize {
        self.e.len().max(self.a.len())
    }
}

/// The `[V]` vectors of a sweep: `w` and `v` of the finished token, and the
/// outputs `o` and `w' = aᵀS` of the started one.
struct SweepIo<'a, T> {
    w: &'a [T],
    v: &'a [T],
    o: &'a mut [T],
    w_next: &'a mut [T],
}

/// One sweep over the state `s [K, V]`. The halves it runs are constants
/// (`FIN`ish, `READ` out, `START`), so each combination compiles to a loop
/// without branches; vectors of absent halves are never touched.
#[inline(always)]
fn sweep<T: Scalar, const FIN: bool, const READ: bool, const START: bool>(
    s: &mut [T],
    rows: Coefs<T>,
    io: &mut SweepIo<T>,
) {
    let vd = s.len() / rows.len();
    let full = vd / TILE * TILE;
    for j0 in (0..full).step_by(TILE) {
        sweep_tile::<T, TILE, FIN, READ, START>(s, vd, rows, j0, io);
    }
    for j0 in full..vd {
        sweep_tile::<T, 1, FIN, READ, START>(s, vd, rows, j0, io);
    }
}

/// [`sweep`] over columns `j0 .. j0 + W` (the arithmetic per element does not
/// depend on `W`, so the tiling leaves the bits alone). Each row's tile is
/// copied into registers and back, which lets LLVM vectorise it.
#[inline(always)]
fn sweep_tile<T: Scalar, const W: usize, const FIN: bool, const READ: bool, const START: bool>(
    s: &mut [T],
    vd: usize,
    c: Coefs<T>,
    j0: usize,
    io: &mut SweepIo<T>,
) {
    let cols = j0..j0 + W;
    let tile = |a: &[T]| -> [T; W] { a[cols.clone()].try_into().expect("W columns") };
    let zeros = [T::zero(); W];
    let (w, v) = if FIN {
        (tile(io.w), tile(io.v))
    } else {
        (zeros, zeros)
    };
    let (mut o, mut w_next) = (zeros, zeros);
    let at = |a: &[T], i: usize, present: bool| if present { a[i] } else { T::zero() };
    for (i, s_row) in s.chunks_exact_mut(vd).enumerate() {
        let s_tile: &mut [T; W] = (&mut s_row[cols.clone()]).try_into().expect("W columns");
        let mut x = *s_tile;
        // The row's coefficients read before the column loop: read inside
        // it, LLVM may keep the tiles in memory, checking at every row that
        // they do not overlap the coefficients (3–4× slower).
        let (e, b, k) = (at(c.e, i, FIN), at(c.b, i, FIN), at(c.k, i, FIN));
        let (q, a) = (at(c.q, i, READ), at(c.a, i, START));
        for j in 0..W {
            if FIN {
                x[j] = e * x[j] + b * w[j] + k * v[j];
            }
            if READ {
                o[j] += q * x[j];
            }
            if START {
                w_next[j] += a * x[j];
            }
        }
        *s_tile = x;
    }
    if READ {
        io.o[cols.clone()].copy_from_slice(&o);
    }
    if START {
        io.w_next[cols].copy_from_slice(&w_next);
    }
}

/// One head's tensors as the sweeps read them, row by row: in standard
/// layout (borrowed when they already are), with the decay `e^gk` computed
/// once.
struct Tokens<'a, T: Scalar> {
    q: CowArray<'a, T, Ix2>,
    k: CowArray<'a, T, Ix2>,
    a: CowArray<'a, T, Ix2>,
    b: CowArray<'a, T, Ix2>,
    v: CowArray<'a, T, Ix2>,
    /// `q`'s factor ([`DplrHead::scale`]), applied as `q` is read.
    scale: T,
    /// `e^gk [L, K]`
    decay: Rows<T>,
}

/// What a forward run records besides the final state.
struct Record<'a, T: Scalar> {
    /// `o [L, V]`
    o: Option<ArrayViewMut2<'a, T>>,
    /// `w = aᵀ S_{t−1}`, `[L, V]`.
    w: Option<&'a mut Rows<T>>,
    /// The states at the checkpoints of [`run_tokens`], appended.
    checkpoints: Option<&'a mut Vec<T>>,
}

impl<'a, T: Scalar> Tokens<'a, T> {
    #[inline(always)]
    fn new(x: &'a DplrHead<T>) -> Self {
        Tokens {
            q: contiguous_rows(x.q.view()),
            k: contiguous_rows(x.k.view()),
            a: contiguous_rows(x.a.view()),
            b: contiguous_rows(x.b.view()),
            v: contiguous_rows(x.v.view()),
            scale: x.scale,
            decay: Rows::exp(contiguous_rows(x.gk.view()).view()),
        }
    }

    /// Runs all tokens from the state `s` (see [`run_tokens`]), leaving
    /// `S_L` in it.
    #[inline(always)]
    fn run(&self, s: &mut [T], rec: Record<T>) {
        let (l, kd, vd) = (self.k.nrows(), self.k.ncols(), self.v.ncols());
        let Record {
            mut o,
            mut w,
            checkpoints,
        } = rec;
        let (mut w_cur, mut w_next) = (vec![T::zero(); vd], vec![T::zero(); vd]);
        let mut q_buf = vec![T::zero(); kd];
        let mut o_row = vec![T::zero(); if o.is_some() { vd } else { 0 }];
        run_tokens(
            l,
            s,
            checkpoints,
            #[inline(always)]
            |s: &mut [T], fin, start| {
                if let Some(n) = start.map(|t| t + 1).filter(|&n| n < l) {
                    for a in [&self.q, &self.k, &self.a, &self.b, &self.v] {
                        prefetch(row(a, n));
                    }
                }
                let mut io = SweepIo {
                    w: &w_cur,
                    v: fin.map_or(&[], |p| row(&self.v, p)),
                    o: &mut o_row,
                    w_next: &mut w_next,
                };
                self.sweep(s, &mut q_buf, fin, start, &mut io);
                if let (Some(o), Some(p)) = (&mut o, fin) {
                    row_mut(o, p).copy_from_slice(&o_row);
                }
                if let Some(t) = start {
                    if let Some(ws) = &mut w {
                        ws.row_mut(t).copy_from_slice(&w_next);
                    }
                    std::mem::swap(&mut w_cur, &mut w_next);
                }
            },
        );
    }

    /// One sweep finishing token `fin` (reading out `o` when `io.o` is not
    /// empty) and starting token `start`.
    #[inline(always)]
    fn sweep(
        &self,
        s: &mut [T],
        q_buf: &mut [T],
        fin: Option<usize>,
        start: Option<usize>,
        io: &mut SweepIo<T>,
    ) {
        let read = fin.is_some() && !io.o.is_empty();
        let none = &[][..];
        let (e, b, k, q) = match fin {
            Some(t) => {
                if read {
                    for (c, &q) in q_buf.iter_mut().zip(row(&self.q, t)) {
                        *c = q * self.scale;
                    }
                }
                let q = if read { &q_buf[..] } else { none };
                (self.decay.row(t), row(&self.b, t), row(&self.k, t), q)
            }
            None => (none, none, none, none),
        };
        let a = start.map_or(none, |t| row(&self.a, t));
        let rows = Coefs { e, b, k, q, a };
        match (fin.is_some(), read, start.is_some()) {
            (true, true, true) => sweep::<T, true, true, true>(s, rows, io),
            (true, true, false) => sweep::<T, true, true, false>(s, rows, io),
            (true, false, true) => sweep::<T, true, false, true>(s, rows, io),
            (true, false, false) => sweep::<T, true, false, false>(s, rows, io),
            (false, _, true) => sweep::<T, false, false, true>(s, rows, io),
            (false, _, false) => {}
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

impl<T: Scalar> Engine<T> for Naive {
    type Op = Dplr;

    fn forward(&self, x: &DplrHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        simd::dispatch(
            #[inline(always)]
            || forward_head(x, h0),
        )
    }

    fn backward(
        &self,
        x: &DplrHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> DplrHeadGrads<T> {
        let mut gr = DplrHeadGrads::zeros(x.len(), x.k_dim(), x.v_dim());
        simd::dispatch(
            #[inline(always)]
            || backward_head(x, h0, d_o, dht, None, None, gr.view_mut()),
        );
        gr
    }

    /// The backward's own forward run reads out `o` on the way: one run
    /// instead of two, with the bits of each.
    fn forward_backward(
        &self,
        x: &DplrHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ((Array2<T>, Array2<T>), DplrHeadGrads<T>) {
        let (mut o, mut s_l) = (
            Array2::zeros((x.len(), x.v_dim())),
            Array2::zeros(h0.raw_dim()),
        );
        let mut gr = DplrHeadGrads::zeros(x.len(), x.k_dim(), x.v_dim());
        let (o_out, s_out) = (Some(o.view_mut()), Some(s_l.view_mut()));
        simd::dispatch(
            #[inline(always)]
            || backward_head(x, h0, d_o, dht, o_out, s_out, gr.view_mut()),
        );
        ((o, s_l), gr)
    }

    /// [`Engine::forward_backward`] writing `o`, `S_L` and the gradients
    /// row by row into the run's tensors.
    fn forward_backward_into(
        &self,
        x: &DplrHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        out: HeadSink<'_, T, Dplr>,
    ) {
        let (o, s_l) = (Some(out.o), Some(out.final_state));
        simd::dispatch(
            #[inline(always)]
            || backward_head(x, h0, d_o, dht, o, s_l, out.grads),
        )
    }
}

#[inline(always)]
fn forward_head<T: Scalar>(x: &DplrHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
    let mut s = state(h0);
    let mut o = Array2::zeros((x.len(), x.v_dim()));
    let rec = Record {
        o: Some(o.view_mut()),
        w: None,
        checkpoints: None,
    };
    Tokens::new(x).run(&mut s, rec);
    (o, Array2::from_shape_vec(h0.raw_dim(), s).expect("K×V"))
}

/// The gradients, written into `gr`, from a forward run that keeps the
/// checkpoints and the `w` rows, reading out `o` and `S_L` into `o` and
/// `final_state` when given.
#[inline(always)]
fn backward_head<T: Scalar>(
    x: &DplrHead<T>,
    h0: ArrayView2<T>,
    d_o: ArrayView2<T>,
    dht: ArrayView2<T>,
    o: Option<ArrayViewMut2<T>>,
    final_state: Option<ArrayViewMut2<T>>,
    gr: DplrHeadGradsMut<T>,
) {
    let (l, kd, vd) = (x.len(), x.k_dim(), x.v_dim());
    let tokens = Tokens::new(x);
    let mut ws = Rows::overwritten(l, vd);
    let mut checkpoints = scratch::with_capacity(0);
    let rec = Record {
        o,
        w: Some(&mut ws),
        checkpoints: Some(&mut *checkpoints),
    };
    let mut s = state(h0);
    tokens.run(&mut s, rec);
    if let Some(mut out) = final_state {
        out.assign(&ArrayView2::from_shape((kd, vd), &s).expect("K×V"));
    }
    let d_o = contiguous_rows(d_o);
    let mut back = Backward {
        tokens: &tokens,
        ws: &ws,
        d_o: d_o.view(),
        dw: vec![T::zero(); vd],
        dw_next: vec![T::zero(); vd],
        spread: Spread::new(vd),
        sums: SweepSums::new(kd),
        gr,
    };
    let mut ds = state(dht);
    reverse_blocks(
        l,
        Pairs { k: kd, v: vd },
        &checkpoints,
        &mut ds,
        #[inline(always)]
        |t, s_prev: &[T], s: &mut [T]| tokens.replay(t, ws.row(t), s_prev, s),
        #[inline(always)]
        |start, end, prev: &[T], ds: &mut [T]| back.block(start, end, prev, ds),
    );
    back.gr
        .dh0
        .assign(&ArrayView2::from_shape((kd, vd), &ds).expect("K×V"));
}

/// The reverse sweeps and the gradients they fill.
struct Backward<'a, 'g, T: Scalar> {
    tokens: &'a Tokens<'a, T>,
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
    gr: DplrHeadGradsMut<'g, T>,
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

impl<T: Scalar> Backward<'_, '_, T> {
    /// Tokens `start .. end` in reverse; `prev` holds `S_{t−1}` for each and
    /// `ds` holds `∂L/∂S_{end−1}` on entry, `∂L/∂S_{start−1}` on exit (all in
    /// the [`Pairs`] layout). Sweep `t` runs the start backward of token `t`
    /// and the finish backward of token `t − 1`, a row group at a time.
    #[inline(always)]
    fn block(&mut self, start: usize, end: usize, prev: &[T], ds: &mut [T]) {
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
            let gr = &mut self.gr;
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
