//! The operator contract: what KDA, DPLR and token-shift (and any new
//! operator) declare, and the drivers written once over it.
//!
//! An operator is a marker type (e.g. [`crate::kda::Kda`]) implementing
//! [`OpSpec`] (FLA's name and tensor names, declared once and read by case
//! files, result maps, generation and the GPU side) and [`Operator`] (its
//! public tensors, its pre-processing into per-(sequence, head) pieces, and how
//! per-head results assemble into full tensors). Every operator has the same
//! per-piece shape: a recurrent state `[K, V]` per (sequence, head), outputs
//! `[L, V]` per piece, a state entering and leaving each piece. An [`Engine`]
//! computes one piece (forward, backward, and the state transition `M` that
//! context parallel needs). The drivers ([`forward`], [`backward`],
//! [`forward_backward`]) run an engine over every (sequence, head) pair with
//! rayon, results in pair order, so the bits do not depend on the thread
//! count; [`crate::cp::forward`], [`crate::cp::backward`] and
//! [`crate::cp::forward_backward`] run the same engine rank by rank.
//! [`forward_backward`] allocates the run's result tensors once and hands
//! each pair views of its rows (`HeadSink`), which an engine writes as it
//! goes ([`Engine::forward_backward_into`]): no pair keeps results of its
//! own and nothing is assembled afterwards.
//!
//! # Adding an operator
//! 1. A folder `src/<op>/` with `mod.rs` holding the public tensors
//!    (`Inputs`, `Options`, `Outputs`, `Grads` in FLA's layout), validation,
//!    a `Prepared` (validated inputs after FLA's fused pre-processing) that
//!    implements `op::Prepared`, a per-piece `Head` (which may borrow the
//!    `Prepared` tensors: [`Operator::head`]) and `HeadGrads` (these three
//!    declared `pub` in the operator's private `pieces.rs`: the contract
//!    names them, the crate's API does not), and a marker
//!    type implementing [`OpSpec`] and [`Operator`]. Its `GradsBuf` is the
//!    gradients' full tensors before the chain rule, split per pair into
//!    `GradsSink`s; an operator whose gradients are not all per-token
//!    tensors keeps each pair's as computed (`Collected`).
//! 2. One file per engine (`naive.rs`, `chunk.rs`), each a type implementing
//!    [`Engine`] with `type Op = <marker>`. Override [`Engine::transition`]
//!    only when the engine has a cheaper way than the default probe run. A
//!    naive engine in the style of KDA's and DPLR's gives its per-row
//!    arithmetic to the shared driver (`fast/naive.rs`); a chunked engine is
//!    the shell `Chunk<marker>` (`chunked.rs`) over the operator's stages.
//! 3. Its definition, the plain recurrence in float64, in `truth/<op>.rs`
//!    (`impl Truth`), and its engines in `truth/tests.rs`'s
//!    `against_truth!`, which holds them to it plain, under CP, intra-card
//!    and in f32.
//! 4. Register the module in `lib.rs`. The drivers, CP, thread determinism
//!    and the result maps come for free.

use ndarray::{s, Array1, Array2, Array4, ArrayD, ArrayView2, ArrayView4, ArrayViewMut2};

use crate::error::Result;
use crate::fast::par::{par_pairs, par_pairs_with};
use crate::fast::views;
use crate::scalar::Scalar;
use crate::tensor;
use crate::varlen::Segment;

// The contract's pieces: public types without a public path (see the module).
mod pieces;
pub(crate) use pieces::{Collected, HeadSink, Prepared, Shape};

