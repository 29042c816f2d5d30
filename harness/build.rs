//! With the `cuda` feature: candle-kernels links `-lcudart`. Point that at the
//! toolkit's static runtime (found beside `nvcc` on PATH) so the binary needs only the
//! driver where it runs. Without the feature this does nothing.

use std::path::PathBuf;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PATH");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let Some(nvcc) = find_on_path("nvcc") else {
        println!("cargo::warning=nvcc is not on PATH: libcudart is linked as found by the linker");
        return;
    };
    let lib = nvcc
        .parent()
        .and_then(|bin| bin.parent())
        .map(|root| root.join("lib").join("libcudart_static.a"));
    let Some(lib) = lib.filter(|l| l.exists()) else {
        println!(
            "cargo::warning=no libcudart_static.a beside {}",
            nvcc.display()
        );
        return;
    };
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let link = out.join("libcudart.a");
    let _ = std::fs::remove_file(&link);
    std::fs::copy(&lib, &link).expect("copy libcudart_static.a into OUT_DIR");
    println!("cargo::rustc-link-search=native={}", out.display());
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
