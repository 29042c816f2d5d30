//! The multiple-choice loaders against the committed fixtures (the first 40 records of
//! each split, `datasets/fixtures/`): contexts and continuations as lm-eval's task
//! definitions build them (the expected strings were produced by a separate Python
//! transcription of lm-eval's `utils.py`/YAML templates), labels, limits, and malformed
//! or missing files rejected with their file (and line). Properties of the whole splits
//! are checked by `tests/full_data.rs`.

use kvbench_datasets::tasks::{Item, Task};
use kvbench_datasets::Error;
use std::path::{Path, PathBuf};

/// Records in each task's fixture (the first lines of the split).
const FIXTURE_ITEMS: usize = 40;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn load(task: Task, limit: Option<usize>) -> Vec<Item> {
    task.load(&data_dir(), limit)
        .unwrap_or_else(|e| panic!("{task}: {e}"))
}

fn ctx(i: &Item) -> Vec<&str> {
    i.choices.iter().map(|p| p.context.as_str()).collect()
}

fn cont(i: &Item) -> Vec<&str> {
    i.choices.iter().map(|p| p.continuation.as_str()).collect()
}

#[test]
fn every_task_loads_its_fixture() {
    for (task, choices) in [
        (Task::Piqa, 2),
        (Task::Copa, 2),
        (Task::Winogrande, 2),
        (Task::Hellaswag, 4),
        (Task::Openbookqa, 4),
        (Task::Boolq, 2),
    ] {
        let items = load(task, None);
        assert_eq!(items.len(), FIXTURE_ITEMS, "{task}");
        assert!(items
            .iter()
            .all(|i| i.choices.len() == choices && i.gold < choices));
        assert!(items.iter().enumerate().all(|(k, i)| i.index == k));
        assert_eq!(
            items.iter().any(|i| i.norm_chars.is_some()),
            task.has_acc_norm()
        );
        // Both labels occur (a constant gold would hide a parsing slip).
        assert!(items.iter().any(|i| i.gold == 0) && items.iter().any(|i| i.gold == 1));
    }
    assert_eq!(load(Task::Hellaswag, Some(7)).len(), 7);
}

#[test]
fn winogrande_answers_agree_with_the_official_labels() {
    // The JSONL comes from another release than dev-labels.lst: its `answer` must give
    // the same gold for every item.
    let labels = std::fs::read_to_string(data_dir().join("winogrande/dev-labels.lst")).unwrap();
    let items = load(Task::Winogrande, None);
    let golds: Vec<String> = items.iter().map(|i| (i.gold + 1).to_string()).collect();
    assert_eq!(golds, labels.lines().collect::<Vec<_>>());
}

#[test]
fn piqa_and_boolq_prompts() {
    let i = &load(Task::Piqa, Some(1))[0];
    assert_eq!(
        ctx(i),
        vec!["Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"; 2]
    );
    assert!(cont(i)[0].starts_with(" Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips"));
    assert!(cont(i)[1].contains("ripped jeans material"));
    assert_eq!(i.gold, 0);
    // acc_norm divides by the choice without the delimiter.
    assert_eq!(
        i.norm_chars.as_ref().unwrap()[0],
        cont(i)[0].chars().count() - 1
    );

    let i = &load(Task::Boolq, Some(1))[0];
    assert!(ctx(i)[0].starts_with("Ethanol fuel -- All biomass goes through"));
    assert!(ctx(i)[0]
        .ends_with("\nQuestion: does ethanol take more energy make that produces?\nAnswer:"));
    assert_eq!(cont(i), vec![" no", " yes"]);
    assert_eq!(i.gold, 0, "label \"false\" is ` no`");
}

#[test]
fn copa_has_the_connective_and_a_double_space() {
    let i = &load(Task::Copa, Some(1))[0];
    assert_eq!(ctx(i), vec!["The man turned on the faucet therefore"; 2]);
    assert_eq!(
        cont(i),
        vec![
            "  the toilet filled with water.",
            "  water flowed from the spout."
        ]
    );
    assert_eq!(i.gold, 1);
}

#[test]
fn winogrande_scores_one_continuation_under_two_contexts() {
    let i = &load(Task::Winogrande, Some(1))[0];
    assert_eq!(
        ctx(i),
        vec![
            "Sarah was a much better surgeon than Maria so Sarah",
            "Sarah was a much better surgeon than Maria so Maria"
        ]
    );
    assert_eq!(cont(i), vec![" always got the easier cases."; 2]);
    assert_eq!(i.gold, 1);
    assert!(i.norm_chars.is_none());
}

