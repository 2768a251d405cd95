//! Deterministic random inputs shaped like FLA's tests (see [`crate::rng`] for
//! the generator): what `selfcheck`, `gen`, fixtures, benchmarks and tests use.
//!
//! Each operator's spec and its draws live in the operator's folder
//! (`kda/spec.rs`, …, beside its registry entry) and are published here,
//! with the pieces they share (`inputs/draw.rs`).

pub(crate) mod draw;

pub use crate::conv::spec::ConvSpec;
pub use crate::dplr::spec::DplrSpec;
pub use crate::gdn::spec::GdnSpec;
pub use crate::kda::spec::KdaSpec;
pub use crate::token_shift::spec::TokenShiftSpec;
pub(crate) use draw::{normal, unit_norm};
pub use draw::{Draw, Generated, Layout, Regime};