/// What an operator is called, FLA's way; the single source of its names.
pub trait OpSpec {
    /// The case-file / CLI name (`"kda"`, `"dplr"`, `"token_shift"`).
    const NAME: &'static str;
    /// Input tensors, FLA's argument names, in FLA's argument order
    /// (`cu_seqlens`, an integer tensor, last).
    const INPUTS: &'static [&'static str];
    /// Forward results, in the order of [`Operator::output_tensors`].
    const OUTPUTS: &'static [&'static str];
    /// Upstream gradients of the outputs, in the order of `OUTPUTS`.
    const UPSTREAM: &'static [&'static str];
    /// Gradients, in the order of [`Operator::grad_tensors`].
    const GRADS: &'static [&'static str];
    /// FLA's keyword options (one type for every scalar).
    type Options: Clone + Sync;

    /// `opt` asking for every output (the final state too), for comparisons.
    fn all_outputs(opt: &Self::Options) -> Self::Options;
}

/// An operator in scalar `T`: its public tensors and how they map to and
/// from per-(sequence, head) pieces.
pub trait Operator<T: Scalar>: OpSpec + Sized + 'static {
    type Inputs: Clone + Sync;
    type Outputs;
    type Grads;
    /// One piece of one head, the only thing an engine sees; it may borrow
    /// the [`Operator::Prepared`] tensors it was cut from (`'h`).
    type Head<'h>: Clone + Send + Sync;
    /// Gradients of one piece with respect to its `Head` and `h0`.
    type HeadGrads: Send + Sync;
    type Prepared<'a>: Prepared<T>
    where
        T: 'a;

    /// Validates `x` and applies FLA's fused pre-processing.
    fn prepare<'a>(x: &'a Self::Inputs, opt: &Self::Options) -> Result<Self::Prepared<'a>>;
    /// Rows `seg.start..seg.end` of head `h` of `p`, pre-processed, in
    /// standard layout: borrowed where `p` holds them so, else copied.
    fn head<'p>(p: &'p Self::Prepared<'_>, seg: &Segment, h: usize) -> Self::Head<'p>;
    fn cu_seqlens(x: &Self::Inputs) -> Option<&[i64]>;
    /// Checks the upstream gradients against the problem's shape.
    fn validate_upstream(
        p: &Self::Prepared<'_>,
        d_o: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()>;
    /// The validated output gradient as `[B, T, heads, V]` (by default it
    /// is stored so).
    fn upstream_view(d_o: &ArrayD<T>) -> ArrayView4<'_, T> {
        crate::tensor::view4(d_o)
    }
    /// The validated final-state gradient as `[N, heads, K, V]` (`opt`
    /// says its layout, e.g. GDN's `state_v_first`; by default it is stored so).
    fn dht_view<'d>(_opt: &Self::Options, dht: &'d ArrayD<T>) -> ArrayView4<'d, T> {
        crate::tensor::view4(dht)
    }
    /// `(the piece with its value-like input replaced by K zero columns, K)`:
    /// run from `S_0 = I [K, K]`, its final state is the transition `M`.
    fn probe<'h>(x: &Self::Head<'h>) -> (Self::Head<'h>, usize);
    /// The log of the diagonal of `seg`'s transition for head `h`: per key
    /// channel the log-decay summed over the piece's tokens, `[K]` (its
    /// exponential is the `Diag(e^Γlast)` of a chunk; the rest of the
    /// transition is low-rank). `None` for an operator without a per-channel
    /// gate (FLA's `gk`). The CP fault models of [`crate::cp::Faults`] that
    /// misread a chunk's decay use it.
    fn decay_log_sum(_p: &Self::Prepared<'_>, _seg: &Segment, _h: usize) -> Option<Array1<T>> {
        None
    }
    /// Public outputs from `o [B, T, heads, V]` and `final_state [N, heads, K, V]`.
    fn outputs(opt: &Self::Options, o: Array4<T>, final_state: Array4<T>) -> Self::Outputs;
    /// Public gradients from per-(piece, head) gradients and `dh0 [N, heads, K, V]`
    /// (the chain rule through the pre-processing happens here). The pieces
    /// are taken by value so that they are freed once assembled, before the
    /// chain rule's temporaries exist (a long sequence's pieces are as large
    /// as the gradients).
    fn grads(
        x: &Self::Inputs,
        opt: &Self::Options,
        p: &Self::Prepared<'_>,
        pieces: Vec<(Segment, usize, Self::HeadGrads)>,
        dh0: Array4<T>,
    ) -> Self::Grads;
    /// The outputs, aligned with [`OpSpec::OUTPUTS`] (`None` where absent).
    fn output_tensors(out: &Self::Outputs) -> Vec<Option<&ArrayD<T>>>;
    /// The gradients, aligned with [`OpSpec::GRADS`] (`None` where absent).
    fn grad_tensors(gr: &Self::Grads) -> Vec<Option<&ArrayD<T>>>;
    /// `dh0 [K, V]` of a piece's gradients.
    fn head_dh0(g: &Self::HeadGrads) -> &Array2<T>;
    /// Every pair's gradients, written in place by [`forward_backward`]
    /// (one sink per pair, [`Operator::grads_sinks`]) and turned into the
    /// public gradients by [`Operator::chain_grads`]: for the per-token
    /// gradients, the full tensors before the chain rule, so that no pair
    /// keeps a copy of its own.
    type GradsBuf: Send;
    /// One pair's share of a [`Operator::GradsBuf`].
    type GradsSink<'s>: Send
    where
        T: 's;
    /// An empty (zero) buffer for every pair of `p`.
    fn grads_buf(p: &Self::Prepared<'_>) -> Self::GradsBuf;
    /// `b` split into one sink per (sequence, head) pair, in pair order.
    fn grads_sinks<'s>(
        b: &'s mut Self::GradsBuf,
        p: &Self::Prepared<'_>,
    ) -> Vec<Self::GradsSink<'s>>;
    /// A piece's gradients, computed elsewhere, written into its sink.
    fn write_grads(sink: Self::GradsSink<'_>, g: Self::HeadGrads);
    /// The public gradients from a filled buffer (the chain rule through the
    /// pre-processing).
    fn chain_grads(
        x: &Self::Inputs,
        opt: &Self::Options,
        p: &Self::Prepared<'_>,
        b: Self::GradsBuf,
    ) -> Self::Grads;
    /// f64 inputs narrowed to `T` (the oracle's truth is f64).
    fn narrow(x: &<Self as Operator<f64>>::Inputs) -> <Self as Operator<T>>::Inputs
    where
        Self: Operator<f64>;
}

/// A way of computing one piece of one head of operator `Op`.
pub trait Engine<T: Scalar>: Sync {
    type Op: Operator<T>;

    /// Returns `(o [L, V], S_L [K, V])` from `S_0 = h0 [K, V]`.
    fn forward(
        &self,
        x: &<Self::Op as Operator<T>>::Head<'_>,
        h0: ArrayView2<T>,
    ) -> (Array2<T>, Array2<T>);

    /// Gradients of `Σ o·d_o + Σ S_L·dht` (`d_o [L, V]`, `dht [K, V]`).
    fn backward(
        &self,
        x: &<Self::Op as Operator<T>>::Head<'_>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> <Self::Op as Operator<T>>::HeadGrads;

    /// [`Engine::forward`] and [`Engine::backward`] of one piece in one call:
    /// `((o [L, V], S_L [K, V]), gradients)`, the same bits as the two
    /// calls. An engine whose backward recomputes its forward overrides this
    /// to keep the forward's intermediates instead.
    #[allow(clippy::type_complexity)]
    fn forward_backward(
        &self,
        x: &<Self::Op as Operator<T>>::Head<'_>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ((Array2<T>, Array2<T>), <Self::Op as Operator<T>>::HeadGrads) {
        (self.forward(x, h0), self.backward(x, h0, d_o, dht))
    }

    /// [`Engine::forward_backward`] writing its results into `out`, views of
    /// the run's full tensors. By default the owned results are copied in;
    /// an engine that produces them row by row writes them there directly.
    fn forward_backward_into(
        &self,
        x: &<Self::Op as Operator<T>>::Head<'_>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        out: HeadSink<'_, T, Self::Op>,
    ) {
        let ((o, s_l), g) = self.forward_backward(x, h0, d_o, dht);
        let HeadSink {
            o: o_out,
            final_state: s_out,
            grads,
        } = out;
        views::copy_into(o_out, o.view());
        views::copy_into(s_out, s_l.view());
        <Self::Op as Operator<T>>::write_grads(grads, g);
    }

    /// The transition `M [K, K]` with `S_L = M S_0 + S_L|_{S_0 = 0}`.
    ///
    /// Default: the state recurrence is linear in `(S, v)`, so running it with
    /// `v = 0` from `S_0 = I` (K columns in place of V) yields `M`.
    fn transition(&self, x: &<Self::Op as Operator<T>>::Head<'_>) -> Array2<T> {
        let (probe, k) = <Self::Op as Operator<T>>::probe(x);
        self.forward(&probe, Array2::eye(k).view()).1
    }

    /// The pre-processed inputs as this engine's kernels read them back
    /// (rounded per its precision policy); unchanged by default.
    fn stored<'a>(
        &self,
        p: <Self::Op as Operator<T>>::Prepared<'a>,
    ) -> <Self::Op as Operator<T>>::Prepared<'a>
    where
        T: 'a,
    {
        p
    }
}

/// The [`Operator`] items of an operator whose pairs write their gradients
/// into `$buf` (the prepared tensors' gradients, with `zeros(&p.dims)` and
/// `sinks(&p.segments)`) through `$sink<'s, T>` views (with `assign`):
/// `grads_in_place!(PreparedGrads<T>, KdaHeadGradsMut);` inside the impl.
/// `chain_grads` stays the operator's own.
macro_rules! grads_in_place {
    ($buf:ty, $sink:ident) => {
        type GradsBuf = $buf;
        type GradsSink<'s>
            = $sink<'s, T>
        where
            T: 's;

        fn grads_buf(p: &Self::Prepared<'_>) -> $buf {
            <$buf>::zeros(&p.dims)
        }

        fn grads_sinks<'s>(b: &'s mut $buf, p: &Self::Prepared<'_>) -> Vec<$sink<'s, T>> {
            b.sinks(&p.segments)
        }

        fn write_grads(sink: $sink<'_, T>, g: Self::HeadGrads) {
            sink.assign(&g);
        }
    };
}
pub(crate) use grads_in_place;

/// The [`Operator`] gradient items of an operator that keeps each pair's
/// gradients as computed ([`Collected`]) and chains them with
/// [`Operator::grads`]: `grads_collected!();` inside the impl.
macro_rules! grads_collected {
    () => {
        type GradsBuf = $crate::op::Collected<Self::HeadGrads>;
        type GradsSink<'s>
            = &'s mut Option<Self::HeadGrads>
        where
            T: 's;

        fn grads_buf(p: &Self::Prepared<'_>) -> Self::GradsBuf {
            let pairs =
                $crate::op::Prepared::segments(p).len() * $crate::op::Prepared::shape(p).heads;
            $crate::op::Collected::new(pairs)
        }

        fn grads_sinks<'s>(
            b: &'s mut Self::GradsBuf,
            _: &Self::Prepared<'_>,
        ) -> Vec<&'s mut Option<Self::HeadGrads>> {
            b.sinks()
        }

        fn write_grads(sink: &mut Option<Self::HeadGrads>, g: Self::HeadGrads) {
            *sink = Some(g);
        }

        fn chain_grads(
            x: &Self::Inputs,
            opt: &Self::Options,
            p: &Self::Prepared<'_>,
            b: Self::GradsBuf,
        ) -> Self::Grads {
            b.chain::<T, Self>(x, opt, p)
        }
    };
}
pub(crate) use grads_collected;

