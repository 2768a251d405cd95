//! The naive recurrent form: one token at a time, exactly SPEC §3.
//!
//! Each token has two halves: *start* decays the state and forms the residual
//! (`S ← Diag(e^g) S`, `r = v − Sᵀk`), *finish* writes it (`S ← S + β k rᵀ`)
//! and reads out `o = Sᵀq`. The finish of one token and the start of the next
//! run in one sweep over the `[K, V]` state, a tile of columns at a time, so
//! the state is read and written once per token and the `[V]` accumulators
//! (`o`, the next `r`) stay in registers down the `K` rows.
//!
//! Backward is the hand-derived reverse-time recurrence. States are kept only
//! at checkpoints every `⌈√L⌉` tokens and recomputed per block, so memory is
//! `O(√L · K · V)` rather than `O(L · K · V)`. The checkpoint pass also keeps
//! the residuals `r [L, V]`, which makes recomputing a token one elementwise
//! `S ← e^g ⊙ S + β k rᵀ`. The reverse sweep fuses, row by row, the backward
//! of the start of token `t` with the backward of the finish of token `t − 1`.
//! A forward+backward run ([`Engine::forward_backward`]) reads out `o` during
//! the checkpoint pass instead of running the forward again.
//!
//! Engine calls run through [`simd::dispatch`], hence the `#[inline(always)]`
//! on everything they call per token.

use ndarray::{Array1, Array2, ArrayD, ArrayView1, ArrayView2, CowArray, Ix2};

use super::{Kda, KdaGrads, KdaHead, KdaHeadGrads, KdaInputs, KdaOptions, KdaOutputs};
use crate::error::Result;
use crate::op::{self, Engine};
use crate::scalar::Scalar;
use crate::simd;
use crate::sweep::{quad, reverse_blocks, row, row_mut, run_tokens, state, TILE};
use crate::tensor::{dot, DotSum};

/// The naive recurrent engine.
#[derive(Clone, Copy, Debug, Default)]
pub struct Naive;

/// `forward(&Naive, …)`: outputs `o [B,T,HV,V]` and optionally `final_state`.
pub fn forward<T: Scalar>(x: &KdaInputs<T>, opt: &KdaOptions) -> Result<KdaOutputs<T>> {
    op::forward(&Naive, x, opt)
}

/// `backward(&Naive, …)`: all gradients from `do` and optional `dht`.
pub fn backward<T: Scalar>(
    x: &KdaInputs<T>,
    opt: &KdaOptions,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<KdaGrads<T>> {
    op::backward(&Naive, x, opt, d_o, dht)
}

/// What a sweep does to row `i` of the state: the finish of token `t − 1`
/// (`S_i += c_i r` with `c = β k`, then `o += q_i S_i`) and the start of
/// token `t` (`S_i *= e_i`, then `r' −= k_i S_i`).
#[derive(Clone, Copy, Debug, Default)]
struct RowCoef<T> {
    c: T,
    q: T,
    e: T,
    k: T,
}

/// The `[V]` vectors of a sweep: the residual `r` of the finished token, the
/// value `v` of the started one, and the outputs `o` and `r' = v − S'ᵀk`.
struct SweepIo<'a, T> {
    r: &'a [T],
    v: &'a [T],
    o: &'a mut [T],
    r_next: &'a mut [T],
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
    let r = if FIN { tile(io.r) } else { zeros };
    let (mut o, mut r_next) = (zeros, if START { tile(io.v) } else { zeros });
    for (s_row, c) in s.chunks_exact_mut(vd).zip(rows) {
        let s_tile: &mut [T; W] = (&mut s_row[cols.clone()]).try_into().expect("W columns");
        let mut x = *s_tile;
        for j in 0..W {
            if FIN {
                x[j] += c.c * r[j];
            }
            if READ {
                o[j] += c.q * x[j];
            }
            if START {
                x[j] *= c.e;
                r_next[j] -= c.k * x[j];
            }
        }
        *s_tile = x;
    }
    if READ {
        io.o[cols.clone()].copy_from_slice(&o);
    }
    if START {
        io.r_next[cols].copy_from_slice(&r_next);
    }
}

