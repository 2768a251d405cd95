//! The chunked engines' shell: one engine type, [`Chunk`], over an
//! operator's stages.
//!
//! A chunked engine is its parameters — the chunk size `C`, the precision
//! policy, the span of a long pair — and its operator's stages: FLA's
//! intra-chunk, WY, state (`chunk_delta_h`) and output stages stay in the
//! operator's own files (`kda/chunk/`, `dplr/chunk.rs`, `gdn2/chunk/`),
//! named as FLA names them. The shell holds the parameters once and, for an
//! operator whose stages run on spans ([`Stages`]: KDA, DPLR), is the
//! [`Engine`]: one forward pass serves a forward+backward, and a pair longer
//! than a span runs in spans ([`in_spans`]). GDN-2's engine, whose backward
//! recomputes its forward per call, is an `Engine` of its own on the same
//! shell.

use std::marker::PhantomData;
use std::ops::Range;

use ndarray::{s, Array2, ArrayView2, ArrayViewMut2};

use crate::error::Result;
use crate::fast::spans::{check_span_len, in_spans, SpanForward, SPAN_LEN};
use crate::fast::views;
use crate::op::{Engine, HeadSink, Operator};
use crate::precision::{Policy, Stage};
use crate::registry::ChunkSize;
use crate::scalar::Scalar;

/// The chunked engine of operator `O` (`kda::Chunk` is
/// `Chunk<Kda>`).
#[derive(Clone, Debug, PartialEq)]
pub struct Chunk<O> {
    /// `C`, tokens per chunk (the last chunk of a piece may be shorter).
    pub chunk_size: usize,
    /// What the stages store rounded (exact by default).
    pub policy: Policy,
    /// Tokens per span of a long pair's forward+backward ([`in_spans`]); a
    /// multiple of `chunk_size`.
    span_len: usize,
    /// The operator, as a type only (`fn() -> O`: the engine is `Sync`
    /// whatever `O`).
    op: PhantomData<fn() -> O>,
}

impl<O> Chunk<O> {
    /// Chunks of `chunk_size` tokens: 16, 32 or 64, the sizes of FLA's
    /// kernels; anything else is refused with an error naming
    /// `chunk_size`.
    pub fn new(chunk_size: usize) -> Result<Self> {
        Ok(Chunk::sized(ChunkSize::new(chunk_size)?))
    }

    /// The engine with chunks of `c` tokens, exact, with the default span.
    pub fn sized(c: ChunkSize) -> Self {
        Chunk {
            chunk_size: c.get(),
            policy: Policy::exact(),
            span_len: SPAN_LEN,
            op: PhantomData,
        }
    }

    /// The same engine with its stored stages rounded per `policy` (the
    /// caller refuses a policy asking for more than the operator's
    /// `FEATURES`).
    pub fn with_policy(self, policy: Policy) -> Self {
        Chunk { policy, ..self }
    }

    /// `a` rounded to the backward's operand storage ([`Stage::BwdOperands`]).
    pub(crate) fn operand<T: Scalar>(&self, mut a: Array2<T>) -> Array2<T> {
        self.policy.round(Stage::BwdOperands, &mut a);
        a
    }
}

impl<O: Spans> Chunk<O> {
    /// The same engine with spans of `tokens` (a positive multiple of the
    /// chunk size, else an error naming `span_len`) for long pairs. The
    /// results do not depend on it.
    pub fn with_span_len(self, tokens: usize) -> Result<Self> {
        check_span_len(tokens, self.chunk_size)?;
        Ok(Chunk {
            span_len: tokens,
            ..self
        })
    }
}

/// An operator whose chunked stages run on any span of whole chunks of a
/// pair, so that a long pair runs in spans. Not generic over the scalar (as
/// [`Stages`] is), which lets an operator without it keep an [`Engine`] of
/// its own on the shell.
pub trait Spans {}

/// One head's tensors as an operator's stages read them.
pub(crate) type Head<'h, T, O> = <O as Operator<T>>::Head<'h>;
/// Where one head's gradients are written, row by row.
pub(crate) type Sink<'s, T, O> = <O as Operator<T>>::GradsSink<'s>;

/// An operator's chunked stages, as the shell's [`Engine`] runs them: a
/// forward pass over the chunks keeping FLA's stored tensors, and a
/// backward pass from them.
pub(crate) trait Stages<T: Scalar>: Operator<T> + Spans {
    /// A head's forward intermediates: `o`, the final state and what the
    /// backward reads.
    type Forward: SpanForward<T>;

