//! The naive engines' shared driver: the recurrence one token at a time over
//! a `[K, V]` state held as a row-major slice, with a checkpointed backward.
//! An operator's naive engine ([`Recurrence`]) gives its per-row arithmetic
//! only (what a sweep does to a row of the state, how a token's state is
//! replayed, its reverse sweeps); the schedule, the checkpoints, the replay
//! of each block, the readout and the four [`crate::op::Engine`] entry
//! points are here.
//!
//! Each token has two halves, *start* and *finish*. The finish of one token
//! and the start of the next run in one sweep over the state, a tile of
//! columns at a time ([`sweep`]), so the state is read and written once per
//! token and the `[V]` accumulators (`o`, the next token's vector) stay in
//! registers down the `K` rows. The start leaves a `[V]` vector that the
//! finish reads (KDA's residual `r = v − S'ᵀk`, DPLR's `w = aᵀS`); the
//! checkpoint pass keeps it, `[L, V]`, which makes recomputing a token one
//! elementwise pass ([`Tokens::replay`]).
//!
//! Backward is the operator's hand-derived reverse-time recurrence
//! ([`Back::block`]). States are kept only at checkpoints every `⌈√L⌉`
//! tokens (more often where a block of states would not fit the cache:
//! [`super::sweep::state_block_len`]) and recomputed per block, so memory is
//! `O(√L · K · V)` rather than `O(L · K · V)`. A forward+backward run
//! ([`crate::op::Engine::forward_backward`]) reads out `o` during the
//! checkpoint pass
//! instead of running the forward again.
//!
//! Engine calls run through [`simd::dispatch`], hence the `#[inline(always)]`
//! on everything they call per token.

use ndarray::{Array2, ArrayView2, ArrayViewMut2};

use super::scratch::{self, Rows};
use super::simd;
use super::sweep::{reverse_blocks, run_tokens, state, Pairs, TILE};
use super::views::{contiguous_rows, row_mut};
use crate::op::{HeadSink, Operator};
use crate::scalar::Scalar;

/// The piece an engine of operator `O` computes, in scalar `T`.
type Head<'h, T, O> = <O as Operator<T>>::Head<'h>;
/// Where an engine of operator `O` writes one piece's gradients.
type Sink<'s, T, O> = <O as Operator<T>>::GradsSink<'s>;

/// An operator's naive engine: its per-row arithmetic, which the driver
/// runs; its [`crate::op::Engine`] impl is [`engine!`].
pub(crate) trait Recurrence<T: Scalar>: Sync {
    type Op: Operator<T>;
    /// One head's tensors as the sweeps read them.
    type Tokens<'a>: Tokens<T, Op = Self::Op>;

    fn tokens<'a>(x: &'a Head<'_, T, Self::Op>) -> Self::Tokens<'a>;
    /// `(L, V)`, the shape of `x`'s output `o` (known without
    /// [`Recurrence::tokens`], which computes the decays).
    fn o_dim(x: &Head<'_, T, Self::Op>) -> (usize, usize);
    /// Zero gradients for `x`'s tokens and state.
    fn zero_grads(x: &Head<'_, T, Self::Op>) -> <Self::Op as Operator<T>>::HeadGrads;
    /// `g` as a sink to write into.
    fn sink(g: &mut <Self::Op as Operator<T>>::HeadGrads) -> Sink<'_, T, Self::Op>;
    /// The sink's `dh0 [K, V]`.
    fn dh0<'a>(g: &'a mut Sink<'_, T, Self::Op>) -> ArrayViewMut2<'a, T>;
}

/// One head's tokens as an operator's sweeps read them.
pub(crate) trait Tokens<T: Scalar> {
    type Op: Operator<T>;
    /// The `[K]` coefficients of one sweep, borrowed from the head and
    /// from [`Tokens::Buf`].
    type Rows<'b>: SweepRows<T>
    where
        Self: 'b;
    /// Buffers for the coefficients a sweep computes per token.
    type Buf;
    /// The reverse sweeps of one head and what they carry.
    type Back<'a>: Back<T, Self::Op>
    where
        Self: 'a;

    /// `(L, K, V)`
    fn dims(&self) -> (usize, usize, usize);
    fn buf(&self) -> Self::Buf;
    /// Asks the CPU for the rows of token `n`, which the next sweep reads.
    fn prefetch(&self, n: usize);
    /// The coefficients of the sweep that finishes token `fin` (reading out
    /// `o` with `read`) and starts token `start`.
    fn rows<'b>(
        &'b self,
        buf: &'b mut Self::Buf,
        fin: Option<usize>,
        read: bool,
        start: Option<usize>,
    ) -> Self::Rows<'b>;
    /// `S_t` into `s` from `S_{t−1}` (`s_prev`) and token `t`'s kept `[V]`
    /// vector, both in the [`Pairs`] layout: the forward sweep's operations
    /// without its reductions.
    fn replay(&self, t: usize, kept: &[T], s_prev: &[T], s: &mut [T]);
    /// The reverse sweeps over these tokens, given the kept vectors `[L,
    /// V]` and `do [L, V]` (rows contiguous).
    fn back<'a>(&'a self, kept: &'a Rows<T>, d_o: ArrayView2<'a, T>) -> Self::Back<'a>;
}