impl<G> Collected<G> {
    pub fn new(pairs: usize) -> Self {
        Collected((0..pairs).map(|_| None).collect())
    }

    /// One slot per pair, in pair order.
    pub fn sinks(&mut self) -> Vec<&mut Option<G>> {
        self.0.iter_mut().collect()
    }

    /// The public gradients through [`Operator::grads`].
    pub fn chain<T: Scalar, O: Operator<T, HeadGrads = G>>(
        self,
        x: &O::Inputs,
        opt: &O::Options,
        p: &O::Prepared<'_>,
    ) -> O::Grads {
        let pieces = self.0.into_iter().map(|g| g.expect("every pair ran"));
        assemble_grads::<T, O>(x, opt, p, pieces.collect())
    }
}

/// The initial state of sequence `seq`, head `h` (zeros when none was given).
pub fn initial_state<T: Scalar, P: Prepared<T>>(p: &P, seq: usize, h: usize) -> Array2<T> {
    let sh = p.shape();
    match p.h0() {
        Some(h0) => h0.slice(s![seq, h, .., ..]).to_owned(),
        None => Array2::zeros((sh.k, sh.v)),
    }
}

/// Runs `engine` forward over every (sequence, head) pair.
pub fn forward<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<T>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
) -> Result<<E::Op as Operator<T>>::Outputs> {
    let p = engine.stored(E::Op::prepare(x, opt)?);
    let segments = p.segments();
    let results = par_pairs(segments.len(), p.shape().heads, |si, h| {
        let seg = &segments[si];
        engine.forward(
            &E::Op::head(&p, seg, h),
            initial_state(&p, seg.seq, h).view(),
        )
    });
    Ok(assemble_outputs::<T, E::Op>(&p, opt, results))
}

