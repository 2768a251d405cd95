//! DPLR (diagonal-plus-low-rank generalized delta rule, RWKV-7 style), SPEC §4:
//! `S_t = (Diag(exp gk_t) + b_t a_tᵀ) S_{t−1} + k_t v_tᵀ`, `o_t = S_tᵀ (scale·q_t)`.
//! FLA's naive calls `a` "alpha" and `b` "beta"; `a_tᵀ S_{t−1}` uses the
//! undecayed previous state.
//!
//! Shared pieces as for KDA: tensors, validation, [`Dplr`] (its side of the
//! operator contract, [`crate::op`]); the engines (`naive`, `chunk`) see one head of one sequence.

pub(crate) mod chunk;
// The registry entry, listed in `registry::OPS`: tools reach it only there.
pub(crate) mod entry;
pub(crate) mod naive;

// The engine pieces: public types without a public path (see the module).
mod pieces;
pub(crate) mod spec;

// The engines, named from here: the forms' modules hold their pieces.
pub use chunk::Chunk;
pub use naive::Naive;

use ndarray::{s, Array2, Array4, ArrayD, ArrayView4, ArrayViewMut2, CowArray, Ix2, Ix3};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::fast::views;
use crate::op::{self, OpSpec, Operator, Shape};
use crate::scalar::Scalar;
use crate::tensor::{
    self, check_finite, check_finite_option, expect_finite, expect_rank, expect_shape,
};
use crate::varlen::{self, Segment};

pub(crate) use pieces::{
    DplrHead, DplrHeadGrads, DplrHeadGradsMut, HeadsGk, Prepared, PreparedGrads,
};

/// DPLR inputs in FLA's layout (`chunk_dplr_delta_rule`).
#[derive(Clone, Debug)]
pub struct DplrInputs<T> {
    /// `[B, T, H, K]`
    pub q: ArrayD<T>,
    /// `[B, T, H, K]`
    pub k: ArrayD<T>,
    /// `[B, T, H, V]`
    pub v: ArrayD<T>,
    /// `[B, T, H, K]` (FLA "alpha")
    pub a: ArrayD<T>,
    /// `[B, T, H, K]` (FLA "beta")
    pub b: ArrayD<T>,
    /// `[B, T, H, K]` log-space decay
    pub gk: ArrayD<T>,
    /// `[N, H, K, V]`
    pub initial_state: Option<ArrayD<T>>,
    /// `[N + 1]`, varlen mode (B = 1)
    pub cu_seqlens: Option<Vec<i64>>,
}

/// DPLR inputs borrowed where they live (a case file's tensors): what
/// validation and the GPU upload read, without copying a tensor. Shapes as
/// in [`DplrInputs`].
#[derive(Clone, Copy, Debug)]
pub struct DplrRefs<'a, T> {
    pub q: &'a ArrayD<T>,
    pub k: &'a ArrayD<T>,
    pub v: &'a ArrayD<T>,
    pub a: &'a ArrayD<T>,
    pub b: &'a ArrayD<T>,
    pub gk: &'a ArrayD<T>,
    pub initial_state: Option<&'a ArrayD<T>>,
    pub cu_seqlens: Option<&'a [i64]>,
}

impl<T> DplrInputs<T> {
    /// The inputs borrowed.
    pub fn refs(&self) -> DplrRefs<'_, T> {
        DplrRefs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            a: &self.a,
            b: &self.b,
            gk: &self.gk,
            initial_state: self.initial_state.as_ref(),
            cu_seqlens: self.cu_seqlens.as_deref(),
        }
    }
}

