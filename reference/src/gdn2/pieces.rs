//! The engine pieces: the types the operator contract ([`crate::op::Operator`])
//! names as associated types (the validated inputs and their sizes, one piece
//! of one head, its gradients). They are `pub`, as an associated type of a public trait
//! must be, but live in this private module: outside the crate they are
//! reached only through the contract (`<Op as Operator<T>>::Head<'_>`), never
//! by name. Their methods are in the operator's `mod.rs`.

use super::*;

/// Sizes of a validated GDN-2 problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gdn2Dims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub k: usize,
    pub v: usize,
    /// Number of sequences.
    pub n: usize,
}

/// One head of one sequence (or CP piece) after pre-processing: all an
/// engine sees. Token-major rows `[L, ·]`, borrowed from the prepared
/// tensors except the scaled query.
#[derive(Clone, Debug)]
pub struct Gdn2Head<'h, T> {
    /// `[L, K]`, `scale · q` (l2-normalised first if asked).
    pub q: CowArray<'h, T, Ix2>,
    /// `[L, K]`, l2-normalised if asked.
    pub k: CowArray<'h, T, Ix2>,
    /// `[L, V]`
    pub v: CowArray<'h, T, Ix2>,
    /// `[L, K]` log-space decay (after the in-kernel gate).
    pub g: CowArray<'h, T, Ix2>,
    /// `[L, K]` erase gate.
    pub b: CowArray<'h, T, Ix2>,
    /// `[L, V]` write gate.
    pub w: CowArray<'h, T, Ix2>,
}

/// Gradients of one piece with respect to [`Gdn2Head`]'s tensors (`dq` is
/// with respect to the scaled query) and its initial state.
#[derive(Clone, Debug)]
pub struct Gdn2HeadGrads<T> {
    /// `[L, K]`
    pub dq: Array2<T>,
    /// `[L, K]`
    pub dk: Array2<T>,
    /// `[L, V]`
    pub dv: Array2<T>,
    /// `[L, K]`, with respect to the decay.
    pub dg: Array2<T>,
    /// `[L, K]`
    pub db: Array2<T>,
    /// `[L, V]`
    pub dw: Array2<T>,
    /// `[K, V]`
    pub dh0: Array2<T>,
}

/// Validated inputs after FLA's fused pre-processing (l2norm, gate), states
/// in `[N, H, K, V]`; what the pre-processing leaves alone is borrowed.
#[derive(Clone, Debug)]
pub struct Prepared<'a, T> {
    pub dims: Gdn2Dims,
    pub scale: f64,
    pub segments: Vec<Segment>,
    /// `[B, T, H, K]`, l2-normalised if asked (not yet scaled).
    pub q: CowArray<'a, T, Ix4>,
    /// `[B, T, H, K]`, l2-normalised if asked.
    pub k: CowArray<'a, T, Ix4>,
    /// `[B, T, H, V]`
    pub v: ArrayView4<'a, T>,
    /// `[B, T, H, K]` log-space decay.
    pub g: CowArray<'a, T, Ix4>,
    /// `[B, T, H, K]`
    pub b: ArrayView4<'a, T>,
    /// `[B, T, H, V]`
    pub w: ArrayView4<'a, T>,
    /// `[N, H, K, V]`
    pub h0: Option<CowArray<'a, T, Ix4>>,
    /// The public state tensors are `[N, H, V, K]`.
    pub state_v_first: bool,
    /// q and k went through the in-kernel l2norm.
    pub l2norm: bool,
}
