//! How one stage stores a value ([`Store`], the result of
//! [`super::Policy::store`]): `pub`, as a public method's result must be,
//! but in this private module, so that it has no public path; its methods
//! are in `precision.rs`.

use super::*;

/// How one stage stores a value: its dtype and, in an ensemble member, the
/// jitter applied before rounding ([`Policy::store`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Store {
    pub dtype: Dtype,
    pub(super) stage: Stage,
    pub(super) jitter: Option<Jitter>,
}
