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
}

/// The scalar an implementation computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compute {
    F64,
    F32,
}

impl Impl {
    /// Parses `--impl`.
    pub fn parse(name: &str) -> Result<Impl, CaseError> {
        match name {
            "naive" => Ok(Impl::Naive),
            other => Err(CaseError::Usage(format!(
                "unknown --impl `{other}` (available: naive)"
            ))),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Impl::Naive => "naive".into(),
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
            (_, Inputs::TokenShift(x)) => outputs::token_shift::<T>(&x, &d_o, dht),
        }
    }
}