impl<T: Scalar> DplrInputs<T> {
    /// The same inputs in another scalar.
    pub fn cast<U: Scalar>(&self) -> DplrInputs<U> {
        DplrInputs {
            q: tensor::cast(&self.q),
            k: tensor::cast(&self.k),
            v: tensor::cast(&self.v),
            a: tensor::cast(&self.a),
            b: tensor::cast(&self.b),
            gk: tensor::cast(&self.gk),
            initial_state: tensor::cast_opt(&self.initial_state),
            cu_seqlens: self.cu_seqlens.clone(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct DplrOptions {
    /// Defaults to `K^-0.5`.
    pub scale: Option<f64>,
    pub output_final_state: bool,
    /// FLA's `safe_gate`: the caller promises a gate with which the
    /// kernels may factor `exp(Γ_r − Γ_c)` through each chunk's midpoint
    /// row (FLA's centered tensor-core A stage). The values do not change:
    /// only how a kernel forms them ([`DplrOptions::uses_safe_gate`]).
    pub safe_gate: bool,
    /// FLA's `lower_bound`: every `gk ≥ lower_bound` (< 0), which the
    /// oracle checks; with [`gate_bound_is_safe`](crate::gates::gate_bound_is_safe) it licenses the safe-gate
    /// scheme without `safe_gate`.
    pub lower_bound: Option<f64>,
}

impl DplrOptions {
    /// Whether FLA's `chunk_dplr_delta_rule` takes the safe-gate scheme at
    /// `chunk_size`: `safe_gate`, or a `lower_bound` that
    /// [`gate_bound_is_safe`](crate::gates::gate_bound_is_safe) accepts.
    pub fn uses_safe_gate(&self, chunk_size: usize) -> bool {
        self.safe_gate
            || self
                .lower_bound
                .is_some_and(|lb| crate::gates::gate_bound_is_safe(lb, chunk_size))
    }
}

/// `o [B, T, H, V]`, `final_state [N, H, K, V]` when asked for.
#[derive(Clone, Debug)]
pub struct DplrOutputs<T> {
    pub o: ArrayD<T>,
    pub final_state: Option<ArrayD<T>>,
}

#[derive(Clone, Debug)]
pub struct DplrGrads<T> {
    pub dq: ArrayD<T>,
    pub dk: ArrayD<T>,
    pub dv: ArrayD<T>,
    pub da: ArrayD<T>,
    pub db: ArrayD<T>,
    pub dgk: ArrayD<T>,
    pub dh0: Option<ArrayD<T>>,
}

impl DplrDims {
    /// Heads that carry a state.
    pub fn heads(&self) -> usize {
        self.h
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DplrDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub k: usize,
    pub v: usize,
    pub n: usize,
}

impl<T: Scalar> HeadsGk<'_, T> {
    /// The same gates with their own storage.
    pub fn into_owned(self) -> HeadsGk<'static, T> {
        HeadsGk {
            gk: self.gk.into_owned().into(),
            head: self.head,
        }
    }

    /// Rows `r` of the gates, borrowed.
    pub fn rows(&self, r: std::ops::Range<usize>) -> HeadsGk<'_, T> {
        HeadsGk {
            gk: self.gk.slice(s![r, .., ..]).into(),
            head: self.head,
        }
    }
}

impl<T: Scalar> DplrHead<'_, T> {
    /// The head with its own copy of any borrowed tensor.
    pub fn into_owned(self) -> DplrHead<'static, T> {
        DplrHead {
            q: self.q.into_owned().into(),
            k: self.k.into_owned().into(),
            a: self.a.into_owned().into(),
            b: self.b.into_owned().into(),
            gk: self.gk.into_owned().into(),
            v: self.v.into_owned().into(),
            scale: self.scale,
            heads_gk: self.heads_gk.map(HeadsGk::into_owned),
        }
    }

    /// The head in standard layout with `scale` applied to `q` (`scale`
    /// 1), borrowing what already is so: what the chunked engine indexes.
    pub fn standard<'a>(&'a self) -> DplrHead<'a, T> {
        self.standard_rows(0..self.len())
    }

    /// Rows `r` of [`DplrHead::standard`] (tokens `r` of the pair), copying
    /// only those rows where a copy is needed.
    pub fn standard_rows<'a>(&'a self, r: std::ops::Range<usize>) -> DplrHead<'a, T> {
        let rows = |a: &'a CowArray<'_, T, Ix2>| views::standard(a.slice(s![r.clone(), ..]));
        DplrHead {
            q: views::scaled_standard(self.q.slice(s![r.clone(), ..]), self.scale),
            k: rows(&self.k),
            a: rows(&self.a),
            b: rows(&self.b),
            gk: rows(&self.gk),
            v: rows(&self.v),
            scale: T::one(),
            heads_gk: self.heads_gk.as_ref().map(|g| g.rows(r.clone())),
        }
    }

    pub fn len(&self) -> usize {
        self.q.nrows()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn k_dim(&self) -> usize {
        self.q.ncols()
    }
    pub fn v_dim(&self) -> usize {
        self.v.ncols()
    }
}

