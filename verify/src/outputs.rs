//! Everything an implementation produces for one problem — outputs, final
//! state and gradients — as one map from FLA's tensor names to f64 arrays,
//! so any two implementations (or precisions) can be compared row by row.
//! Written once over the operator contract ([`deltaref::op`]): the names are
//! the operator's [`OpSpec`] declarations.

use std::collections::BTreeMap;

use deltaref::op::{self, Engine, OpSpec, Operator};
use deltaref::tensor::cast;
use deltaref::{Result, Scalar};
use ndarray::ArrayD;

/// Name → tensor (widened to f64), in name order.
pub type Tensors = BTreeMap<String, ArrayD<f64>>;

/// Outputs and (when given) gradients under FLA's names.
pub fn map<T: Scalar, O: Operator<T>>(out: &O::Outputs, gr: Option<&O::Grads>) -> Tensors {
    op::named::<T, O>(out, gr)
        .into_iter()
        .map(|(name, t)| (name.to_string(), cast(t)))
        .collect()
}

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
    Ok(map::<T, E::Op>(&out, Some(&gr)))
}