/// An operator's reverse sweeps.
pub(crate) trait Back<T: Scalar, O: Operator<T>> {
    /// Tokens `start .. end` in reverse: `prev` holds `S_{t−1}` for each and
    /// `ds` holds `∂L/∂S_{end−1}` on entry, `∂L/∂S_{start−1}` on exit (all
    /// in the [`Pairs`] layout); the tokens' gradients go to `gr`.
    fn block(&mut self, start: usize, end: usize, prev: &[T], ds: &mut [T], gr: &mut Sink<T, O>);
}

/// What a sweep does to row `i` of the state (its `[K]` coefficients are
/// read once per row, before the row's columns), and the `[V]` vectors it
/// reads besides the kept one.
pub(crate) trait SweepRows<T: Scalar>: Copy {
    /// The finish's coefficients of one row.
    type Fin: Copy + Default;
    /// The start's coefficients of one row.
    type Start: Copy + Default;
    /// Whether the finish reads [`SweepRows::extra`].
    const EXTRA: bool;
    /// Whether the start's `[V]` output begins at [`SweepRows::next0`]
    /// (else at zero).
    const NEXT0: bool;

    /// `K`
    fn len(&self) -> usize;
    fn fin(&self, i: usize) -> Self::Fin;
    /// Row `i`'s query element (the readout `o += q_i S_i`).
    fn q(&self, i: usize) -> T;
    fn start(&self, i: usize) -> Self::Start;
    /// A `[V]` vector of the finished token that its finish reads.
    fn extra(&self) -> &[T];
    /// Where the started token's `[V]` vector begins.
    fn next0(&self) -> &[T];
    /// An element `x` of the row after the finish, given the kept vector's
    /// and [`SweepRows::extra`]'s elements of its column.
    fn finish(f: Self::Fin, x: T, kept: T, extra: T) -> T;
    /// `(x, next)` after the start: the element and the started token's
    /// vector element of its column.
    fn begin(s: Self::Start, x: T, next: T) -> (T, T);
}

/// The `[V]` vectors of a sweep: the kept vector of the finished token, and
/// the outputs `o` and the started token's vector.
struct SweepIo<'a, T> {
    kept: &'a [T],
    o: &'a mut [T],
    next: &'a mut [T],
}

/// What a forward run records besides the final state.
struct Record<'a, T: Scalar> {
    /// `o [L, V]`
    o: Option<ArrayViewMut2<'a, T>>,
    /// The kept vectors `[L, V]`.
    kept: Option<&'a mut Rows<T>>,
    /// The states at the checkpoints of [`run_tokens`], appended.
    checkpoints: Option<&'a mut Vec<T>>,
}

