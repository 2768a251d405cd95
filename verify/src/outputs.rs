//! Everything an implementation produces for one problem — outputs, final
//! state and gradients — as one map from FLA's tensor names to f64 arrays,
//! so any two implementations (or precisions) can be compared row by row.
//! Written once over the operator contract ([`deltaref::op`]): the names are
//! the operator's [`OpSpec`] declarations.

use std::collections::BTreeMap;

use deltaref::cp::{self, plan::PlanSpec, CpOptions, RankDiag};
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

/// The inputs and `do` narrowed to `T`, each f64 original freed as soon as
/// it is narrowed: taken by value so that a long case is held once (in
/// `T`), not twice. In f64 they are moved, not copied.
fn narrow_owned<T: Scalar, O: Operator<f64> + Operator<T>>(
    x: <O as Operator<f64>>::Inputs,
    d_o: ArrayD<f64>,
) -> (<O as Operator<T>>::Inputs, ArrayD<T>)
where
    <O as Operator<f64>>::Inputs: 'static,
    <O as Operator<T>>::Inputs: 'static,
{
    let xt = same_type(x).unwrap_or_else(|x| <O as Operator<T>>::narrow(&x));
    let d_o = same_type(d_o).unwrap_or_else(|d_o| cast(&d_o));
    (xt, d_o)
}

/// `x` itself when `U` is its type (a move), else `x` back.
fn same_type<X: 'static, U: 'static>(x: X) -> std::result::Result<U, X> {
    let mut slot = Some(x);
    match (&mut slot as &mut dyn std::any::Any).downcast_mut::<Option<U>>() {
        Some(u) => Ok(u.take().expect("just filled")),
        None => Err(slot.take().expect("just filled")),
    }
}

/// [`all`] consuming the inputs and `do`, as [`all_cp`] does: a long case
/// is held once (in `T`), and freed before the results are widened into
/// the map. The same values.
pub fn all_owned<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: <E::Op as Operator<f64>>::Inputs,
    opts: &<E::Op as OpSpec>::Options,
    d_o: ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
) -> Result<Tensors>
where
    E::Op: Operator<f64>,
{
    let (xt, d_o_t) = narrow_owned::<T, E::Op>(x, d_o);
    let opts = E::Op::all_outputs(opts);
    let (out, gr) =
        op::forward_backward(engine, &xt, &opts, &d_o_t, dht.map(cast::<f64, T>).as_ref())?;
    drop((xt, d_o_t));
    Ok(map::<T, E::Op>(&out, Some(&gr)))
}

/// [`all`] under simulated CP; also returns the per-rank diagnostics
/// (backward's, which include the forward ones).
pub fn all_cp<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: <E::Op as Operator<f64>>::Inputs,
    opts: &<E::Op as OpSpec>::Options,
    d_o: ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    plan: &PlanSpec,
    cpo: &CpOptions,
) -> Result<(Tensors, Vec<RankDiag<T>>)>
where
    E::Op: Operator<f64>,
{
    let (xt, d_o_t) = narrow_owned::<T, E::Op>(x, d_o);
    let opts = E::Op::all_outputs(opts);
    let (out, gr, diags) = cp::forward_backward(
        engine,
        &xt,
        &opts,
        &d_o_t,
        dht.map(cast::<f64, T>).as_ref(),
        plan,
        cpo,
    )?;
    drop((xt, d_o_t));
    Ok((map::<T, E::Op>(&out, Some(&gr)), diags))
}

/// The forward outputs only (no backward pass), computed by `engine` in `T`;
/// under simulated CP when `cp` is given.
pub fn forward_only<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<f64>>::Inputs,
    opts: &<E::Op as OpSpec>::Options,
    cp: Option<(&PlanSpec, &CpOptions)>,
) -> Result<Tensors>
where
    E::Op: Operator<f64>,
{
    let xt = <E::Op as Operator<T>>::narrow(x);
    let opts = E::Op::all_outputs(opts);
    let out = match cp {
        None => op::forward(engine, &xt, &opts)?,
        Some((plan, cpo)) => cp::forward(engine, &xt, &opts, plan, cpo)?.0,
    };
    Ok(map::<T, E::Op>(&out, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_type_moves_the_tensor_and_declines_another_type() {
        let a = ArrayD::from_shape_vec(vec![2, 3], (0..6).map(f64::from).collect()).unwrap();
        let at = a.as_ptr();
        let moved: ArrayD<f64> = same_type(a).expect("f64 to f64");
        assert_eq!(moved.as_ptr(), at, "moved, not copied");
        let back = same_type::<ArrayD<f64>, ArrayD<f32>>(moved).expect_err("f64 is not f32");
        assert_eq!(back.as_ptr(), at);
    }
}
