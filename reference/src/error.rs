//! Typed errors: every rejection names the tensor, what was expected and what
//! was found, so a user can fix the call without reading the source.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum Error {
    #[error("tensor `{tensor}`: expected shape {expected}, got {got:?}")]
    Shape {
        tensor: String,
        expected: String,
        got: Vec<usize>,
    },
    #[error("tensor `{tensor}`: non-finite value {value} at index {index:?}")]
    NonFinite {
        tensor: String,
        index: Vec<usize>,
        value: f64,
    },
    #[error("`cu_seqlens`: {0}")]
    CuSeqlens(String),
    #[error("missing tensor `{tensor}`: {why}")]
    Missing { tensor: String, why: String },
    #[error("invalid option `{option}`: {why}")]
    Option { option: String, why: String },
    #[error("context-parallel plan: {0}")]
    Partition(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn shape(tensor: &str, expected: impl Into<String>, got: &[usize]) -> Self {
        Error::Shape {
            tensor: tensor.to_string(),
            expected: expected.into(),
            got: got.to_vec(),
        }
    }

    pub fn option(option: &str, why: impl Into<String>) -> Self {
        Error::Option {
            option: option.to_string(),
            why: why.into(),
        }
    }

    pub fn missing(tensor: &str, why: impl Into<String>) -> Self {
        Error::Missing {
            tensor: tensor.to_string(),
            why: why.into(),
        }
    }
}
