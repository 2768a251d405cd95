//! The engine pieces: the types the operator contract ([`crate::op::Operator`])
//! names as associated types (the validated inputs and their sizes, one piece
//! of one head, its gradients). They are `pub`, as an associated type of a public trait
//! must be, but live in this private module: outside the crate they are
//! reached only through the contract (`<Op as Operator<T>>::Head<'_>`), never
//! by name. Their methods are in the operator's `mod.rs`.

use super::*;

/// Validated inputs as the contract's one-head tensors: `x [B, T, 1, D]`,
/// the initial state as windows `[N, 1, W, D]`.
#[derive(Clone, Debug)]
pub struct Prepared<'a, T> {
    pub(crate) dims: ConvDims,
    pub segments: Vec<Segment>,
    pub x: ArrayView4<'a, T>,
    /// `[D, W]`
    pub weight: ArrayView2<'a, T>,
    /// `[D]`
    pub bias: Option<ArrayView1<'a, T>>,
    pub h0: Option<ArrayView4<'a, T>>,
    pub act: Activation,
}

/// One sequence (or CP piece): tokens `x [L, D]` and the parameters.
#[derive(Clone, Debug)]
pub struct ConvHead<T> {
    pub x: Array2<T>,
    /// `[D, W]`
    pub weight: Array2<T>,
    /// `[D]`
    pub bias: Option<Array1<T>>,
    pub act: Activation,
}

/// Gradients of one piece.
#[derive(Clone, Debug)]
pub struct PieceGrads<T> {
    /// `[L, D]`
    pub dx: Array2<T>,
    /// `[W, D]`, of the window the piece started from.
    pub dwindow: Array2<T>,
    /// `[D, W]`
    pub dweight: Array2<T>,
    /// `[D]`
    pub dbias: Array1<T>,
}
