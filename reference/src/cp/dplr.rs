//! DPLR under simulated CP: [`DplrLocal`] over the pre-processed tensors,
//! with any [`crate::dplr::DplrEngine`] doing the local passes.

cp_operator!(
    dplr,
    DplrLocal,
    DplrEngine,
    DplrInputs,
    DplrOptions,
    DplrOutputs,
    DplrGrads,
    DplrHeadGrads
);
