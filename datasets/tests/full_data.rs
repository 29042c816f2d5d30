//! Properties of the whole evaluation data (`just fetch-data` fills `data/`; or
//! `KVBENCH_DATASETS_DIR`), which the committed fixtures cannot show: split sizes, rows
//! beyond the fixtures, the Gutenberg header and footer, and that every fixture is a
//! verbatim slice of its full file. Ignored by default; `just test-full-data` runs them.
//! Without the data they fail, naming the missing file.

use kvbench_datasets::corpus::Corpus;
use kvbench_datasets::retention::load_conversations;
use kvbench_datasets::tasks::{default_data_dir, Item, Task};
use kvbench_datasets::FETCH_HINT;
use std::path::{Path, PathBuf};

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn data_dir() -> PathBuf {
    default_data_dir(&manifest().join(".."))
}

/// A file of the full data; a test that needs it fails without it.
fn full(rel: &str) -> PathBuf {
    let p = data_dir().join(rel);
    assert!(p.is_file(), "{} not found: {FETCH_HINT}", p.display());
    p
}

fn load(task: Task) -> Vec<Item> {
    for f in task.files() {
        full(f);
    }
    task.load(&data_dir(), None)
        .unwrap_or_else(|e| panic!("{task}: {e}"))
}

#[test]
#[ignore = "needs the full evaluation data: just fetch-data, or KVBENCH_DATASETS_DIR"]
fn full_data_every_task_loads_its_whole_split() {
    for (task, n, choices) in [
        (Task::Piqa, 1838, 2),
        (Task::Copa, 100, 2),
        (Task::Winogrande, 1267, 2),
        (Task::Hellaswag, 10042, 4),
        (Task::Openbookqa, 500, 4),
        (Task::Boolq, 3270, 2),
    ] {
        let items = load(task);
        assert_eq!(items.len(), n, "{task}");
        assert!(items
            .iter()
            .all(|i| i.choices.len() == choices && i.gold < choices));
        assert!(items.iter().enumerate().all(|(k, i)| i.index == k));
        assert!(items.iter().any(|i| i.gold == 0) && items.iter().any(|i| i.gold == 1));
    }
}

#[test]
#[ignore = "needs the full evaluation data: just fetch-data, or KVBENCH_DATASETS_DIR"]
fn full_data_hellaswag_wikihow_rows_are_preprocessed() {
    // Item 3243 is the first WikiHow row: `[header]`/`[title]`/`[step]` tags, `ctx`
    // second in the record.
    let items = load(Task::Hellaswag);
    let i = &items[3243];
    assert_eq!(
        i.choices[0].context,
        "Personal Care and Style: How to become a fashion consultant. Obtain your high school \
         diploma or ged. This job requires a high school diploma or equivalent, so make sure to \
         apply yourself and finish school. If your high school offers these classes, take art, \
         design, and sewing to familiarize yourself with foundational concepts in fashion."
    );
    assert_eq!(
        i.choices[3].continuation,
        "  Earn a bachelor's degree in a fashion-related field. Degrees for the fashion industry \
         include art, fashion merchandising, and marketing."
    );
    assert!(i.choices[0].continuation.ends_with(
        "find a job in your field.. Search for entry-level positions in fashion industries."
    ));
    assert_eq!(i.gold, 3);
}

#[test]
#[ignore = "needs the full evaluation data: just fetch-data, or KVBENCH_DATASETS_DIR"]
fn full_data_winogrande_answers_agree_with_the_official_labels() {
    let labels = std::fs::read_to_string(full("winogrande/dev-labels.lst")).unwrap();
    let golds: Vec<String> = load(Task::Winogrande)
        .iter()
        .map(|i| (i.gold + 1).to_string())
        .collect();
    assert_eq!(golds.len(), 1267);
    assert_eq!(golds, labels.lines().collect::<Vec<_>>());
}

#[test]
#[ignore = "needs the full evaluation data: just fetch-data, or KVBENCH_DATASETS_DIR"]
fn full_data_the_chat_file_loads() {
    let c = load_conversations(&full("chat/hh-rlhf_harmless-base_test_messages.jsonl")).unwrap();
    assert_eq!(c.len(), 2304);
    assert!(c.iter().all(|c| c.messages.len() % 2 == 0));
    assert!(c.iter().filter(|c| c.messages.len() >= 4).count() >= 1600);
}

#[test]
#[ignore = "needs the full evaluation data: just fetch-data, or KVBENCH_DATASETS_DIR"]
fn full_data_books_are_cleaned() {
    let c = Corpus::from_file(&full("prose/war_and_peace_pg2600.txt")).unwrap();
    assert!(!c.text.contains("*** START OF") && !c.text.contains("*** END OF"));
    assert!(!c.text.contains('\r') && !c.text.starts_with('\u{feff}'));
    assert!(c.text.contains("Well, Prince, so Genoa and Lucca"));
    assert!(c.text.len() > 3_000_000, "{}", c.text.len());
    // BOM, CRLF and the older `***START OF` marker.
    let b = Corpus::from_file(&full("prose/oliver_twist_pg730.txt")).unwrap();
    assert!(!b.text.contains("START OF") && !b.text.contains('\r'));
    // Its transcriber's note (kept) names Project Gutenberg; the license text is cut.
    let p = Corpus::from_file(&full("prose/pride_and_prejudice_pg42671.txt")).unwrap();
    assert!(!p.text.contains("START OF THIS PROJECT") && !p.text.contains("Gutenberg-tm"));
    assert!(!p.text.starts_with('\u{feff}') && !p.text.contains('\r'));
}

/// Every data file under `dir` (the fixtures' README and licenses are not data).
fn fixture_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "LICENSES") {
                fixture_files(&p, out);
            }
        } else if p.file_name().is_some_and(|n| n != "README.md") {
            out.push(p);
        }
    }
}

#[test]
#[ignore = "needs the full evaluation data: just fetch-data, or KVBENCH_DATASETS_DIR"]
fn full_data_fixtures_are_slices_of_the_full_files() {
    let root = manifest().join("fixtures");
    let mut files = Vec::new();
    fixture_files(&root, &mut files);
    assert_eq!(files.len(), 11, "{files:?}");
    for f in files {
        let rel = f.strip_prefix(&root).unwrap().to_str().unwrap().to_string();
        let part = std::fs::read(&f).unwrap();
        let whole = std::fs::read(full(&rel)).unwrap();
        assert!(part.ends_with(b"\n"), "{rel}: whole lines");
        if rel.starts_with("prose/") {
            // A run of whole lines from inside the book.
            let at = whole
                .windows(part.len())
                .position(|w| w == part.as_slice())
                .unwrap_or_else(|| panic!("{rel} is not a slice of the full file"));
            assert!(at == 0 || whole[at - 1] == b'\n', "{rel}: starts mid-line");
        } else {
            // The first lines of the split, so that item indices are the split's.
            assert!(
                whole.starts_with(&part),
                "{rel} is not a prefix of the full file"
            );
        }
    }
}
