//! Everything an implementation produces for one problem — outputs, final
//! state and gradients — as one map from FLA's tensor names to f64 arrays,
//! so any two implementations (or precisions) can be compared row by row.

use std::collections::BTreeMap;

use deltaref::cp::{self, plan::PlanSpec, CpOptions, RankDiag};
use deltaref::dplr::{self, DplrEngine, DplrGrads, DplrInputs, DplrOptions, DplrOutputs};
use deltaref::kda::{self, KdaEngine, KdaGrads, KdaInputs, KdaOptions, KdaOutputs};
use deltaref::tensor::cast;
use deltaref::token_shift::{self, TokenShiftGrads, TokenShiftInputs, TokenShiftOutputs};
use deltaref::{Result, Scalar};
use ndarray::ArrayD;

/// Name → tensor (widened to f64), in name order.
pub type Tensors = BTreeMap<String, ArrayD<f64>>;

fn put<T: Scalar>(m: &mut Tensors, name: &str, x: Option<&ArrayD<T>>) {
    if let Some(x) = x {
        m.insert(name.to_string(), cast(x));
    }
}

/// KDA outputs and gradients under FLA's names.
pub fn kda_map<T: Scalar>(out: &KdaOutputs<T>, gr: &KdaGrads<T>) -> Tensors {
    let mut m = Tensors::new();
    put(&mut m, "o", Some(&out.o));
    put(&mut m, "final_state", out.final_state.as_ref());
    for (name, t) in [
        ("dq", &gr.dq),
        ("dk", &gr.dk),
        ("dv", &gr.dv),
        ("dg", &gr.dg),
        ("dbeta", &gr.dbeta),
    ] {
        put(&mut m, name, Some(t));
    }
    put(&mut m, "dA_log", gr.da_log.as_ref());
    put(&mut m, "ddt_bias", gr.ddt_bias.as_ref());
    put(&mut m, "dh0", gr.dh0.as_ref());
    m
}

/// DPLR outputs and gradients under FLA's names.
pub fn dplr_map<T: Scalar>(out: &DplrOutputs<T>, gr: &DplrGrads<T>) -> Tensors {
    let mut m = Tensors::new();
    put(&mut m, "o", Some(&out.o));
    put(&mut m, "final_state", out.final_state.as_ref());
    for (name, t) in [
        ("dq", &gr.dq),
        ("dk", &gr.dk),
        ("dv", &gr.dv),
        ("da", &gr.da),
        ("db", &gr.db),
        ("dgk", &gr.dgk),
    ] {
        put(&mut m, name, Some(t));
    }
    put(&mut m, "dh0", gr.dh0.as_ref());
    m
}

/// Token-shift outputs and gradients under FLA's names.
pub fn token_shift_map<T: Scalar>(out: &TokenShiftOutputs<T>, gr: &TokenShiftGrads<T>) -> Tensors {
    let mut m = Tensors::new();
    put(&mut m, "y", Some(&out.y));
    put(&mut m, "final_cache", Some(&out.final_cache));
    put(&mut m, "dx", Some(&gr.dx));
    put(&mut m, "dcache", gr.dcache.as_ref());
    m
}

/// KDA `o`, `final_state` and every gradient, computed by `engine` in `T`
/// from f64 inputs (narrowed to `T` first).
pub fn kda<T: Scalar, E: KdaEngine<T>>(
    engine: &E,
    x: &KdaInputs<f64>,
    opts: &KdaOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
) -> Result<Tensors> {
    let xt = x.cast::<T>();
    let opts = KdaOptions {
        output_final_state: true,
        ..*opts
    };
    let out = kda::forward(engine, &xt, &opts)?;
    let gr = kda::backward(
        engine,
        &xt,
        &opts,
        &cast(d_o),
        dht.map(cast::<f64, T>).as_ref(),
    )?;
    Ok(kda_map(&out, &gr))
}

/// DPLR `o`, `final_state` and every gradient, computed by `engine` in `T`.
pub fn dplr<T: Scalar, E: DplrEngine<T>>(
    engine: &E,
    x: &DplrInputs<f64>,
    opts: &DplrOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
) -> Result<Tensors> {
    let xt = x.cast::<T>();
    let opts = DplrOptions {
        output_final_state: true,
        ..*opts
    };
    let out = dplr::forward(engine, &xt, &opts)?;
    let gr = dplr::backward(
        engine,
        &xt,
        &opts,
        &cast(d_o),
        dht.map(cast::<f64, T>).as_ref(),
    )?;
    Ok(dplr_map(&out, &gr))
}

/// Token-shift `y`, `final_cache`, `dx`, `dcache`, computed in `T`.
pub fn token_shift<T: Scalar>(
    x: &TokenShiftInputs<f64>,
    dy: &ArrayD<f64>,
    dfinal_cache: Option<&ArrayD<f64>>,
) -> Result<Tensors> {
    let xt = x.cast::<T>();
    let out = token_shift::forward(&xt)?;
    let gr = token_shift::backward(&xt, &cast(dy), dfinal_cache.map(cast::<f64, T>).as_ref())?;
    Ok(token_shift_map(&out, &gr))
}