impl<T: Scalar> DplrHeadGrads<T> {
    /// Zero gradients of an `L`-token piece with a `[K, V]` state.
    pub fn zeros(l: usize, k: usize, v: usize) -> Self {
        let z = || Array2::zeros((l, k));
        DplrHeadGrads {
            dq: z(),
            dk: z(),
            dv: Array2::zeros((l, v)),
            da: z(),
            db: z(),
            dgk: z(),
            dh0: Array2::zeros((k, v)),
        }
    }

    pub fn view_mut(&mut self) -> DplrHeadGradsMut<'_, T> {
        DplrHeadGradsMut {
            dq: self.dq.view_mut(),
            dk: self.dk.view_mut(),
            dv: self.dv.view_mut(),
            da: self.da.view_mut(),
            db: self.db.view_mut(),
            dgk: self.dgk.view_mut(),
            dh0: self.dh0.view_mut(),
        }
    }
}

impl<T: Scalar> DplrHeadGradsMut<'_, T> {
    /// The gradients of tokens `r` (`[r.len(), ·]` views of these), with
    /// `dh0` written into `dh0` instead: the state gradient at `r.start`.
    pub fn rows_mut<'a>(
        &'a mut self,
        r: std::ops::Range<usize>,
        dh0: ArrayViewMut2<'a, T>,
    ) -> DplrHeadGradsMut<'a, T> {
        let rows = |a: &'a mut ArrayViewMut2<'_, T>| a.slice_mut(s![r.clone(), ..]);
        DplrHeadGradsMut {
            dq: rows(&mut self.dq),
            dk: rows(&mut self.dk),
            dv: rows(&mut self.dv),
            da: rows(&mut self.da),
            db: rows(&mut self.db),
            dgk: rows(&mut self.dgk),
            dh0,
        }
    }

    /// Writes `g` here.
    pub fn assign(self, g: &DplrHeadGrads<T>) {
        views::copy_into(self.dq, g.dq.view());
        views::copy_into(self.dk, g.dk.view());
        views::copy_into(self.dv, g.dv.view());
        views::copy_into(self.da, g.da.view());
        views::copy_into(self.db, g.db.view());
        views::copy_into(self.dgk, g.dgk.view());
        views::copy_into(self.dh0, g.dh0.view());
    }
}

pub(crate) fn validate<T: Scalar>(x: &DplrInputs<T>, opt: &DplrOptions) -> Result<DplrDims> {
    x.refs().validate(opt)
}

