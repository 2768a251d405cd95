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

use ndarray::{Array2, ArrayD, ArrayView2, CowArray, Ix2};

use super::{Dplr, DplrGrads, DplrHead, DplrHeadGrads, DplrInputs, DplrOptions, DplrOutputs};
use crate::error::Result;
use crate::op::{self, Engine};
use crate::scalar::Scalar;
use crate::simd;
use crate::sweep::{quad, reverse_blocks, row, row_mut, run_tokens, state, TILE};
use crate::tensor::{dot, DotSum};

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

/// What a sweep does to row `i` of the state: the finish of token `t − 1`
/// (`S_i ← e_i S_i + b_i w + k_i v`, then `o += q_i S_i`) and the start of
/// token `t` (`w' += a_i S_i`).
#[derive(Clone, Copy, Debug, Default)]
struct RowCoef<T> {
    e: T,
    b: T,
    k: T,
    q: T,
    a: T,
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
    rows: &[RowCoef<T>],
    io: &mut SweepIo<T>,
) {
    let vd = s.len() / rows.len();
    let full = vd / TILE * TILE;
    for j0 in (0..full).step_by(TILE) {
        sweep_tile::<T, TILE, FIN, READ, START>(s, rows, j0, io);
    }
    for j0 in full..vd {
        sweep_tile::<T, 1, FIN, READ, START>(s, rows, j0, io);
    }
}