    /// `L`, `x`'s tokens.
    fn head_len(x: &Head<'_, T, Self>) -> usize;
    /// `x` as the stages index it, borrowing what they read as it is.
    fn staged<'a>(x: &'a Head<'_, T, Self>) -> Head<'a, T, Self>;
    /// Tokens `r` of `x` as a head of their own, as the stages index it: a
    /// span of a long pair.
    fn span<'a>(x: &'a Head<'_, T, Self>, r: Range<usize>) -> Head<'a, T, Self>;
    /// The forward over `x`'s chunks from `S_0 = h0 [K, V]`; without
    /// `read_out` (what a backward recomputes) `o` is left `[0, V]`.
    fn forward_pass(
        e: &Chunk<Self>,
        x: &Head<'_, T, Self>,
        h0: ArrayView2<T>,
        read_out: bool,
    ) -> Self::Forward;
    /// `(o [L, V], S_L [K, V])` of a forward pass that read out.
    fn output(f: Self::Forward) -> (Array2<T>, Array2<T>);
    /// The gradients of `Σ o·do + Σ S_L·dht` from the forward's `fwd`
    /// (`do [L, V]`, `dht [K, V]`).
    fn backward_from(
        e: &Chunk<Self>,
        x: &Head<'_, T, Self>,
        fwd: &Self::Forward,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> Self::HeadGrads;
    /// [`Stages::backward_from`] written into `gr`, chunk by chunk.
    fn backward_into(
        e: &Chunk<Self>,
        x: &Head<'_, T, Self>,
        fwd: &Self::Forward,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        gr: Sink<'_, T, Self>,
    );
    /// The rows `r` of `gr`, with the state gradient at `r.start` written
    /// into `dh0 [K, V]` instead of `gr`'s.
    fn sink_rows<'a>(
        gr: &'a mut Sink<'_, T, Self>,
        r: Range<usize>,
        dh0: ArrayViewMut2<'a, T>,
    ) -> Sink<'a, T, Self>;
    /// `gr`'s `dh0 [K, V]`.
    fn sink_dh0<'a>(gr: Sink<'a, T, Self>) -> ArrayViewMut2<'a, T>;
    /// The transition `M [K, K]` of the whole head, chunk by chunk.
    fn transition(e: &Chunk<Self>, x: &Head<'_, T, Self>) -> Array2<T>;
    /// The prepared inputs as the kernels read them back; unchanged by
    /// default.
    fn stored<'a>(_e: &Chunk<Self>, p: Self::Prepared<'a>) -> Self::Prepared<'a>
    where
        T: 'a,
    {
        p
    }
}

impl<T: Scalar, O: Stages<T>> Engine<T> for Chunk<O> {
    type Op = O;

    fn forward(&self, x: &Head<'_, T, O>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        O::output(O::forward_pass(self, &O::staged(x), h0, true))
    }

    fn backward(
        &self,
        x: &Head<'_, T, O>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> O::HeadGrads {
        let x = &O::staged(x);
        O::backward_from(self, x, &O::forward_pass(self, x, h0, false), d_o, dht)
    }

    /// One forward pass (with its readout) serves the backward too.
    fn forward_backward(
        &self,
        x: &Head<'_, T, O>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ((Array2<T>, Array2<T>), O::HeadGrads) {
        let x = &O::staged(x);
        let fwd = O::forward_pass(self, x, h0, true);
        let grads = O::backward_from(self, x, &fwd, d_o, dht);
        (O::output(fwd), grads)
    }

    /// The gradients written into the run's tensors chunk by chunk; a pair
    /// longer than a span in spans ([`in_spans`]).
    fn forward_backward_into(
        &self,
        x: &Head<'_, T, O>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        out: HeadSink<'_, T, O>,
    ) {
        if O::head_len(x) > self.span_len {
            return self.forward_backward_in_spans(x, h0, d_o, dht, out);
        }
        let x = &O::staged(x);
        let fwd = O::forward_pass(self, x, h0, true);
        views::copy_into(out.o, fwd.o());
        views::copy_into(out.final_state, fwd.final_state());
        O::backward_into(self, x, &fwd, d_o, dht, out.grads);
    }

    fn stored<'a>(&self, p: O::Prepared<'a>) -> O::Prepared<'a>
    where
        T: 'a,
    {
        O::stored(self, p)
    }

    fn transition(&self, x: &Head<'_, T, O>) -> Array2<T> {
        O::transition(self, x)
    }
}

impl<O> Chunk<O> {
    /// [`Engine::forward_backward_into`] of a pair longer than a span:
    /// [`in_spans`] over the stages, each span's gradients written into its
    /// rows of `out`.
    fn forward_backward_in_spans<T: Scalar>(
        &self,
        x: &Head<'_, T, O>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        out: HeadSink<'_, T, O>,
    ) where
        O: Stages<T>,
    {
        let mut grads = out.grads;
        let dh0 = in_spans(
            O::head_len(x),
            self.span_len,
            h0,
            dht,
            out.o,
            out.final_state,
            |r| O::span(x, r),
            |xs, h0, read_out| O::forward_pass(self, xs, h0, read_out),
            |xs, r, fwd, ds, dh0| {
                let d_o = d_o.slice(s![r.clone(), ..]);
                let sink = O::sink_rows(&mut grads, r, dh0);
                O::backward_into(self, xs, fwd, d_o, ds, sink);
            },
        );
        views::copy_into(O::sink_dh0(grads), dh0.view());
    }
}