impl<T: Scalar> DplrRefs<'_, T> {
    /// Validates borrowed inputs (shapes as in the owned inputs) and options;
    /// returns the problem sizes.
    pub fn validate(&self, opt: &DplrOptions) -> Result<DplrDims> {
        let x = self;
        let qs = expect_rank("q", "B,T,H,K", x.q)?;
        let (b, t, h, k) = (qs[0], qs[1], qs[2], qs[3]);
        if h == 0 || k == 0 {
            return Err(Error::shape("q", "[B,T,H,K] with H ≥ 1 and K ≥ 1", qs));
        }
        for (name, a) in [("k", x.k), ("a", x.a), ("b", x.b), ("gk", x.gk)] {
            expect_shape(name, "[B,T,H,K]", qs, a.shape())?;
        }
        let vs = expect_rank("v", "B,T,H,V", x.v)?;
        if vs[3] == 0 {
            return Err(Error::shape("v", "[B,T,H,V] with V ≥ 1", vs));
        }
        expect_shape("v", "[B,T,H,V]", &[b, t, h, vs[3]], vs)?;
        let v = vs[3];
        let segments = varlen::sequences(b, t, x.cu_seqlens)?;
        let n = segments.len();
        if let Some(h0) = x.initial_state {
            expect_finite("initial_state", "[N,H,K,V]", &[n, h, k, v], h0)?;
        }
        if let Some(sc) = opt.scale {
            check_finite_option("scale", sc)?;
        }
        if let Some(lb) = opt.lower_bound {
            check_lower_bound(lb, x.gk)?;
        }
        for (name, a) in [
            ("q", x.q),
            ("k", x.k),
            ("v", x.v),
            ("a", x.a),
            ("b", x.b),
            ("gk", x.gk),
        ] {
            check_finite(name, a)?;
        }
        Ok(DplrDims { b, t, h, k, v, n })
    }
}

impl<'a, T: Scalar> Prepared<'a, T> {
    pub fn new(x: &'a DplrInputs<T>, opt: &DplrOptions) -> Result<Self> {
        let dims = validate(x, opt)?;
        let scale = opt.scale.unwrap_or(1.0 / (dims.k as f64).sqrt());
        Ok(Prepared {
            dims,
            scale,
            segments: varlen::sequences(dims.b, dims.t, x.cu_seqlens.as_deref())?,
            q: tensor::view4(&x.q),
            k: tensor::view4(&x.k),
            v: tensor::view4(&x.v),
            a: tensor::view4(&x.a),
            b: tensor::view4(&x.b),
            gk: tensor::view4(&x.gk),
            h0: x.initial_state.as_ref().map(tensor::view4),
        })
    }
}

impl<T: Scalar> op::Prepared<T> for Prepared<'_, T> {
    fn shape(&self) -> Shape {
        let d = self.dims;
        Shape {
            b: d.b,
            t: d.t,
            n: d.n,
            heads: d.h,
            k: d.k,
            v: d.v,
        }
    }

    fn segments(&self) -> &[Segment] {
        &self.segments
    }

    fn h0(&self) -> Option<ArrayView4<'_, T>> {
        self.h0.as_ref().map(|h0| h0.view())
    }
}

/// DPLR, FLA's `chunk_dplr_delta_rule` / `fused_recurrent_dplr_delta_rule`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dplr;

impl OpSpec for Dplr {
    const NAME: &'static str = "dplr";
    const INPUTS: &'static [&'static str] =
        &["q", "k", "v", "a", "b", "gk", "initial_state", "cu_seqlens"];
    const OUTPUTS: &'static [&'static str] = &["o", "final_state"];
    const UPSTREAM: &'static [&'static str] = &["do", "dht"];
    const GRADS: &'static [&'static str] = &["dq", "dk", "dv", "da", "db", "dgk", "dh0"];
    type Options = DplrOptions;

    fn all_outputs(opt: &DplrOptions) -> DplrOptions {
        DplrOptions {
            output_final_state: true,
            ..*opt
        }
    }
}

impl<T: Scalar> Operator<T> for Dplr {
    type Inputs = DplrInputs<T>;
    type Outputs = DplrOutputs<T>;
    type Grads = DplrGrads<T>;
    type Head<'h> = DplrHead<'h, T>;
    type HeadGrads = DplrHeadGrads<T>;
    type Prepared<'a>
        = Prepared<'a, T>
    where
        T: 'a;