/// The [`crate::op::Engine`] items of an operator's naive engine (a
/// [`Recurrence`] of operator `$op`): `impl<T: Scalar> Engine<T> for Naive {
/// engine!(Kda); }`. (A blanket `impl Engine for R: Recurrence` would
/// overlap the other engines' impls, or, made disjoint, put the engines'
/// private arithmetic types in the crate's public interface.)
macro_rules! engine {
    ($op:ty) => {
        type Op = $op;

        fn forward(
            &self,
            x: &<$op as $crate::op::Operator<T>>::Head<'_>,
            h0: ndarray::ArrayView2<T>,
        ) -> (ndarray::Array2<T>, ndarray::Array2<T>) {
            $crate::fast::naive::forward::<T, Self>(x, h0)
        }

        fn backward(
            &self,
            x: &<$op as $crate::op::Operator<T>>::Head<'_>,
            h0: ndarray::ArrayView2<T>,
            d_o: ndarray::ArrayView2<T>,
            dht: ndarray::ArrayView2<T>,
        ) -> <$op as $crate::op::Operator<T>>::HeadGrads {
            $crate::fast::naive::backward::<T, Self>(x, h0, d_o, dht)
        }

        /// The backward's own forward run reads out `o` on the way: one
        /// run instead of two, with the bits of each.
        fn forward_backward(
            &self,
            x: &<$op as $crate::op::Operator<T>>::Head<'_>,
            h0: ndarray::ArrayView2<T>,
            d_o: ndarray::ArrayView2<T>,
            dht: ndarray::ArrayView2<T>,
        ) -> (
            (ndarray::Array2<T>, ndarray::Array2<T>),
            <$op as $crate::op::Operator<T>>::HeadGrads,
        ) {
            $crate::fast::naive::forward_backward::<T, Self>(x, h0, d_o, dht)
        }

        /// [`Engine::forward_backward`] writing `o`, `S_L` and the
        /// gradients row by row into the run's tensors.
        fn forward_backward_into(
            &self,
            x: &<$op as $crate::op::Operator<T>>::Head<'_>,
            h0: ndarray::ArrayView2<T>,
            d_o: ndarray::ArrayView2<T>,
            dht: ndarray::ArrayView2<T>,
            out: $crate::op::HeadSink<'_, T, $op>,
        ) {
            $crate::fast::naive::forward_backward_into::<T, Self>(x, h0, d_o, dht, out)
        }
    };
}
pub(crate) use engine;

/// [`crate::op::Engine::forward`] of a naive engine.
pub(crate) fn forward<T: Scalar, R: Recurrence<T>>(
    x: &Head<'_, T, R::Op>,
    h0: ArrayView2<T>,
) -> (Array2<T>, Array2<T>) {
    simd::dispatch(
        #[inline(always)]
        || forward_head::<T, R>(x, h0),
    )
}

/// [`crate::op::Engine::backward`] of a naive engine.
pub(crate) fn backward<T: Scalar, R: Recurrence<T>>(
    x: &Head<'_, T, R::Op>,
    h0: ArrayView2<T>,
    d_o: ArrayView2<T>,
    dht: ArrayView2<T>,
) -> <R::Op as Operator<T>>::HeadGrads {
    let mut gr = R::zero_grads(x);
    simd::dispatch(
        #[inline(always)]
        || backward_head::<T, R>(x, h0, d_o, dht, None, None, R::sink(&mut gr)),
    );
    gr
}

/// [`crate::op::Engine::forward_backward`] of a naive engine.
#[allow(clippy::type_complexity)]
pub(crate) fn forward_backward<T: Scalar, R: Recurrence<T>>(
    x: &Head<'_, T, R::Op>,
    h0: ArrayView2<T>,
    d_o: ArrayView2<T>,
    dht: ArrayView2<T>,
) -> ((Array2<T>, Array2<T>), <R::Op as Operator<T>>::HeadGrads) {
    let (mut o, mut s_l) = (Array2::zeros(R::o_dim(x)), Array2::zeros(h0.raw_dim()));
    let mut gr = R::zero_grads(x);
    let (o_out, s_out) = (Some(o.view_mut()), Some(s_l.view_mut()));
    simd::dispatch(
        #[inline(always)]
        || backward_head::<T, R>(x, h0, d_o, dht, o_out, s_out, R::sink(&mut gr)),
    );
    ((o, s_l), gr)
}