/// KDA under simulated CP; also returns the per-rank diagnostics (backward's,
/// which include the forward ones).
pub fn kda_cp<T: Scalar, E: KdaEngine<T>>(
    engine: &E,
    x: KdaInputs<f64>,
    opts: &KdaOptions,
    d_o: ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    plan: &PlanSpec,
    cpo: &CpOptions,
) -> Result<(Tensors, Vec<RankDiag<T>>)> {
    // Taken by value so that a long case is held once (in `T`), not twice.
    let xt = x.cast::<T>();
    drop(x);
    let d_o = cast(&d_o);
    let opts = KdaOptions {
        output_final_state: true,
        ..*opts
    };
    let (out, _) = cp::kda::forward(engine, &xt, &opts, plan, cpo)?;
    let (gr, diags) = cp::kda::backward(
        engine,
        &xt,
        &opts,
        &d_o,
        dht.map(cast::<f64, T>).as_ref(),
        plan,
        cpo,
    )?;
    Ok((kda_map(&out, &gr), diags))
}

/// DPLR under simulated CP, with the per-rank diagnostics.
pub fn dplr_cp<T: Scalar, E: DplrEngine<T>>(
    engine: &E,
    x: DplrInputs<f64>,
    opts: &DplrOptions,
    d_o: ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    plan: &PlanSpec,
    cpo: &CpOptions,
) -> Result<(Tensors, Vec<RankDiag<T>>)> {
    // Taken by value so that a long case is held once (in `T`), not twice.
    let xt = x.cast::<T>();
    drop(x);
    let d_o = cast(&d_o);
    let opts = DplrOptions {
        output_final_state: true,
        ..*opts
    };
    let (out, _) = cp::dplr::forward(engine, &xt, &opts, plan, cpo)?;
    let (gr, diags) = cp::dplr::backward(
        engine,
        &xt,
        &opts,
        &d_o,
        dht.map(cast::<f64, T>).as_ref(),
        plan,
        cpo,
    )?;
    Ok((dplr_map(&out, &gr), diags))
}

/// Token-shift under simulated CP.
pub fn token_shift_cp<T: Scalar>(
    x: &TokenShiftInputs<f64>,
    dy: &ArrayD<f64>,
    dfinal_cache: Option<&ArrayD<f64>>,
    plan: &PlanSpec,
) -> Result<Tensors> {
    let xt = x.cast::<T>();
    let out = cp::token_shift::forward(&xt, plan)?;
    let gr = cp::token_shift::backward(
        &xt,
        &cast(dy),
        dfinal_cache.map(cast::<f64, T>).as_ref(),
        plan,
    )?;
    Ok(token_shift_map(&out, &gr))
}

/// KDA `o` and `final_state` only (no backward pass), computed by `engine`
/// in `T`; under simulated CP when `cp` is given.
pub fn kda_forward<T: Scalar, E: KdaEngine<T>>(
    engine: &E,
    x: &KdaInputs<f64>,
    opts: &KdaOptions,
    cp: Option<(&PlanSpec, &CpOptions)>,
) -> Result<Tensors> {
    let xt = x.cast::<T>();
    let opts = KdaOptions {
        output_final_state: true,
        ..*opts
    };
    let out = match cp {
        None => kda::forward(engine, &xt, &opts)?,
        Some((plan, cpo)) => cp::kda::forward(engine, &xt, &opts, plan, cpo)?.0,
    };
    let mut m = Tensors::new();
    put(&mut m, "o", Some(&out.o));
    put(&mut m, "final_state", out.final_state.as_ref());
    Ok(m)
}

/// DPLR `o` and `final_state` only, computed by `engine` in `T` (CP when `cp` is given).
pub fn dplr_forward<T: Scalar, E: DplrEngine<T>>(
    engine: &E,
    x: &DplrInputs<f64>,
    opts: &DplrOptions,
    cp: Option<(&PlanSpec, &CpOptions)>,
) -> Result<Tensors> {
    let xt = x.cast::<T>();
    let opts = DplrOptions {
        output_final_state: true,
        ..*opts
    };
    let out = match cp {
        None => dplr::forward(engine, &xt, &opts)?,
        Some((plan, cpo)) => cp::dplr::forward(engine, &xt, &opts, plan, cpo)?.0,
    };
    let mut m = Tensors::new();
    put(&mut m, "o", Some(&out.o));
    put(&mut m, "final_state", out.final_state.as_ref());
    Ok(m)
}

/// Token-shift `y` and `final_cache` only, in `T` (CP when `plan` is given).
pub fn token_shift_forward<T: Scalar>(
    x: &TokenShiftInputs<f64>,
    plan: Option<&PlanSpec>,
) -> Result<Tensors> {
    let xt = x.cast::<T>();
    let out = match plan {
        None => token_shift::forward(&xt)?,
        Some(plan) => cp::token_shift::forward(&xt, plan)?,
    };
    let mut m = Tensors::new();
    put(&mut m, "y", Some(&out.y));
    put(&mut m, "final_cache", Some(&out.final_cache));
    Ok(m)
}
