//! Two things at build time:
//! - `KVBENCH_BUILD_ID`: what the binary was built from (below), recorded with every
//!   cell so a sweep resumed by another build does not take that build's cells for its
//!   own.
//! - With the `cuda` feature: candle-kernels links `-lcudart`. Point that at the
//!   toolkit's static runtime (found beside `nvcc` on PATH) so the binary needs only the
//!   driver where it runs.

use std::path::{Path, PathBuf};

/// The workspace's code: every file under these (paths and bytes) and these manifests.
const SOURCE_DIRS: [&str; 4] = ["engines/src", "harness/src", "plots/src", "datasets/src"];
const MANIFESTS: [&str; 7] = [
    "Cargo.toml",
    "Cargo.lock",
    "engines/Cargo.toml",
    "engines/devices.yaml",
    "harness/Cargo.toml",
    "plots/Cargo.toml",
    "datasets/Cargo.toml",
];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PATH");
    build_id();
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

/// KVBENCH_BUILD_ID: 16 hex digits of xxh3 over the workspace's sources and manifests
/// (each file's path relative to the workspace and its bytes, in path order) and the
/// `cuda` feature. The same sources give the same identity on any machine, so the
/// shards of a sweep built separately still recognise each other's cells; any change
/// to the code gives another.
fn build_id() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = manifest
        .parent()
        .expect("the harness sits in the workspace")
        .to_path_buf();
    let mut files = Vec::new();
    for d in SOURCE_DIRS {
        let dir = root.join(d);
        println!("cargo::rerun-if-changed={}", dir.display());
        walk(&dir, &mut files);
    }
    for m in MANIFESTS {
        let f = root.join(m);
        println!("cargo::rerun-if-changed={}", f.display());
        if f.is_file() {
            files.push(f);
        }
    }
    files.sort();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap_or(f);
        h.update(rel.to_string_lossy().as_bytes());
        h.update(&[0]);
        match std::fs::read(f) {
            Ok(bytes) => {
                h.update(&(bytes.len() as u64).to_le_bytes());
                h.update(&bytes);
            }
            Err(e) => panic!("reading {} for the build identity: {e}", f.display()),
        }
    }
    h.update(if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        b"cuda"
    } else {
        b"cpu"
    });
    println!("cargo::rustc-env=KVBENCH_BUILD_ID={:016x}", h.digest());
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else if p.is_file() {
            out.push(p);
        }
    }
}