/// [`crate::op::Engine::forward_backward_into`] of a naive engine.
pub(crate) fn forward_backward_into<T: Scalar, R: Recurrence<T>>(
    x: &Head<'_, T, R::Op>,
    h0: ArrayView2<T>,
    d_o: ArrayView2<T>,
    dht: ArrayView2<T>,
    out: HeadSink<'_, T, R::Op>,
) {
    let (o, s_l) = (Some(out.o), Some(out.final_state));
    simd::dispatch(
        #[inline(always)]
        || backward_head::<T, R>(x, h0, d_o, dht, o, s_l, out.grads),
    )
}

#[inline(always)]
fn forward_head<T: Scalar, R: Recurrence<T>>(
    x: &Head<'_, T, R::Op>,
    h0: ArrayView2<T>,
) -> (Array2<T>, Array2<T>) {
    let tokens = R::tokens(x);
    let (l, _, vd) = tokens.dims();
    let mut s = state(h0);
    let mut o = Array2::zeros((l, vd));
    let rec = Record {
        o: Some(o.view_mut()),
        kept: None,
        checkpoints: None,
    };
    run(&tokens, &mut s, rec);
    (o, Array2::from_shape_vec(h0.raw_dim(), s).expect("K×V"))
}

/// The gradients, written into `gr`, from a forward run that keeps the
/// checkpoints and the kept vectors, reading out `o` and `S_L` into `o`
/// and `final_state` when given.
#[inline(always)]
fn backward_head<T: Scalar, R: Recurrence<T>>(
    x: &Head<'_, T, R::Op>,
    h0: ArrayView2<T>,
    d_o: ArrayView2<T>,
    dht: ArrayView2<T>,
    o: Option<ArrayViewMut2<T>>,
    final_state: Option<ArrayViewMut2<T>>,
    mut gr: Sink<'_, T, R::Op>,
) {
    let tokens = R::tokens(x);
    let (l, kd, vd) = tokens.dims();
    let mut kept = Rows::overwritten(l, vd);
    let mut checkpoints = scratch::with_capacity(0);
    let rec = Record {
        o,
        kept: Some(&mut kept),
        checkpoints: Some(&mut *checkpoints),
    };
    let mut s = state(h0);
    run(&tokens, &mut s, rec);
    if let Some(mut out) = final_state {
        out.assign(&ArrayView2::from_shape((kd, vd), &s).expect("K×V"));
    }
    let d_o = contiguous_rows(d_o);
    let mut back = tokens.back(&kept, d_o.view());
    let mut ds = state(dht);
    reverse_blocks(
        l,
        Pairs { k: kd, v: vd },
        &checkpoints,
        &mut ds,
        #[inline(always)]
        |t, s_prev: &[T], s: &mut [T]| tokens.replay(t, kept.row(t), s_prev, s),
        #[inline(always)]
        |start, end, prev: &[T], ds: &mut [T]| back.block(start, end, prev, ds, &mut gr),
    );
    R::dh0(&mut gr).assign(&ArrayView2::from_shape((kd, vd), &ds).expect("K×V"));
}