    fn prepare<'a>(x: &'a DplrInputs<T>, opt: &DplrOptions) -> Result<Prepared<'a, T>> {
        Prepared::new(x, opt)
    }

    /// Head `h` of `seg`, borrowed.
    fn head<'p>(p: &'p Prepared<'_, T>, seg: &Segment, h: usize) -> DplrHead<'p, T> {
        let rows = |x: ArrayView4<'p, T>| tensor::head_view(x, seg, h).into();
        DplrHead {
            q: rows(p.q.view()),
            k: rows(p.k.view()),
            a: rows(p.a.view()),
            b: rows(p.b.view()),
            gk: rows(p.gk.view()),
            v: rows(p.v.view()),
            scale: T::c(p.scale),
            heads_gk: Some(HeadsGk {
                gk: p
                    .gk
                    .slice_move(s![seg.batch, seg.start..seg.end, .., ..])
                    .into(),
                head: h,
            }),
        }
    }

    /// `Σ_t gk[t, h, :]` over `seg` (`[K]`).
    fn decay_log_sum(p: &Prepared<'_, T>, seg: &Segment, h: usize) -> Option<ndarray::Array1<T>> {
        Some(tensor::head_view(p.gk.view(), seg, h).sum_axis(ndarray::Axis(0)))
    }

    fn cu_seqlens(x: &DplrInputs<T>) -> Option<&[i64]> {
        x.cu_seqlens.as_deref()
    }

    fn validate_upstream(
        p: &Prepared<'_, T>,
        d_o: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()> {
        p.dims.validate_upstream(d_o, dht)
    }

    fn probe<'h>(x: &Self::Head<'h>) -> (Self::Head<'h>, usize) {
        let kd = x.k_dim();
        let probe = DplrHead {
            v: CowArray::from(Array2::zeros((x.len(), kd))),
            ..x.clone()
        };
        (probe, kd)
    }

    fn outputs(opt: &DplrOptions, o: Array4<T>, final_state: Array4<T>) -> DplrOutputs<T> {
        DplrOutputs {
            o: o.into_dyn(),
            final_state: opt.output_final_state.then(|| final_state.into_dyn()),
        }
    }

    fn grads(
        x: &DplrInputs<T>,
        opt: &DplrOptions,
        p: &Prepared<'_, T>,
        pieces: Vec<(Segment, usize, DplrHeadGrads<T>)>,
        dh0: Array4<T>,
    ) -> DplrGrads<T> {
        PreparedGrads::from_pieces(&p.dims, pieces, dh0).chain(x, opt, p)
    }

    fn output_tensors(out: &DplrOutputs<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![Some(&out.o), out.final_state.as_ref()]
    }

    fn grad_tensors(gr: &DplrGrads<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![
            Some(&gr.dq),
            Some(&gr.dk),
            Some(&gr.dv),
            Some(&gr.da),
            Some(&gr.db),
            Some(&gr.dgk),
            gr.dh0.as_ref(),
        ]
    }

    fn head_dh0(g: &DplrHeadGrads<T>) -> &Array2<T> {
        &g.dh0
    }

    crate::grads_in_place!(PreparedGrads<T>, DplrHeadGradsMut);

    fn chain_grads(
        x: &DplrInputs<T>,
        opt: &DplrOptions,
        p: &Prepared<'_, T>,
        b: PreparedGrads<T>,
    ) -> DplrGrads<T> {
        b.chain(x, opt, p)
    }

    fn narrow(x: &DplrInputs<f64>) -> DplrInputs<T> {
        x.cast()
    }
}

impl DplrDims {
    /// Validates the upstream gradients `do [B,T,H,V]` and `dht [N,H,K,V]`.
    pub fn validate_upstream<T: Scalar>(
        &self,
        d_o: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()> {
        let d = self;
        expect_finite("do", "[B,T,H,V]", &[d.b, d.t, d.h, d.v], d_o)?;
        if let Some(dht) = dht {
            expect_finite("dht", "[N,H,K,V]", &[d.n, d.h, d.k, d.v], dht)?;
        }
        Ok(())
    }
}

impl<T: Scalar> PreparedGrads<T> {
    /// Zero gradients for a problem of sizes `d`.
    pub fn zeros(d: &DplrDims) -> Self {
        let tokens = |w| views::zeros(ndarray::Ix4(d.b, d.t, d.h, w));
        PreparedGrads {
            dq: tokens(d.k),
            dk: tokens(d.k),
            dv: tokens(d.v),
            da: tokens(d.k),
            db: tokens(d.k),
            dgk: tokens(d.k),
            dh0: Array4::zeros((d.n, d.h, d.k, d.v)),
        }
    }

