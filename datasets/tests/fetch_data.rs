//! `scripts/fetch-data.py` (`just fetch-data`) offline: files whose sha256 is not the
//! pinned one are refused one by one and nothing wrong is installed; `--check` names a
//! missing data directory. Downloads are not exercised here (no network in tests).

use std::path::{Path, PathBuf};
use std::process::Output;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fetch_data(args: &[&str]) -> Output {
    std::process::Command::new("python3")
        .arg(repo().join("scripts/fetch-data.py"))
        .args(args)
        .env_remove("KVBENCH_DATASETS_DIR")
        .output()
        .expect("running python3 scripts/fetch-data.py (the data script needs Python 3)")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(files_under(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn an_offline_copy_with_wrong_files_is_refused_file_by_file() {
    // The fixtures have the full data's layout but not its bytes: every file present
    // is a sha256 mismatch, every other one is missing from the copy.
    let fixtures = repo().join("datasets/fixtures");
    let dest = tempfile::tempdir().unwrap();
    let o = fetch_data(&[
        "--from",
        fixtures.to_str().unwrap(),
        "--dest",
        dest.path().to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "copa/val.jsonl: from {}: sha256 ",
            fixtures.join("copa/val.jsonl").display()
        )) && err.contains(
            "expected fa61467cc251010178ed72f8ca82a0fceefc4ca9a85f87ec3b6102955e1a1f1a; not installed"
        ),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "{} not found in the offline copy",
            fixtures.join("prose/war_and_peace_pg2600.txt").display()
        )),
        "{err}"
    );
    assert!(err.contains("18 of 18 files not installed"), "{err}");
    assert_eq!(files_under(dest.path()), Vec::<PathBuf>::new());
}

#[test]
fn check_fails_on_a_missing_or_wrong_data_directory() {
    let missing = tempfile::tempdir().unwrap().path().join("data");
    let o = fetch_data(&["--check", "--dest", missing.to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("{} does not exist", missing.display()))
            && err.contains("just fetch-data"),
        "{err}"
    );
    let fixtures = repo().join("datasets/fixtures");
    let o = fetch_data(&["--check", "--dest", fixtures.to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("boolq/val.jsonl: sha256 ")
            && err.contains("chat/mt_bench_question.jsonl: missing"),
        "{err}"
    );
}

#[test]
#[ignore = "needs the full evaluation data: just fetch-data, or KVBENCH_DATASETS_DIR"]
fn full_data_an_offline_copy_installs_checks_and_is_kept() {
    let data = kvbench_datasets::tasks::default_data_dir(&repo());
    assert!(
        data.is_dir(),
        "{} not found: {}",
        data.display(),
        kvbench_datasets::FETCH_HINT
    );
    let dest = tempfile::tempdir().unwrap();
    let args = [
        "--from",
        data.to_str().unwrap(),
        "--dest",
        dest.path().to_str().unwrap(),
    ];
    let o = fetch_data(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(files_under(dest.path()).len(), 18);
    let o = fetch_data(&["--check", "--dest", dest.path().to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A second run keeps every file.
    let o = fetch_data(&args);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches("present, sha256 ok").count(), 18, "{err}");
}
