//! The file of a cell's result: `cells/<id>.json.gz`, its JSON compressed with gzip
//! (`zcat` reads it). With per-step traces, per-request token times and memory samples
//! a cell is 0.5–3 MB of JSON, which gzip makes about 7× smaller. Results directories
//! written before hold plain `cells/<id>.json`: both forms are read, and a cell
//! re-recorded over a plain file replaces it. Two files for one cell (`<id>.json` and
//! `<id>.json.gz`) are an error naming both, never a silent choice between them.

use anyhow::{Context, Result};
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use flate2::{Compression, GzBuilder};
use serde_json::Value;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Suffix of the cell files written now.
pub const GZ: &str = ".json.gz";
/// Suffix of the cell files written before compression (still read).
pub const PLAIN: &str = ".json";

/// The file a cell's result is written to.
pub fn path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}{GZ}"))
}

/// The name of a cell file without its suffix (the cell's identity for files written
/// since cells have one), or None when `path` is not a cell file.
fn stem(path: &Path) -> Option<&str> {
    let name = path.file_name()?.to_str()?;
    name.strip_suffix(GZ).or_else(|| name.strip_suffix(PLAIN))
}

/// Refuse a cell held twice: which of the two files is the result is not ours to guess.
fn both(plain: &Path, gz: &Path) -> anyhow::Error {
    anyhow::anyhow!(
        "{} and {} hold the same cell, one as plain and one as gzip-compressed JSON; \
         remove the one that is not its result",
        plain.display(),
        gz.display()
    )
}

/// The file recorded for cell `id` in `dir`, in either form; None when there is none.
pub fn find(dir: &Path, id: &str) -> Result<Option<PathBuf>> {
    let gz = path(dir, id);
    let plain = dir.join(format!("{id}{PLAIN}"));
    match (gz.is_file(), plain.is_file()) {
        (true, true) => Err(both(&plain, &gz)),
        (true, false) => Ok(Some(gz)),
        (false, true) => Ok(Some(plain)),
        (false, false) => Ok(None),
    }
}

/// The cell files of `dir` in either form, sorted by name; two files for one cell are
/// an error.
pub fn list(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| stem(p).is_some() && p.is_file())
        .collect();
    files.sort();
    let mut seen: std::collections::HashMap<&str, &Path> = Default::default();
    for f in &files {
        let Some(s) = stem(f) else { continue };
        if let Some(other) = seen.insert(s, f) {
            let (plain, gz) = if is_gz(f) {
                (other, &**f)
            } else {
                (&**f, other)
            };
            return Err(both(plain, gz));
        }
    }
    Ok(files)
}

fn is_gz(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(GZ))
}

/// `json` compressed with a fixed header (no time stamp, no file name), so the same
/// result always gives the same bytes.
pub fn encode(json: &str) -> Result<Vec<u8>> {
    let mut gz: GzEncoder<Vec<u8>> = GzBuilder::new().write(Vec::new(), Compression::default());
    gz.write_all(json.as_bytes())
        .context("compressing a cell's result")?;
    gz.finish().context("compressing a cell's result")
}

/// Record cell `id`'s result `json` in `dir` as `<id>.json.gz`, atomically, and remove a
/// plain `<id>.json` it replaces (a re-run cell of an older directory), so the cell is
/// never held twice. Returns the file written.
pub fn write(dir: &Path, id: &str, json: &str) -> Result<PathBuf> {
    let to = path(dir, id);
    crate::run::write_atomic(&to, &encode(json)?)?;
    let plain = dir.join(format!("{id}{PLAIN}"));
    if plain.is_file() {
        std::fs::remove_file(&plain).with_context(|| {
            format!("removing {}, replaced by {}", plain.display(), to.display())
        })?;
    }
    Ok(to)
}

