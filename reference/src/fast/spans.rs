//! A chunked engine's long pairs in spans of whole chunks, holding one
//! span's intermediates at a time.

use std::ops::Range;

use ndarray::{s, Array2, ArrayView2, ArrayViewMut2};
use num_traits::Zero;

use crate::error::{Error, Result};

/// Tokens per span of a chunked engine's long pair by default
/// ([`in_spans`]): a span's intermediates at K = V = 128 are about 75 MB,
/// where a 65,536-token pair's were 590 MB.
pub(crate) const SPAN_LEN: usize = 8192;

/// A chunked engine's forward+backward of one pair of `len` tokens in
/// spans of `span` tokens (whole chunks), holding one span's intermediates
/// at a time. The forward runs the spans in order from `h0 [K, V]`,
/// keeping only the state entering each; the backward, from the last span,
/// runs each span's forward again and its backward from the state gradient
/// the later span handed back (`dht [K, V]` for the last). The states carry
/// unrounded both ways, as from one chunk to the next inside a span, so
/// every chunk sees the operands of a whole-pair run and the results are
/// its bits, for the price of a second forward pass.
///
/// `head(r)` is tokens `r` of the pair's head; `forward(x, h0, read_out)`
/// runs them from `h0` (with the readout where asked) and returns their
/// intermediates; `backward(x, r, intermediates, ds, dh0)` writes their
/// gradients from `ds = ∂L/∂(state after r)` and the state gradient at
/// `r.start` into `dh0`. Writes `o [L, V]` and `S_L [K, V]`; returns `dh0`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn in_spans<T: Clone + Zero, H, F: SpanForward<T>>(
    len: usize,
    span: usize,
    h0: ArrayView2<T>,
    dht: ArrayView2<T>,
    mut o: ArrayViewMut2<T>,
    final_state: ArrayViewMut2<T>,
    head: impl Fn(Range<usize>) -> H,
    forward: impl Fn(&H, ArrayView2<T>, bool) -> F,
    mut backward: impl FnMut(&H, Range<usize>, &F, ArrayView2<T>, ArrayViewMut2<T>),
) -> Array2<T> {
    let spans: Vec<_> = (0..len)
        .step_by(span.max(1))
        .map(|s| s..(s + span).min(len))
        .collect();
    let mut entering = Vec::with_capacity(spans.len());
    let mut state = h0.to_owned();
    for r in &spans {
        let fwd = forward(&head(r.clone()), state.view(), true);
        fwd.o().assign_to(o.slice_mut(s![r.clone(), ..]));
        entering.push(std::mem::replace(&mut state, fwd.final_state().to_owned()));
    }
    state.assign_to(final_state);
    let mut ds = dht.to_owned();
    for (r, h0) in spans.iter().zip(&entering).rev() {
        let x = head(r.clone());
        let fwd = forward(&x, h0.view(), false);
        let mut dh0 = Array2::zeros(ds.raw_dim());
        backward(&x, r.clone(), &fwd, ds.view(), dh0.view_mut());
        ds = dh0;
    }
    ds
}

/// What [`in_spans`] reads of a span's forward intermediates.
pub(crate) trait SpanForward<T> {
    /// `o [c, V]` (with the readout).
    fn o(&self) -> ArrayView2<'_, T>;
    /// The state after the span, `[K, V]`.
    fn final_state(&self) -> ArrayView2<'_, T>;
}

/// A chunked engine's span of a long pair ([`crate::fast::spans::in_spans`]):
/// a positive multiple of its chunk size.
pub(crate) fn check_span_len(span_len: usize, chunk_size: usize) -> Result<()> {
    if span_len > 0 && span_len.is_multiple_of(chunk_size) {
        Ok(())
    } else {
        Err(Error::option(
            "span_len",
            format!("must be a positive multiple of the chunk size {chunk_size}, got {span_len}"),
        ))
    }
}