/// [`sweep`] over columns `j0 .. j0 + W` (the arithmetic per element does not
/// depend on `W`, so the tiling leaves the bits alone). Each row's tile is
/// copied into registers and back, which lets LLVM vectorise it.
#[inline(always)]
fn sweep_tile<T: Scalar, const W: usize, const FIN: bool, const READ: bool, const START: bool>(
    s: &mut [T],
    rows: &[RowCoef<T>],
    j0: usize,
    io: &mut SweepIo<T>,
) {
    let vd = s.len() / rows.len();
    let cols = j0..j0 + W;
    let tile = |a: &[T]| -> [T; W] { a[cols.clone()].try_into().expect("W columns") };
    let zeros = [T::zero(); W];
    let (w, v) = if FIN {
        (tile(io.w), tile(io.v))
    } else {
        (zeros, zeros)
    };
    let (mut o, mut w_next) = (zeros, zeros);
    for (s_row, c) in s.chunks_exact_mut(vd).zip(rows) {
        let s_tile: &mut [T; W] = (&mut s_row[cols.clone()]).try_into().expect("W columns");
        let mut x = *s_tile;
        for j in 0..W {
            if FIN {
                x[j] = c.e * x[j] + c.b * w[j] + c.k * v[j];
            }
            if READ {
                o[j] += c.q * x[j];
            }
            if START {
                w_next[j] += c.a * x[j];
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
struct Tokens<'a, T> {
    q: CowArray<'a, T, Ix2>,
    k: CowArray<'a, T, Ix2>,
    a: CowArray<'a, T, Ix2>,
    b: CowArray<'a, T, Ix2>,
    v: CowArray<'a, T, Ix2>,
    /// `e^gk [L, K]`
    decay: Array2<T>,
}

/// What a forward run records besides the final state.
struct Record<'a, T> {
    /// `o [L, V]`
    o: Option<&'a mut Array2<T>>,
    /// `w = aᵀ S_{t−1}`, `[L, V]`.
    w: Option<&'a mut Array2<T>>,
    /// The states at the checkpoints of [`run_tokens`], appended.
    checkpoints: Option<&'a mut Vec<T>>,
}

impl<'a, T: Scalar> Tokens<'a, T> {
    fn new(x: &'a DplrHead<T>) -> Self {
        Tokens {
            q: x.q.as_standard_layout(),
            k: x.k.as_standard_layout(),
            a: x.a.as_standard_layout(),
            b: x.b.as_standard_layout(),
            v: x.v.as_standard_layout(),
            decay: x.gk.as_standard_layout().mapv(T::exp),
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
        let mut rows = vec![RowCoef::default(); kd];
        let mut o_row = vec![T::zero(); if o.is_some() { vd } else { 0 }];
        run_tokens(
            l,
            s,
            checkpoints,
            #[inline(always)]
            |s: &mut [T], fin, start| {
                let mut io = SweepIo {
                    w: &w_cur,
                    v: fin.map_or(&[], |p| row(&self.v, p)),
                    o: &mut o_row,
                    w_next: &mut w_next,
                };
                self.sweep(s, &mut rows, fin, start, &mut io);
                if let (Some(o), Some(p)) = (&mut o, fin) {
                    row_mut(o, p).copy_from_slice(&o_row);
                }
                if let Some(t) = start {
                    if let Some(ws) = &mut w {
                        row_mut(ws, t).copy_from_slice(&w_next);
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
        rows: &mut [RowCoef<T>],
        fin: Option<usize>,
        start: Option<usize>,
        io: &mut SweepIo<T>,
    ) {
        let read = fin.is_some() && !io.o.is_empty();
        if let Some(t) = fin {
            let coefs = row(&self.decay, t)
                .iter()
                .zip(row(&self.b, t))
                .zip(row(&self.k, t));
            for (c, ((&e, &b), &k)) in rows.iter_mut().zip(coefs) {
                (c.e, c.b, c.k) = (e, b, k);
            }
            if read {
                for (c, &q) in rows.iter_mut().zip(row(&self.q, t)) {
                    c.q = q;
                }
            }
        }
        if let Some(t) = start {
            for (c, &a) in rows.iter_mut().zip(row(&self.a, t)) {
                c.a = a;
            }
        }
        match (fin.is_some(), read, start.is_some()) {
            (true, true, true) => sweep::<T, true, true, true>(s, rows, io),
            (true, true, false) => sweep::<T, true, true, false>(s, rows, io),
            (true, false, true) => sweep::<T, true, false, true>(s, rows, io),
            (true, false, false) => sweep::<T, true, false, false>(s, rows, io),
            (false, _, true) => sweep::<T, false, false, true>(s, rows, io),
            (false, _, false) => {}
        }
    }

    /// `S_t = Diag(e^gk) S_{t−1} + b wᵀ + k vᵀ` from the kept `w_t`: the
    /// forward sweep's operations without the reductions.
    #[inline(always)]
    fn replay(&self, t: usize, w: &[T], s_prev: &[T], s: &mut [T]) {
        let (e, b, k, v) = (
            row(&self.decay, t),
            row(&self.b, t),
            row(&self.k, t),
            row(&self.v, t),
        );
        let rows = s
            .chunks_exact_mut(w.len())
            .zip(s_prev.chunks_exact(w.len()));
        for (i, (s_row, p_row)) in rows.enumerate() {
            let (ei, bi, ki) = (e[i], b[i], k[i]);
            for (((sj, &pj), &wj), &vj) in s_row.iter_mut().zip(p_row).zip(w).zip(v) {
                *sj = ei * pj + bi * wj + ki * vj;
            }
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
        simd::dispatch(
            #[inline(always)]
            || backward_head(x, h0, d_o, dht, None).1,
        )
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
        simd::dispatch(
            #[inline(always)]
            || {
                let mut o = Array2::zeros((x.len(), x.v_dim()));
                let (s_l, gr) = backward_head(x, h0, d_o, dht, Some(&mut o));
                ((o, s_l), gr)
            },
        )
    }
}

#[inline(always)]
fn forward_head<T: Scalar>(x: &DplrHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
    let mut s = state(h0);
    let mut o = Array2::zeros((x.len(), x.v_dim()));
    let rec = Record {
        o: Some(&mut o),
        w: None,
        checkpoints: None,
    };
    Tokens::new(x).run(&mut s, rec);
    (o, Array2::from_shape_vec(h0.raw_dim(), s).expect("K×V"))
}

/// The gradients from a forward run that keeps the checkpoints and the
/// `w` rows, reading out `o` into `o` when given; returns `(S_L, grads)`.
#[inline(always)]
fn backward_head<T: Scalar>(
    x: &DplrHead<T>,
    h0: ArrayView2<T>,
    d_o: ArrayView2<T>,
    dht: ArrayView2<T>,
    o: Option<&mut Array2<T>>,
) -> (Array2<T>, DplrHeadGrads<T>) {
    let (l, kd, vd) = (x.len(), x.k_dim(), x.v_dim());
    let kv = kd * vd;
    let tokens = Tokens::new(x);
    let mut ws = Array2::zeros((l, vd));
    let mut checkpoints = Vec::new();
    let rec = Record {
        o,
        w: Some(&mut ws),
        checkpoints: Some(&mut checkpoints),
    };
    let mut s = state(h0);
    tokens.run(&mut s, rec);
    let s_l = Array2::from_shape_vec(h0.raw_dim(), s).expect("K×V");
    let d_o = d_o.as_standard_layout();
    let z = || Array2::zeros((l, kd));
    let mut back = Backward {
        tokens: &tokens,
        ws: &ws,
        d_o: d_o.as_slice().expect("standard layout"),
        dw: vec![T::zero(); vd],
        dw_next: vec![T::zero(); vd],
        gr: DplrHeadGrads {
            dq: z(),
            dk: z(),
            dv: Array2::zeros((l, vd)),
            da: z(),
            db: z(),
            dgk: z(),
            dh0: Array2::zeros((kd, vd)),
        },
    };
    let mut ds = state(dht);
    reverse_blocks(
        l,
        kv,
        &checkpoints,
        &mut ds,
        #[inline(always)]
        |t, s_prev: &[T], s: &mut [T]| tokens.replay(t, row(&ws, t), s_prev, s),
        #[inline(always)]
        |start, end, prev: &[T], ds: &mut [T]| back.block(start, end, prev, ds),
    );
    let mut gr = back.gr;
    gr.dh0 = Array2::from_shape_vec((kd, vd), ds).expect("K×V");
    (s_l, gr)
}

/// The reverse sweeps and the gradients they fill.
struct Backward<'a, T> {
    tokens: &'a Tokens<'a, T>,
    /// `w = aᵀ S_{t−1}`, `[L, V]`.
    ws: &'a Array2<T>,
    /// `do [L, V]`, row-major.
    d_o: &'a [T],
    /// `dw = dS_tᵀ b` of the token whose start backward comes next.
    dw: Vec<T>,
    /// `dw` of the token before, accumulated by its finish backward.
    dw_next: Vec<T>,
    gr: DplrHeadGrads<T>,
}

impl<T: Scalar> Backward<'_, T> {
    /// Tokens `start .. end` in reverse; `prev` holds `S_{t−1}` for each and
    /// `ds` holds `∂L/∂S_{end−1}` on entry, `∂L/∂S_{start−1}` on exit.
    /// Sweep `t` runs the start backward of token `t` and the finish backward
    /// of token `t − 1`, row by row.
    #[inline(always)]
    fn block(&mut self, start: usize, end: usize, prev: &[T], ds: &mut [T]) {
        let x = self.tokens;
        let (vd, kv) = (x.v.ncols(), x.k.ncols() * x.v.ncols());
        let state = |t: usize| &prev[(t - start) * kv..(t - start + 1) * kv];
        for t in (start..=end).rev() {
            let start_back = (t < end).then(|| StartBack {
                t,
                a: row(&x.a, t),
                e: row(&x.decay, t),
                dw: &self.dw,
                s_prev: state(t),
            });
            let finish_back = (t > start).then(|| {
                let p = t - 1;
                let (w, v, d_o) = (row(self.ws, p), row(&x.v, p), &self.d_o[p * vd..t * vd]);
                FinishBack {
                    t: p,
                    q: row(&x.q, p),
                    k: row(&x.k, p),
                    b: row(&x.b, p),
                    e: row(&x.decay, p),
                    w,
                    v,
                    d_o,
                    wdo: dot(w, d_o),
                    vdo: dot(v, d_o),
                    s_prev: state(p),
                }
            });
            let gr = &mut self.gr;
            for (i, ds_row) in ds.chunks_exact_mut(vd).enumerate() {
                let dv = finish_back
                    .as_ref()
                    .map_or(&mut [][..], |a| row_mut(&mut gr.dv, a.t));
                let r = back_row(
                    i,
                    ds_row,
                    start_back.as_ref(),
                    finish_back.as_ref(),
                    &mut self.dw_next,
                    dv,
                );
                if let Some(b) = &start_back {
                    gr.da[[b.t, i]] = r.da;
                }
                if let Some(a) = &finish_back {
                    let (t, [dq, dk, db, dgk]) = (a.t, r.finish);
                    (gr.dq[[t, i]], gr.dk[[t, i]]) = (dq, dk);
                    (gr.db[[t, i]], gr.dgk[[t, i]]) = (db, dgk);
                }
            }
            if finish_back.is_some() {
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
    /// `S_{t−1}`
    s_prev: &'a [T],
}

/// The per-row gradients of one reverse sweep: `da_i` of the started token
/// and `[dq_i, dk_i, db_i, dgk_i]` of the finished one (zero when absent).
struct RowGrads<T> {
    da: T,
    finish: [T; 4],
}

/// Row `i` of reverse sweep `t`: the start backward of token `t` (updating
/// `ds`), then the finish backward of token `t − 1` (updating `ds`, `dw_next`
/// and `dv`). Both are elementwise along the row, so running them in one pass
/// gives the bits of running them one after the other, with the five
/// reductions overlapping instead of each waiting on its own adds.
#[inline(always)]
fn back_row<T: Scalar>(
    i: usize,
    ds: &mut [T],
    start: Option<&StartBack<T>>,
    finish: Option<&FinishBack<T>>,
    dw_next: &mut [T],
    dv: &mut [T],
) -> RowGrads<T> {
    let n = ds.len();
    let st = start.map_or_else(StartRow::default, |b| b.row(i, n));
    let fi = finish.map_or_else(FinishRow::default, |a| a.row(i, n));
    let sums = match (start.is_some(), finish.is_some()) {
        (true, true) => back_row_pass::<T, true, true>(ds, &st, &fi, dw_next, dv),
        (true, false) => back_row_pass::<T, true, false>(ds, &st, &fi, dw_next, dv),
        (false, true) => back_row_pass::<T, false, true>(ds, &st, &fi, dw_next, dv),
        (false, false) => [T::zero(); 5],
    };
    let finish = finish.map_or([T::zero(); 4], |a| a.grads(i, &fi, &sums));
    RowGrads {
        da: sums[0],
        finish,
    }
}

/// Row `i` of a [`StartBack`]: `ds ← e_i ds + a_i dw`, `da_i = S_{t−1} row · dw`.
#[derive(Default)]
struct StartRow<'a, T> {
    e: T,
    a: T,
    s_prev: &'a [T],
    dw: &'a [T],
}

/// Row `i` of a [`FinishBack`]: `ds += q_i do`, `dw += b_i ds`,
/// `dv += k_i ds`, with `S_{t−1} row · do`, `ds · v`, `ds · w` and
/// `ds · S_{t−1} row`.
#[derive(Default)]
struct FinishRow<'a, T> {
    q: T,
    b: T,
    k: T,
    s_prev: &'a [T],
    d_o: &'a [T],
    v: &'a [T],
    w: &'a [T],
}

/// The pass of [`back_row`] for the halves present (`START`, `FINISH`);
/// returns the reductions in [`dot`]'s order: `[S_{t−1} row · dw]` of the
/// start, then `[S_{t−2} row · do, ds · v, ds · w, ds · S_{t−2} row]` of the
/// finish.
#[inline(always)]
fn back_row_pass<T: Scalar, const START: bool, const FINISH: bool>(
    ds: &mut [T],
    st: &StartRow<T>,
    fi: &FinishRow<T>,
    dw_next: &mut [T],
    dv: &mut [T],
) -> [T; 5] {
    let n = ds.len();
    let (s1, dw) = if START {
        (&st.s_prev[..n], &st.dw[..n])
    } else {
        (&[][..], &[][..])
    };
    let (s2, d_o, v, w) = if FINISH {
        (&fi.s_prev[..n], &fi.d_o[..n], &fi.v[..n], &fi.w[..n])
    } else {
        (&[][..], &[][..], &[][..], &[][..])
    };
    let (dw_next, dv) = if FINISH {
        (&mut dw_next[..n], &mut dv[..n])
    } else {
        (&mut [][..], &mut [][..])
    };
    let mut sums = [DotSum::new(); 5];
    let full = n / 4 * 4;
    for j in (0..full).step_by(4) {
        let q4 = j..j + 4;
        let mut d = quad(&ds[q4.clone()]);
        if START {
            let (sq, dwq) = (quad(&s1[q4.clone()]), quad(&dw[q4.clone()]));
            for l in 0..4 {
                sums[0].lanes[l] += sq[l] * dwq[l];
                d[l] = st.e * d[l] + st.a * dwq[l];
            }
        }
        if FINISH {
            let (sq, doq) = (quad(&s2[q4.clone()]), quad(&d_o[q4.clone()]));
            let (vq, wq) = (quad(&v[q4.clone()]), quad(&w[q4.clone()]));
            let (mut dwv, mut dvv) = (quad(&dw_next[q4.clone()]), quad(&dv[q4.clone()]));
            for l in 0..4 {
                sums[1].lanes[l] += sq[l] * doq[l];
                d[l] += fi.q * doq[l];
                sums[2].lanes[l] += d[l] * vq[l];
                sums[3].lanes[l] += d[l] * wq[l];
                sums[4].lanes[l] += d[l] * sq[l];
                dwv[l] += fi.b * d[l];
                dvv[l] += fi.k * d[l];
            }
            dw_next[q4.clone()].copy_from_slice(&dwv);
            dv[q4.clone()].copy_from_slice(&dvv);
        }
        ds[q4].copy_from_slice(&d);
    }
    for j in full..n {
        if START {
            sums[0].tail += s1[j] * dw[j];
            ds[j] = st.e * ds[j] + st.a * dw[j];
        }
        if FINISH {
            sums[1].tail += s2[j] * d_o[j];
            ds[j] += fi.q * d_o[j];
            sums[2].tail += ds[j] * v[j];
            sums[3].tail += ds[j] * w[j];
            sums[4].tail += ds[j] * s2[j];
            dw_next[j] += fi.b * ds[j];
            dv[j] += fi.k * ds[j];
        }
    }
    sums.map(DotSum::finish)
}

impl<T: Scalar> FinishBack<'_, T> {
    #[inline(always)]
    fn row(&self, i: usize, n: usize) -> FinishRow<'_, T> {
        FinishRow {
            q: self.q[i],
            b: self.b[i],
            k: self.k[i],
            s_prev: &self.s_prev[i * n..(i + 1) * n],
            d_o: self.d_o,
            v: self.v,
            w: self.w,
        }
    }

    /// `[dq_i, dk_i, db_i, dgk_i]` from the row's reductions.
    #[inline(always)]
    fn grads(&self, i: usize, fi: &FinishRow<T>, sums: &[T; 5]) -> [T; 4] {
        let [_, s_do, ds_v, ds_w, ds_s] = *sums;
        let e = self.e[i];
        // o_j = Σ_i q_i S_t[i, j] with S_t row i = e S_{t−1} row + b_i w + k_i v.
        let dq = e * s_do + fi.b * self.wdo + fi.k * self.vdo;
        [dq, ds_v, ds_w, e * ds_s]
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
    /// `S_{t−1}`
    s_prev: &'a [T],
}

impl<T: Scalar> StartBack<'_, T> {
    #[inline(always)]
    fn row(&self, i: usize, n: usize) -> StartRow<'_, T> {
        StartRow {
            e: self.e[i],
            a: self.a[i],
            s_prev: &self.s_prev[i * n..(i + 1) * n],
            dw: self.dw,
        }
    }
}