/// Public outputs from per-pair `(o [L, V], S_L [K, V])` in pair order.
fn assemble_outputs<T: Scalar, O: Operator<T>>(
    p: &O::Prepared<'_>,
    opt: &O::Options,
    results: Vec<(Array2<T>, Array2<T>)>,
) -> O::Outputs {
    let (d, segments) = (p.shape(), p.segments());
    let mut ht = Array4::zeros((d.n, d.heads, d.k, d.v));
    let mut blocks = Vec::with_capacity(results.len());
    for (i, (oh, sh)) in results.into_iter().enumerate() {
        let (seg, h) = (segments[i / d.heads], i % d.heads);
        ht.slice_mut(s![seg.seq, h, .., ..]).assign(&sh);
        blocks.push((seg, h, oh));
    }
    let o = tensor::assemble((d.b, d.t, d.heads, d.v), blocks);
    O::outputs(opt, o, ht)
}

/// Runs `engine` backward over every pair and chains through the
/// pre-processing. `d_o` is shaped like the main output, `dht` like the
/// final state (zero when `None`).
pub fn backward<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<T>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<<E::Op as Operator<T>>::Grads> {
    let p = engine.stored(E::Op::prepare(x, opt)?);
    let pairs = vec![(); p.segments().len() * p.shape().heads];
    let results = per_pair_upstream::<T, E::Op, _, _, _>(
        &p,
        opt,
        d_o,
        dht,
        pairs,
        |head, h0, d_o, dht, ()| engine.backward(head, h0, d_o, dht),
    )?;
    Ok(assemble_grads::<T, E::Op>(x, opt, &p, results))
}

