//! KDA under simulated CP: [`KdaLocal`] over the pre-processed tensors, with
//! any [`crate::kda::KdaEngine`] doing the local passes.

cp_operator!(
    kda,
    KdaLocal,
    KdaEngine,
    KdaInputs,
    KdaOptions,
    KdaOutputs,
    KdaGrads,
    KdaHeadGrads
);