/// One head's tensors as the sweeps read them, row by row: in standard
/// layout (borrowed when they already are), with the decay `e^g` computed
/// once.
struct Tokens<'a, T> {
    q: CowArray<'a, T, Ix2>,
    k: CowArray<'a, T, Ix2>,
    v: CowArray<'a, T, Ix2>,
    beta: ArrayView1<'a, T>,
    /// `e^g [L, K]`
    decay: Array2<T>,
}

/// What a forward run records besides the final state.
struct Record<'a, T> {
    /// `o [L, V]`
    o: Option<&'a mut Array2<T>>,
    /// The residuals `r [L, V]`.
    r: Option<&'a mut Array2<T>>,
    /// The states at the checkpoints of [`run_tokens`], appended.
    checkpoints: Option<&'a mut Vec<T>>,
}

impl<'a, T: Scalar> Tokens<'a, T> {
    fn new(x: &'a KdaHead<T>) -> Self {
        Tokens {
            q: x.q.as_standard_layout(),
            k: x.k.as_standard_layout(),
            v: x.v.as_standard_layout(),
            beta: x.beta.view(),
            decay: x.g.as_standard_layout().mapv(T::exp),
        }
    }

    /// Runs all tokens from the state `s` (see [`run_tokens`]), leaving
    /// `S_L` in it.
    #[inline(always)]
    fn run(&self, s: &mut [T], rec: Record<T>) {
        let (l, kd, vd) = (self.k.nrows(), self.k.ncols(), self.v.ncols());
        let Record {
            mut o,
            mut r,
            checkpoints,
        } = rec;
        let (mut r_cur, mut r_next) = (vec![T::zero(); vd], vec![T::zero(); vd]);
        let mut rows = vec![RowCoef::default(); kd];
        let mut o_row = vec![T::zero(); if o.is_some() { vd } else { 0 }];
        run_tokens(
            l,
            s,
            checkpoints,
            #[inline(always)]
            |s: &mut [T], fin, start| {
                let mut io = SweepIo {
                    r: &r_cur,
                    v: start.map_or(&[], |t| row(&self.v, t)),
                    o: &mut o_row,
                    r_next: &mut r_next,
                };
                self.sweep(s, &mut rows, fin, start, &mut io);
                if let (Some(o), Some(p)) = (&mut o, fin) {
                    row_mut(o, p).copy_from_slice(&o_row);
                }
                if let Some(t) = start {
                    if let Some(rs) = &mut r {
                        row_mut(rs, t).copy_from_slice(&r_next);
                    }
                    std::mem::swap(&mut r_cur, &mut r_next);
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
            let (k, beta) = (row(&self.k, t), self.beta[t]);
            for (c, &ki) in rows.iter_mut().zip(k) {
                c.c = ki * beta;
            }
            if read {
                for (c, &qi) in rows.iter_mut().zip(row(&self.q, t)) {
                    c.q = qi;
                }
            }
        }
        if let Some(t) = start {
            let (e, k) = (row(&self.decay, t), row(&self.k, t));
            for ((c, &ei), &ki) in rows.iter_mut().zip(e).zip(k) {
                (c.e, c.k) = (ei, ki);
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
}

impl<T: Scalar> Engine<T> for Naive {
    type Op = Kda;

    fn forward(&self, x: &KdaHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        simd::dispatch(
            #[inline(always)]
            || forward_head(x, h0),
        )
    }

    fn backward(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> KdaHeadGrads<T> {
        simd::dispatch(
            #[inline(always)]
            || backward_head(x, h0, d_o, dht, None).1,
        )
    }

    /// The backward's own forward run reads out `o` on the way: one run
    /// instead of two, with the bits of each.
    fn forward_backward(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ((Array2<T>, Array2<T>), KdaHeadGrads<T>) {
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
fn forward_head<T: Scalar>(x: &KdaHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
    let mut s = state(h0);
    let mut o = Array2::zeros((x.len(), x.v_dim()));
    let rec = Record {
        o: Some(&mut o),
        r: None,
        checkpoints: None,
    };
    Tokens::new(x).run(&mut s, rec);
    (o, Array2::from_shape_vec(h0.raw_dim(), s).expect("K×V"))
}

/// The gradients from a forward run that keeps the checkpoints and the
/// `r` rows, reading out `o` into `o` when given; returns `(S_L, grads)`.
#[inline(always)]
fn backward_head<T: Scalar>(
    x: &KdaHead<T>,
    h0: ArrayView2<T>,
    d_o: ArrayView2<T>,
    dht: ArrayView2<T>,
    o: Option<&mut Array2<T>>,
) -> (Array2<T>, KdaHeadGrads<T>) {
    let (l, kd, vd) = (x.len(), x.k_dim(), x.v_dim());
    let kv = kd * vd;
    let tokens = Tokens::new(x);
    let mut rs = Array2::zeros((l, vd));
    let mut checkpoints = Vec::new();
    let rec = Record {
        o,
        r: Some(&mut rs),
        checkpoints: Some(&mut checkpoints),
    };
    let mut s = state(h0);
    tokens.run(&mut s, rec);
    let s_l = Array2::from_shape_vec(h0.raw_dim(), s).expect("K×V");
    let d_o = d_o.as_standard_layout();
    let mut back = Backward {
        tokens: &tokens,
        rs: &rs,
        d_o: d_o.as_slice().expect("standard layout"),
        du: vec![T::zero(); vd],
        dr: vec![T::zero(); vd],
        gr: KdaHeadGrads {
            dq: Array2::zeros((l, kd)),
            dk: Array2::zeros((l, kd)),
            dv: Array2::zeros((l, vd)),
            dg: Array2::zeros((l, kd)),
            dbeta: Array1::zeros(l),
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
        |t, s_prev: &[T], s: &mut [T]| tokens.replay(t, row(&rs, t), s_prev, s),
        #[inline(always)]
        |start, end, prev: &[T], ds: &mut [T]| back.block(start, end, prev, ds),
    );
    let mut gr = back.gr;
    gr.dh0 = Array2::from_shape_vec((kd, vd), ds).expect("K×V");
    (s_l, gr)
}

impl<T: Scalar> Tokens<'_, T> {
    /// `S_t = Diag(e^g) S_{t−1} + β k rᵀ` from the kept residual `r_t`: the
    /// forward sweep's operations, `(e·s) + (kβ)·r`, without the reduction.
    #[inline(always)]
    fn replay(&self, t: usize, r: &[T], s_prev: &[T], s: &mut [T]) {
        let vd = r.len();
        let (e, k, beta) = (row(&self.decay, t), row(&self.k, t), self.beta[t]);
        let rows = s.chunks_exact_mut(vd).zip(s_prev.chunks_exact(vd));
        for (((s_row, p_row), &ei), &ki) in rows.zip(e).zip(k) {
            let c = ki * beta;
            for ((sj, &pj), &rj) in s_row.iter_mut().zip(p_row).zip(r) {
                *sj = pj * ei + c * rj;
            }
        }
    }
}

/// The reverse sweeps and the gradients they fill.
struct Backward<'a, T> {
    tokens: &'a Tokens<'a, T>,
    /// The residuals `r [L, V]`.
    rs: &'a Array2<T>,
    /// `do [L, V]`, row-major.
    d_o: &'a [T],
    /// `du = dS_tᵀ k`, accumulated by the finish backward.
    du: Vec<T>,
    /// `d(S'ᵀk) = −β du`, consumed by the start backward.
    dr: Vec<T>,
    gr: KdaHeadGrads<T>,
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
                k: row(&x.k, t),
                e: row(&x.decay, t),
                dr: &self.dr,
                s_prev: state(t),
            });
            let finish_back = (t > start).then(|| {
                let p = t - 1;
                let (r, d_o) = (row(self.rs, p), &self.d_o[p * vd..t * vd]);
                FinishBack {
                    t: p,
                    q: row(&x.q, p),
                    k: row(&x.k, p),
                    e: row(&x.decay, p),
                    beta: x.beta[p],
                    r,
                    d_o,
                    rdo: dot(r, d_o),
                    s_prev: state(p),
                }
            });
            for (i, ds_row) in ds.chunks_exact_mut(vd).enumerate() {
                let (b, a) = (start_back.as_ref(), finish_back.as_ref());
                back_row(i, ds_row, b, a, &mut self.du, &mut self.gr);
            }
            if let Some(a) = finish_back {
                a.close(&mut self.du, &mut self.dr, &mut self.gr);
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
    k: &'a [T],
    e: &'a [T],
    beta: T,
    r: &'a [T],
    d_o: &'a [T],
    /// `r · do`
    rdo: T,
    /// `S_{t−1}`
    s_prev: &'a [T],
}

impl<T: Scalar> FinishBack<'_, T> {
    #[inline(always)]
    fn row(&self, i: usize, n: usize) -> FinishRow<'_, T> {
        FinishRow {
            q: self.q[i],
            k: self.k[i],
            s_prev: &self.s_prev[i * n..(i + 1) * n],
            d_o: self.d_o,
            r: self.r,
        }
    }

    /// `dq_i` and `dk_i` from the row's reductions `S_{t−1} row · do` and
    /// `ds · r`.
    #[inline(always)]
    fn grads(&self, i: usize, s_do: T, ds_r: T, gr: &mut KdaHeadGrads<T>) {
        // dq_i = S_t row · do with S_t row = e·S_{t−1} row + k_i β r.
        let (ki, beta) = (self.k[i], self.beta);
        gr.dq[[self.t, i]] = self.e[i] * s_do + ki * beta * self.rdo;
        gr.dk[[self.t, i]] = beta * ds_r;
    }

    /// After all rows: `dβ = du · r`, `dv = β du`, and `dr = −β du` for the
    /// start backward; `du` is cleared for the next token.
    #[inline(always)]
    fn close(&self, du: &mut [T], dr: &mut [T], gr: &mut KdaHeadGrads<T>) {
        let (t, beta) = (self.t, self.beta);
        let mut dbeta = T::zero();
        let dv = row_mut(&mut gr.dv, t);
        let cols = du.iter_mut().zip(dr.iter_mut()).zip(self.r).zip(dv);
        for (((duj, drj), &rj), dvj) in cols {
            dbeta += *duj * rj;
            *dvj = beta * *duj;
            *drj = -beta * *duj;
            *duj = T::zero();
        }
        gr.dbeta[t] = dbeta;
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
    /// `S_{t−1}`
    s_prev: &'a [T],
}

impl<T: Scalar> StartBack<'_, T> {
    #[inline(always)]
    fn row(&self, i: usize, n: usize) -> StartRow<'_, T> {
        StartRow {
            k: self.k[i],
            e: self.e[i],
            s_prev: &self.s_prev[i * n..(i + 1) * n],
            dr: self.dr,
        }
    }

    /// `dk_i` and `dg_i` from the row's reductions `S_{t−1} row · dr` and
    /// `ds · S_{t−1} row`.
    #[inline(always)]
    fn grads(&self, i: usize, s_dr: T, ds_s: T, gr: &mut KdaHeadGrads<T>) {
        // With S' = e·S_{t−1}: dk += S' dr, dg = Σ dS' ⊙ S'.
        let e = self.e[i];
        gr.dk[[self.t, i]] += e * s_dr;
        gr.dg[[self.t, i]] = e * ds_s;
    }
}

/// Row `i` of reverse sweep `t`: the start backward of token `t`, then the
/// finish backward of token `t − 1`. Both are elementwise along the row, so
/// running them in one pass gives the bits of running them one after the
/// other, with the four reductions overlapping instead of each waiting on
/// its own adds.
#[inline(always)]
fn back_row<T: Scalar>(
    i: usize,
    ds: &mut [T],
    start: Option<&StartBack<T>>,
    finish: Option<&FinishBack<T>>,
    du: &mut [T],
    gr: &mut KdaHeadGrads<T>,
) {
    let n = ds.len();
    let st = start.map_or_else(StartRow::default, |b| b.row(i, n));
    let fi = finish.map_or_else(FinishRow::default, |a| a.row(i, n));
    let [s_dr, ds_s, s_do, ds_r] = match (start.is_some(), finish.is_some()) {
        (true, true) => back_row_pass::<T, true, true>(ds, &st, &fi, du),
        (true, false) => back_row_pass::<T, true, false>(ds, &st, &fi, du),
        (false, true) => back_row_pass::<T, false, true>(ds, &st, &fi, du),
        (false, false) => return,
    };
    if let Some(b) = start {
        b.grads(i, s_dr, ds_s, gr);
    }
    if let Some(a) = finish {
        a.grads(i, s_do, ds_r, gr);
    }
}

/// Row `i` of a [`StartBack`]: `ds += k_i dr`, then `ds *= e_i`, with
/// `S_{t−1} row · dr` and `ds · S_{t−1} row` taken between the two.
#[derive(Default)]
struct StartRow<'a, T> {
    k: T,
    e: T,
    s_prev: &'a [T],
    dr: &'a [T],
}

/// Row `i` of a [`FinishBack`]: `ds += q_i do`, `du += k_i ds`, with
/// `S_{t−1} row · do` and `ds · r`.
#[derive(Default)]
struct FinishRow<'a, T> {
    q: T,
    k: T,
    s_prev: &'a [T],
    d_o: &'a [T],
    r: &'a [T],
}

/// The pass of [`back_row`] for the halves present (`START`, `FINISH`);
/// returns the reductions in [`dot`]'s order: `[S_{t−1} row · dr,
/// ds · S_{t−1} row]` of the start, then `[S_{t−2} row · do, ds · r]` of the
/// finish.
#[inline(always)]
fn back_row_pass<T: Scalar, const START: bool, const FINISH: bool>(
    ds: &mut [T],
    st: &StartRow<T>,
    fi: &FinishRow<T>,
    du: &mut [T],
) -> [T; 4] {
    let n = ds.len();
    let (s1, dr) = if START {
        (&st.s_prev[..n], &st.dr[..n])
    } else {
        (&[][..], &[][..])
    };
    let (s2, d_o, r, du) = if FINISH {
        (&fi.s_prev[..n], &fi.d_o[..n], &fi.r[..n], &mut du[..n])
    } else {
        (&[][..], &[][..], &[][..], &mut [][..])
    };
    let mut sums = [DotSum::new(); 4];
    let full = n / 4 * 4;
    for j in (0..full).step_by(4) {
        let q4 = j..j + 4;
        let mut d = quad(&ds[q4.clone()]);
        if START {
            let (sq, drq) = (quad(&s1[q4.clone()]), quad(&dr[q4.clone()]));
            for l in 0..4 {
                d[l] += st.k * drq[l];
                sums[0].lanes[l] += sq[l] * drq[l];
                sums[1].lanes[l] += d[l] * sq[l];
                d[l] *= st.e;
            }
        }
        if FINISH {
            let (sq, doq, rq) = (
                quad(&s2[q4.clone()]),
                quad(&d_o[q4.clone()]),
                quad(&r[q4.clone()]),
            );
            let mut u = quad(&du[q4.clone()]);
            for l in 0..4 {
                sums[2].lanes[l] += sq[l] * doq[l];
                d[l] += fi.q * doq[l];
                u[l] += fi.k * d[l];
                sums[3].lanes[l] += d[l] * rq[l];
            }
            du[q4.clone()].copy_from_slice(&u);
        }
        ds[q4].copy_from_slice(&d);
    }
    for j in full..n {
        if START {
            ds[j] += st.k * dr[j];
            sums[0].tail += s1[j] * dr[j];
            sums[1].tail += ds[j] * s1[j];
            ds[j] *= st.e;
        }
        if FINISH {
            sums[2].tail += s2[j] * d_o[j];
            ds[j] += fi.q * d_o[j];
            du[j] += fi.k * ds[j];
            sums[3].tail += ds[j] * r[j];
        }
    }
    DotSum::finish4(sums)
}