#[test]
fn hellaswag_is_preprocessed_and_capitalized() {
    // An ActivityNet row; the first WikiHow row (bracket tags) is item 3243, beyond the
    // fixture: tests/full_data.rs checks it, hellaswag.rs's unit test the tag rules.
    let i = &load(Task::Hellaswag, Some(1))[0];
    assert_eq!(
        ctx(i)[0],
        "Roof shingle removal: A man is sitting on a roof. He"
    );
    assert_eq!(
        cont(i),
        vec![
            " is using wrap to wrap a pair of skis.",
            " is ripping level tiles off.",
            " is holding a rubik's cube.",
            " starts pulling up roofing on a roof."
        ]
    );
    assert_eq!(i.gold, 3);
}

#[test]
fn openbookqa_uses_the_stem_and_the_answer_key() {
    let i = &load(Task::Openbookqa, Some(1))[0];
    assert!(ctx(i)[0].ends_with("they decide the best way to save money is to"));
    assert_eq!(
        cont(i),
        vec![
            " make more phone calls",
            " quit eating lunch out",
            " buy less with monopoly money",
            " have lunch with friends"
        ]
    );
    assert_eq!(i.gold, 1);
}

/// A copy of a task's files with line `bad_line` (1-based) of file `which` replaced.
fn broken(task: Task, which: usize, bad_line: usize, text: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    for (k, f) in task.files().iter().enumerate() {
        let src = std::fs::read_to_string(data_dir().join(f)).unwrap();
        let mut lines: Vec<String> = src.lines().take(5).map(String::from).collect();
        if k == which {
            lines[bad_line - 1] = text.to_string();
        }
        let dst = tmp.path().join(f);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::write(&dst, lines.join("\n") + "\n").unwrap();
    }
    let p = tmp.path().join(task.files()[which]);
    (tmp, p)
}

fn line_error(task: Task, dir: &Path) -> (PathBuf, usize, String) {
    match task.load(dir, None) {
        Err(Error::Line {
            path,
            line,
            message,
        }) => (path, line, message),
        other => panic!("{task}: expected a file:line error, got {other:?}"),
    }
}

#[test]
fn malformed_files_are_rejected_naming_the_file_and_line() {
    let cases: [(Task, usize, usize, &str, &str); 8] = [
        (Task::Piqa, 0, 3, "{\"goal\": \"x\"", "JSON"),
        (Task::Piqa, 1, 4, "2", "label 0 or 1"),
        (
            Task::Copa,
            0,
            2,
            r#"{"premise":"a.","choice1":"b","choice2":"c","question":"why","label":0}"#,
            "cause or effect",
        ),
        (
            Task::Winogrande,
            0,
            5,
            r#"{"sentence":"no blank","option1":"a","option2":"b","answer":"1"}"#,
            "blank",
        ),
        (
            Task::Hellaswag,
            0,
            2,
            r#"{"activity_label":"a","ctx_a":"b","ctx_b":"c","endings":["x","y"],"label":7}"#,
            "label",
        ),
        (
            Task::Openbookqa,
            0,
            3,
            r#"{"question":{"stem":"s","choices":[{"text":"t","label":"A"}]},"answerKey":"E"}"#,
            "answerKey",
        ),
        (
            Task::Boolq,
            0,
            4,
            r#"{"question":"q","passage":"p","label":"maybe"}"#,
            "\"true\" or \"false\"",
        ),
        (
            Task::Boolq,
            0,
            1,
            r#"{"question":"q","label":"true"}"#,
            "`passage`",
        ),
    ];
    for (task, which, line, text, what) in cases {
        let (tmp, file) = broken(task, which, line, text);
        let (path, got_line, message) = line_error(task, tmp.path());
        assert_eq!(path, file, "{task}");
        assert_eq!(got_line, line, "{task}: {message}");
        assert!(message.contains(what), "{task}: {message}");
        let shown = Error::Line {
            path,
            line,
            message,
        }
        .to_string();
        assert!(
            shown.starts_with(&format!("{}:{line}: ", file.display())),
            "{shown}"
        );
    }
    // Fewer PIQA labels than records, and a missing file, name the file.
    let (tmp, labels) = broken(Task::Piqa, 1, 1, "0");
    std::fs::write(&labels, "0\n1\n").unwrap();
    let e = Task::Piqa.load(tmp.path(), None).unwrap_err().to_string();
    assert!(
        e.contains(&labels.display().to_string()) && e.contains("2 labels for 5 records"),
        "{e}"
    );
    let e = Task::Copa
        .load(Path::new("/nonexistent"), None)
        .unwrap_err();
    assert!(matches!(e, Error::Missing { .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("/nonexistent/copa/val.jsonl not found") && e.contains("just fetch-data"),
        "{e}"
    );
}