/// The JSON in a cell file of either form; the error says what is wrong but not which
/// file (see [`read`]).
pub fn decode(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).context("cannot be read")?;
    let text = if is_gz(path) {
        let mut out = Vec::with_capacity(bytes.len() * 8);
        GzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .context("not a complete gzip stream")?;
        out
    } else {
        bytes
    };
    serde_json::from_slice(&text).context("not JSON")
}

/// The JSON in a cell file of either form; the error names the file.
pub fn read(path: &Path) -> Result<Value> {
    decode(path).with_context(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cell_written_reads_back_compressed_and_identical_on_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let v = serde_json::json!({"id": "abc", "cell": {"index": 0}, "steps": vec![1.5; 500]});
        let json = v.to_string();
        let f = write(dir.path(), "abc", &json).unwrap();
        assert_eq!(f, dir.path().join("abc.json.gz"));
        let bytes = std::fs::read(&f).unwrap();
        assert_eq!(&bytes[..2], [0x1f, 0x8b], "gzip magic");
        assert_eq!(&bytes[4..8], [0; 4], "no time stamp");
        assert_eq!(bytes[3] & 0x08, 0, "no file name");
        assert!(
            bytes.len() < json.len() / 5,
            "{} of {}",
            bytes.len(),
            json.len()
        );
        assert_eq!(read(&f).unwrap(), v);
        write(dir.path(), "abc", &json).unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), bytes, "same result, same bytes");
        assert_eq!(find(dir.path(), "abc").unwrap(), Some(f.clone()));
        assert_eq!(list(dir.path()).unwrap(), [f]);
    }

    #[test]
    fn plain_files_are_read_and_replaced_and_two_for_one_cell_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("old.json"), r#"{"id": "old"}"#).unwrap();
        std::fs::write(d.join("notes.txt"), "not a cell").unwrap();
        std::fs::write(d.join(".tmp-x"), "a killed write").unwrap();
        assert_eq!(find(d, "old").unwrap(), Some(d.join("old.json")));
        assert_eq!(read(&d.join("old.json")).unwrap()["id"], "old");
        assert_eq!(find(d, "new").unwrap(), None);
        write(d, "new", r#"{"id": "new"}"#).unwrap();
        assert_eq!(
            list(d).unwrap(),
            [d.join("new.json.gz"), d.join("old.json")]
        );

        // Both forms of one cell: named, by every way in.
        std::fs::write(d.join("new.json"), r#"{"id": "new"}"#).unwrap();
        for e in [find(d, "new").unwrap_err(), list(d).unwrap_err()] {
            let e = format!("{e:#}");
            assert!(
                e.contains(&d.join("new.json").display().to_string())
                    && e.contains(&d.join("new.json.gz").display().to_string()),
                "{e}"
            );
        }
        // Re-recording the cell replaces the plain file.
        std::fs::remove_file(d.join("new.json.gz")).unwrap();
        write(d, "new", r#"{"id": "new", "rerun": true}"#).unwrap();
        assert!(!d.join("new.json").exists());
        assert_eq!(read(&d.join("new.json.gz")).unwrap()["rerun"], true);
    }

    #[test]
    fn a_corrupt_or_truncated_gzip_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let whole = encode(r#"{"id": "x", "cell": {}}"#).unwrap();
        let cases: [(&str, Vec<u8>); 4] = [
            ("text.json.gz", b"{\"id\": \"x\"}".to_vec()),
            ("cut.json.gz", whole[..whole.len() - 6].to_vec()),
            ("flipped.json.gz", {
                let mut b = whole.clone();
                let n = b.len();
                b[n - 8] ^= 0xff; // the CRC of the content
                b
            }),
            ("notjson.json.gz", encode("{\"id\": ").unwrap()),
        ];
        for (name, bytes) in cases {
            let f = dir.path().join(name);
            std::fs::write(&f, bytes).unwrap();
            let e = format!("{:#}", read(&f).unwrap_err());
            assert!(e.contains(&f.display().to_string()), "{name}: {e}");
        }
    }
}
