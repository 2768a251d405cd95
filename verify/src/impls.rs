//! The implementation registry: which code computes a case's outputs and
//! gradients (`--impl`). Every implementation returns the same name → tensor
//! map, so any two can be compared.

use deltaref::{dplr, kda, Scalar};

use crate::case::{Case, CaseError, Inputs};
use crate::outputs::{self, Tensors};

/// An implementation of all three operators.
#[derive(Clone, Debug, PartialEq)]
pub enum Impl {
    /// The naive recurrent oracle.
    Naive,
    /// The chunked form (KDA; token-shift has no chunked form and runs as naive).
    Chunk { chunk_size: usize },
}

/// The scalar an implementation computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compute {
    F64,
    F32,
}

impl Impl {
    /// Parses `--impl` with its `--chunk-size`.
    pub fn parse(name: &str, chunk_size: usize) -> Result<Impl, CaseError> {
        match name {
            "naive" => Ok(Impl::Naive),
            "chunk" => {
                kda::chunk::Chunk::new(chunk_size)
                    .map_err(|e| CaseError::Usage(format!("--chunk-size: {e}")))?;
                Ok(Impl::Chunk { chunk_size })
            }
            other => Err(CaseError::Usage(format!(
                "unknown --impl `{other}` (available: naive, chunk)"
            ))),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Impl::Naive => "naive".into(),
            Impl::Chunk { chunk_size } => format!("chunk(C={chunk_size})"),
        }
    }

    /// Outputs and gradients of `case`'s inputs and upstream gradients.
    pub fn compute(&self, case: &Case, compute: Compute) -> Result<Tensors, deltaref::Error> {
        match compute {
            Compute::F64 => self.compute_in::<f64>(case),
            Compute::F32 => self.compute_in::<f32>(case),
        }
    }

    fn compute_in<T: Scalar>(&self, case: &Case) -> Result<Tensors, deltaref::Error> {
        let (d_o, dht) = case.upstream()?;
        let dht = dht.as_ref();
        match (self, case.inputs()?) {
            (Impl::Naive, Inputs::Kda(x)) => {
                outputs::kda::<T, _>(&kda::naive::Naive, &x, &case.meta.kda_options(), &d_o, dht)
            }
            (Impl::Naive, Inputs::Dplr(x)) => outputs::dplr::<T, _>(
                &dplr::naive::Naive,
                &x,
                &case.meta.dplr_options(),
                &d_o,
                dht,
            ),
            (Impl::Chunk { chunk_size }, Inputs::Kda(x)) => outputs::kda::<T, _>(
                &kda::chunk::Chunk::new(*chunk_size)?,
                &x,
                &case.meta.kda_options(),
                &d_o,
                dht,
            ),
            (Impl::Chunk { .. }, Inputs::Dplr(_)) => Err(deltaref::Error::option(
                "impl",
                "the chunked DPLR form is not part of this build; use --impl naive for dplr",
            )),
            (_, Inputs::TokenShift(x)) => outputs::token_shift::<T>(&x, &d_o, dht),
        }
    }
}
