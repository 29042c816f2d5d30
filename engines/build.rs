//! With the `cuda` feature: compile `src/cuda/kernels.cu` to PTX for sm_90 with `nvcc`
//! from PATH (see scripts/build-cuda.sh). Without the feature this does nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/cuda/kernels.cu");
    println!("cargo::rerun-if-env-changed=KVBENCH_CUDA_ARCH");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let arch = std::env::var("KVBENCH_CUDA_ARCH").unwrap_or_else(|_| "sm_90".into());
    let status = Command::new("nvcc")
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch={arch}"))
        .arg("src/cuda/kernels.cu")
        .arg("-o")
        .arg(out.join("kernels.ptx"))
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("nvcc failed ({s}) compiling src/cuda/kernels.cu"),
        Err(e) => panic!(
            "the `cuda` feature needs nvcc on PATH ({e}); scripts/build-cuda.sh installs one"
        ),
    }
}