/// Runs all tokens from the state `s` (see [`run_tokens`]), leaving `S_L`
/// in it.
#[inline(always)]
fn run<T: Scalar, K: Tokens<T>>(tokens: &K, s: &mut [T], rec: Record<T>) {
    let (l, _, vd) = tokens.dims();
    let Record {
        mut o,
        mut kept,
        checkpoints,
    } = rec;
    let (mut cur, mut next) = (vec![T::zero(); vd], vec![T::zero(); vd]);
    let mut buf = tokens.buf();
    let mut o_row = vec![T::zero(); if o.is_some() { vd } else { 0 }];
    run_tokens(
        l,
        s,
        checkpoints,
        #[inline(always)]
        |s: &mut [T], fin, start| {
            if let Some(n) = start.map(|t| t + 1).filter(|&n| n < l) {
                tokens.prefetch(n);
            }
            let read = fin.is_some() && !o_row.is_empty();
            let rows = tokens.rows(&mut buf, fin, read, start);
            let mut io = SweepIo {
                kept: &cur,
                o: &mut o_row,
                next: &mut next,
            };
            match (fin.is_some(), read, start.is_some()) {
                (true, true, true) => sweep::<T, _, true, true, true>(s, rows, &mut io),
                (true, true, false) => sweep::<T, _, true, true, false>(s, rows, &mut io),
                (true, false, true) => sweep::<T, _, true, false, true>(s, rows, &mut io),
                (true, false, false) => sweep::<T, _, true, false, false>(s, rows, &mut io),
                (false, _, true) => sweep::<T, _, false, false, true>(s, rows, &mut io),
                (false, _, false) => {}
            }
            if let (Some(o), Some(p)) = (&mut o, fin) {
                row_mut(o, p).copy_from_slice(&o_row);
            }
            if let Some(t) = start {
                if let Some(ks) = &mut kept {
                    ks.row_mut(t).copy_from_slice(&next);
                }
                std::mem::swap(&mut cur, &mut next);
            }
        },
    );
}

/// One sweep over the state `s [K, V]`. The halves it runs are constants
/// (`FIN`ish, `READ` out, `START`), so each combination compiles to a loop
/// without branches; vectors of absent halves are never touched.
#[inline(always)]
fn sweep<T: Scalar, R: SweepRows<T>, const FIN: bool, const READ: bool, const START: bool>(
    s: &mut [T],
    rows: R,
    io: &mut SweepIo<T>,
) {
    let vd = s.len() / rows.len();
    let full = vd / TILE * TILE;
    for j0 in (0..full).step_by(TILE) {
        sweep_tile::<T, R, TILE, FIN, READ, START>(s, vd, rows, j0, io);
    }
    for j0 in full..vd {
        sweep_tile::<T, R, 1, FIN, READ, START>(s, vd, rows, j0, io);
    }
}

/// [`sweep`] over columns `j0 .. j0 + W` (the arithmetic per element does
/// not depend on `W`, so the tiling leaves the bits alone). Each row's tile
/// is copied into registers and back, which lets LLVM vectorise it. The
/// row's coefficients are read before its columns: read inside the column
/// loop, LLVM may keep the tiles in memory, checking at every row that they
/// do not overlap the coefficients (3–4× slower).
#[inline(always)]
fn sweep_tile<
    T: Scalar,
    R: SweepRows<T>,
    const W: usize,
    const FIN: bool,
    const READ: bool,
    const START: bool,
>(
    s: &mut [T],
    vd: usize,
    rows: R,
    j0: usize,
    io: &mut SweepIo<T>,
) {
    let cols = j0..j0 + W;
    let tile = |a: &[T]| -> [T; W] { a[cols.clone()].try_into().expect("W columns") };
    let zeros = [T::zero(); W];
    let kept = if FIN { tile(io.kept) } else { zeros };
    let extra = if FIN && R::EXTRA {
        tile(rows.extra())
    } else {
        zeros
    };
    let (mut o, mut next) = (
        zeros,
        if START && R::NEXT0 {
            tile(rows.next0())
        } else {
            zeros
        },
    );
    for (i, s_row) in s.chunks_exact_mut(vd).enumerate() {
        let s_tile: &mut [T; W] = (&mut s_row[cols.clone()]).try_into().expect("W columns");
        let f = if FIN { rows.fin(i) } else { R::Fin::default() };
        let q = if READ { rows.q(i) } else { T::zero() };
        let b = if START {
            rows.start(i)
        } else {
            R::Start::default()
        };
        let mut x = *s_tile;
        for j in 0..W {
            if FIN {
                x[j] = R::finish(f, x[j], kept[j], extra[j]);
            }
            if READ {
                o[j] += q * x[j];
            }
            if START {
                (x[j], next[j]) = R::begin(b, x[j], next[j]);
            }
        }
        *s_tile = x;
    }
    if READ {
        io.o[cols.clone()].copy_from_slice(&o);
    }
    if START {
        io.next[cols].copy_from_slice(&next);
    }
}