/// [`forward`] and [`backward`] in one run, the same bits; an engine that
/// overrides [`Engine::forward_backward`] skips its backward's recompute
/// of the forward. Every pair writes its results straight into the full
/// tensors ([`Engine::forward_backward_into`]). Returns `(outputs,
/// gradients)`.
#[allow(clippy::type_complexity)]
pub fn forward_backward<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<T>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<(
    <E::Op as Operator<T>>::Outputs,
    <E::Op as Operator<T>>::Grads,
)> {
    let p = engine.stored(E::Op::prepare(x, opt)?);
    let d = p.shape();
    let segments = p.segments();
    let mut o = views::zeros(ndarray::Ix4(d.b, d.t, d.heads, d.v));
    let mut ht = views::zeros(ndarray::Ix4(d.n, d.heads, d.k, d.v));
    let mut grads = E::Op::grads_buf(&p);
    let sinks: Vec<HeadSink<T, E::Op>> = views::pair_blocks_mut(o.view_mut(), segments)
        .into_iter()
        .zip(views::pair_states_mut(ht.view_mut(), segments))
        .zip(E::Op::grads_sinks(&mut grads, &p))
        .map(|((o, final_state), grads)| HeadSink {
            o,
            final_state,
            grads,
        })
        .collect();
    // Every (sequence, head) pair has a sink: a short list would leave pairs unrun.
    assert_eq!(sinks.len(), segments.len() * d.heads, "one sink per pair");
    per_pair_upstream::<T, E::Op, _, _, _>(
        &p,
        opt,
        d_o,
        dht,
        sinks,
        |head, h0, d_o, dht, sink| engine.forward_backward_into(head, h0, d_o, dht, sink),
    )?;
    Ok((
        E::Op::outputs(opt, o, ht),
        E::Op::chain_grads(x, opt, &p, grads),
    ))
}

