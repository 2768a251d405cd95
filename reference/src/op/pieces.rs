//! The contract's own pieces: the validated inputs' trait ([`Prepared`],
//! the bound on `Operator::Prepared`), the sizes it reports ([`Shape`]),
//! one pair's result views ([`HeadSink`]) and the per-pair gradients of an
//! operator that keeps them whole ([`Collected`]). They are `pub`, as the
//! public traits' signatures require, but live in this private module:
//! outside the crate they are used through the operators and engines,
//! never named. Their methods are in `op.rs`.

use super::*;

/// Sizes the drivers need: `B`, `T`, `N` sequences, state-carrying heads,
/// state `[K, V]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub b: usize,
    pub t: usize,
    pub n: usize,
    pub heads: usize,
    pub k: usize,
    pub v: usize,
}

/// Validated inputs, ready to cut into pieces ([`Operator::head`]).
pub trait Prepared<T: Scalar>: Sync {
    fn shape(&self) -> Shape;
    /// Whole sequences of the batch (CP cuts them further).
    fn segments(&self) -> &[Segment];
    /// `[N, heads, K, V]`, when an initial state was given.
    fn h0(&self) -> Option<ArrayView4<'_, T>>;
}

/// One (sequence, head) pair's share of a forward+backward run's results,
/// written in place ([`Engine::forward_backward_into`]): views of the full
/// tensors.
pub struct HeadSink<'s, T: Scalar, O: Operator<T>> {
    /// `o [L, V]`
    pub o: ArrayViewMut2<'s, T>,
    /// `S_L [K, V]`
    pub final_state: ArrayViewMut2<'s, T>,
    pub grads: O::GradsSink<'s>,
}

/// A [`Operator::GradsBuf`] that keeps each pair's gradients as its engine
/// returns them, for operators whose gradients are not only per-token
/// tensors (a convolution's weight gradient sums over the pairs).
pub struct Collected<G>(pub(super) Vec<Option<G>>);
