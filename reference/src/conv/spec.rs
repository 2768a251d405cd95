//! Causal conv1d's generated problems: [`ConvSpec`] (published as
//! `deltaref::inputs::ConvSpec`).

use super::ConvInputs;
use crate::inputs::draw::{normal, Generated, Layout};

/// What a generated causal conv1d problem contains.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvSpec {
    pub layout: Layout,
    pub d: usize,
    /// Kernel width.
    pub w: usize,
    pub bias: bool,
    pub initial_state: bool,
    pub seed: u64,
}

impl ConvSpec {
    /// Causal conv1d inputs as FLA's tests draw them: x, weight, bias,
    /// initial_state, dy and dht normal.
    pub fn generate(&self) -> Generated<ConvInputs<f64>> {
        conv(self)
    }
}

/// [`ConvSpec::generate`].
pub(crate) fn conv(s: &ConvSpec) -> Generated<ConvInputs<f64>> {
    let (b, t, n) = (s.layout.b, s.layout.t, s.layout.n());
    Generated {
        inputs: ConvInputs {
            x: normal(s.seed, "x", &[b, t, s.d]),
            weight: normal(s.seed, "weight", &[s.d, s.w]),
            bias: s.bias.then(|| normal(s.seed, "bias", &[s.d])),
            initial_state: s
                .initial_state
                .then(|| normal(s.seed, "initial_state", &[n, s.d, s.w])),
            cu_seqlens: s.layout.cu_seqlens(),
        },
        d_o: normal(s.seed, "dy", &[b, t, s.d]),
        dht: normal(s.seed, "dht", &[n, s.d, s.w]),
    }
}
