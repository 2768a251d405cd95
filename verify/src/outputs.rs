//! Everything an implementation produces for one problem — outputs, final
//! state and gradients — as one map from FLA's tensor names to f64 arrays,
//! so any two implementations (or precisions) can be compared row by row:
//! the oracle's [`deltaref::registry::named`] map, written once there over
//! the operator contract ([`deltaref::op`]).

use deltaref::op::{self, Engine, OpSpec, Operator};
use deltaref::registry::named;
pub use deltaref::registry::Tensors;
use deltaref::tensor::cast;
use deltaref::{Result, Scalar};
use ndarray::ArrayD;

/// Every output (final state included) and every gradient, computed by
/// `engine` in `T` from f64 inputs (narrowed to `T` first).
pub fn all<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<f64>>::Inputs,
    opts: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
) -> Result<Tensors>
where
    E::Op: Operator<f64>,
{
    let xt = <E::Op as Operator<T>>::narrow(x);
    let opts = E::Op::all_outputs(opts);
    let (out, gr) = op::forward_backward(
        engine,
        &xt,
        &opts,
        &cast(d_o),
        dht.map(cast::<f64, T>).as_ref(),
    )?;
    Ok(named::<T, E::Op>(&out, Some(&gr)))
}