/// `f(head, h0, d_o [L, V], dht [K, V], item)` over every pair with its
/// own `item` (in pair order), in parallel, after checking the upstream
/// gradients; the results in pair order.
fn per_pair_upstream<T, O, I, R, F>(
    p: &O::Prepared<'_>,
    opt: &O::Options,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    items: Vec<I>,
    f: F,
) -> Result<Vec<R>>
where
    T: Scalar,
    O: Operator<T>,
    I: Send,
    R: Send,
    F: Fn(&O::Head<'_>, ArrayView2<T>, ArrayView2<T>, ArrayView2<T>, I) -> R + Sync + Send,
{
    let d = p.shape();
    O::validate_upstream(p, d_o, dht)?;
    let d_o = O::upstream_view(d_o);
    let dht = dht.map(|a| O::dht_view(opt, a));
    let segments = p.segments();
    Ok(par_pairs_with(items, d.heads, |si, h, item| {
        let seg = &segments[si];
        let dht_h = match &dht {
            Some(a) => a.slice(s![seg.seq, h, .., ..]).to_owned(),
            None => Array2::zeros((d.k, d.v)),
        };
        f(
            &O::head(p, seg, h),
            initial_state(p, seg.seq, h).view(),
            tensor::head_view(d_o.view(), seg, h),
            dht_h.view(),
            item,
        )
    }))
}

/// Public gradients from per-pair gradients in pair order.
fn assemble_grads<T: Scalar, O: Operator<T>>(
    x: &O::Inputs,
    opt: &O::Options,
    p: &O::Prepared<'_>,
    results: Vec<O::HeadGrads>,
) -> O::Grads {
    let (d, segments) = (p.shape(), p.segments());
    let mut dh0 = Array4::zeros((d.n, d.heads, d.k, d.v));
    let pieces: Vec<_> = results
        .into_iter()
        .enumerate()
        .map(|(i, g)| {
            let (seg, h) = (segments[i / d.heads], i % d.heads);
            dh0.slice_mut(s![seg.seq, h, .., ..])
                .assign(O::head_dh0(&g));
            (seg, h, g)
        })
        .collect();
    O::grads(x, opt, p, pieces, dh0)
}

/// Every output and gradient under FLA's names ([`OpSpec`]), skipping absent ones.
pub fn named<'r, T: Scalar, O: Operator<T>>(
    out: &'r O::Outputs,
    gr: Option<&'r O::Grads>,
) -> Vec<(&'static str, &'r ArrayD<T>)> {
    let outs = O::output_tensors(out);
    debug_assert_eq!(outs.len(), O::OUTPUTS.len(), "{}: OUTPUTS", O::NAME);
    let mut all: Vec<_> = O::OUTPUTS.iter().copied().zip(outs).collect();
    if let Some(gr) = gr {
        let grads = O::grad_tensors(gr);
        debug_assert_eq!(grads.len(), O::GRADS.len(), "{}: GRADS", O::NAME);
        all.extend(O::GRADS.iter().copied().zip(grads));
    }
    all.into_iter()
        .filter_map(|(name, t)| t.map(|t| (name, t)))
        .collect()
}
