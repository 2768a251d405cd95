//! `DELTAREF_GPU_TESTS=1` at build time turns the GPU tests on (cfg
//! `deltaref_gpu_tests`); without it they are compiled as ignored, so a
//! machine without a GPU reports them as `ignored`, not as passed.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(deltaref_gpu_tests)");
    println!("cargo::rerun-if-env-changed=DELTAREF_GPU_TESTS");
    if std::env::var("DELTAREF_GPU_TESTS").is_ok_and(|v| v == "1") {
        println!("cargo::rustc-cfg=deltaref_gpu_tests");
    }
}