    /// Each (segment, head) pair's rows of these tensors, in pair order, as
    /// one piece's gradients.
    pub fn sinks(&mut self, segments: &[Segment]) -> Vec<DplrHeadGradsMut<'_, T>> {
        let [dq, dk, dv, da, db, dgk] = [
            &mut self.dq,
            &mut self.dk,
            &mut self.dv,
            &mut self.da,
            &mut self.db,
            &mut self.dgk,
        ]
        .map(|a| views::pair_blocks_mut(a.view_mut(), segments).into_iter());
        let dh0 = views::pair_states_mut(self.dh0.view_mut(), segments);
        dq.zip(dk)
            .zip(dv)
            .zip(da)
            .zip(db)
            .zip(dgk)
            .zip(dh0)
            .map(
                |((((((dq, dk), dv), da), db), dgk), dh0)| DplrHeadGradsMut {
                    dq,
                    dk,
                    dv,
                    da,
                    db,
                    dgk,
                    dh0,
                },
            )
            .collect()
    }

    /// The per-token gradients of `(segment, head, gradients)` pieces, one
    /// tensor per parallel task, and `dh0 [N, H, K, V]`. The pieces are
    /// freed on return.
    pub fn from_pieces(
        d: &DplrDims,
        pieces: Vec<(Segment, usize, DplrHeadGrads<T>)>,
        dh0: Array4<T>,
    ) -> Self {
        let mut blocks: [Vec<_>; 6] = Default::default();
        for (seg, h, g) in pieces {
            let grads = [g.dq, g.dk, g.dv, g.da, g.db, g.dgk];
            for (list, a) in blocks.iter_mut().zip(grads) {
                list.push((seg, h, a));
            }
        }
        let widths = [d.k, d.k, d.v, d.k, d.k, d.k];
        let tensors: Vec<Array4<T>> = Vec::from(blocks)
            .into_par_iter()
            .zip(widths)
            .map(|(blocks, width)| tensor::assemble((d.b, d.t, d.h, width), blocks))
            .collect();
        let [dq, dk, dv, da, db, dgk] = tensors.try_into().expect("six tensors");
        PreparedGrads {
            dq,
            dk,
            dv,
            da,
            db,
            dgk,
            dh0,
        }
    }

    /// Applies `scale` to `dq` and returns FLA-shaped gradients (`opt` has
    /// nothing else to chain through; the signature matches KDA's).
    pub fn chain(self, x: &DplrInputs<T>, _opt: &DplrOptions, p: &Prepared<T>) -> DplrGrads<T> {
        DplrGrads {
            dq: self.dq.mapv_into(|e| e * T::c(p.scale)).into_dyn(),
            dk: self.dk.into_dyn(),
            dv: self.dv.into_dyn(),
            da: self.da.into_dyn(),
            db: self.db.into_dyn(),
            dgk: self.dgk.into_dyn(),
            dh0: x.initial_state.as_ref().map(|_| self.dh0.into_dyn()),
        }
    }
}

/// Refuses a `lower_bound` that is not a finite negative number, or that
/// some `gk` breaks (the caller's promise to FLA's kernels, which they do
/// not check: a broken one overflows their midpoint-centered exponents).
fn check_lower_bound<T: Scalar>(lb: f64, gk: &ArrayD<T>) -> Result<()> {
    if !(lb.is_finite() && lb < 0.0) {
        return Err(Error::option(
            "lower_bound",
            format!("expected a finite negative bound on gk, got {lb}"),
        ));
    }
    let below = gk.indexed_iter().find(|(_, g)| g.f64() < lb);
    match below {
        Some((at, g)) => Err(Error::option(
            "lower_bound",
            format!(
                "gk{:?} = {} is below lower_bound = {lb}: FLA's kernels assume gk ≥ lower_bound",
                ndarray::Dimension::slice(&at),
                g.f64()
            ),
        )),
        None => Ok(()),
    }
}
