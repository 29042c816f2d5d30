//! The documentation's examples are checked against the code: every YAML block of
//! README.md and docs/*.md is an experiment kvbench accepts (fragments completed with
//! a minimal experiment), every `just RECIPE` names a recipe of the justfile, and every
//! `kvbench SUBCOMMAND --flag` names a subcommand and a flag it takes.

use crate::experiment::Plan;
use crate::Cli;
use clap::CommandFactory;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the harness crate lives in the workspace")
        .to_path_buf()
}

/// README.md and every page under docs/, with their text.
fn pages() -> Vec<(PathBuf, String)> {
    let root = repo();
    let mut paths = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("readable docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    assert!(docs.len() >= 5, "docs/ pages missing: {docs:?}");
    paths.extend(docs);
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("readable page");
            (p, text)
        })
        .collect()
}

/// Fenced blocks as (info string, first line number, body).
fn fences(text: &str) -> Vec<(String, usize, String)> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            match open.take() {
                Some(block) => out.push(block),
                None => open = Some((info.trim().to_string(), i + 2, String::new())),
            }
        } else if let Some((_, _, body)) = open.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    assert!(open.is_none(), "an unclosed code fence");
    out
}

/// Inline code spans (`...`) outside fenced blocks, with the line each starts on; a
/// span broken over two lines is joined with a space.
fn inline_spans(text: &str) -> Vec<(usize, String)> {
    let mut prose = String::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        } else if !in_fence {
            prose.push_str(line);
        }
        // Fenced lines leave an empty line so line numbers stay right.
        prose.push('\n');
    }
    let mut out = Vec::new();
    let mut line = 1;
    let parts: Vec<&str> = prose.split('`').collect();
    for (k, part) in parts.iter().enumerate() {
        if k % 2 == 1 && k + 1 < parts.len() {
            out.push((line, part.replace('\n', " ")));
        }
        line += part.matches('\n').count();
    }
    out
}

/// A relative path in the docs is relative to the repository root.
fn absolutize(v: Option<&mut serde_yaml::Value>) {
    let Some(v) = v else { return };
    let Some(rel) = v.as_str().filter(|p| Path::new(p).is_relative()) else {
        return;
    };
    *v = repo().join(rel).to_string_lossy().into_owned().into();
}

/// A placeholder in capitals (`just RECIPE`, `kvbench SUBCOMMAND`), not a name.
fn is_placeholder(w: &str) -> bool {
    w.chars().all(|c| c.is_ascii_uppercase() || c == '_')
}

/// `--name` or `--name=value` → `name`.
fn flag_name(w: &str) -> &str {
    let name = w.trim_start_matches("--");
    name.split('=').next().unwrap_or(name)
}

/// The long flags a clap command takes.
fn long_flags(c: &clap::Command) -> impl Iterator<Item = String> + '_ {
    c.get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
}

/// Complete a fragment with what every experiment needs, make the workload source an
/// absolute path (docs name paths from the repository root) and check it the way
/// `kvbench run --dry-run` does, expansion into cells included.
fn check_yaml(page: &Path, line: usize, body: &str) {
    let at = format!("{}:{line}", page.display());
    let mut v: serde_yaml::Value =
        serde_yaml::from_str(body).unwrap_or_else(|e| panic!("{at}: not YAML: {e}"));
    let map = v
        .as_mapping_mut()
        .unwrap_or_else(|| panic!("{at}: an experiment is a mapping"));
    let defaults = [
        ("name", "docs-example"),
        ("model", "preset:tiny"),
        ("engines", "[{name: full}]"),
    ];
    for (k, d) in defaults {
        if !map.contains_key(k) {
            map.insert(k.into(), serde_yaml::from_str(d).expect("default"));
        }
    }
    // A fragment of a performance experiment (no `kind`) needs a grid and a workload.
    if !map.contains_key("kind") {
        for (k, d) in [
            ("matrix", "{batch: [1], prompt_len: [8], output_len: [2]}"),
            ("workload", "{num_requests: 1}"),
        ] {
            if !map.contains_key(k) {
                map.insert(k.into(), serde_yaml::from_str(d).expect("default"));
            }
        }
    }
    let workload_source = map.get_mut("workload").and_then(|w| w.get_mut("source"));
    absolutize(workload_source);
    absolutize(map.get_mut("data_dir"));
    let text = serde_yaml::to_string(&v).expect("serializable");
    let models = tempfile::tempdir().expect("temporary directory");
    let plan = Plan::parse(&text, Path::new("docs-example.yaml"), models.path())
        .unwrap_or_else(|e| panic!("{at}: kvbench rejects this example: {e:#}\n{text}"));
    assert!(!plan.cells.is_empty(), "{at}: no cells");
}

#[test]
fn every_yaml_example_is_an_experiment_kvbench_accepts() {
    let mut n = 0;
    for (page, text) in pages() {
        for (info, line, body) in fences(&text) {
            if info == "yaml" {
                check_yaml(&page, line, &body);
                n += 1;
            }
        }
    }
    assert!(n >= 3, "only {n} YAML examples found");
}

/// Recipe names of the justfile.
fn recipes() -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("justfile")).expect("justfile");
    text.lines()
        .filter(|l| !l.starts_with([' ', '\t', '#', '@']) && !l.starts_with("set "))
        .filter_map(|l| l.split_once(':').map(|(head, _)| head))
        .filter_map(|head| head.split_whitespace().next())
        .filter(|name| !name.contains('='))
        .map(str::to_string)
        .collect()
}

/// The words of a command line, brackets and trailing punctuation of prose removed.
fn words(cmd: &str) -> Vec<String> {
    cmd.split_whitespace()
        .map(|w| w.trim_matches(|c| "[]()`,;".contains(c)).to_string())
        .filter(|w| !w.is_empty())
        .collect()
}

/// Every command example of the pages: a fenced shell line or an inline span that
/// starts with `just` or `kvbench` (after an optional `$` or environment assignments).
fn commands() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (page, text) in pages() {
        let mut push = |line: usize, cmd: &str| {
            let cmd = cmd.trim().trim_start_matches("$ ");
            let mut ws = words(cmd);
            while ws
                .first()
                .is_some_and(|w| w.contains('=') && !w.starts_with('-'))
            {
                ws.remove(0);
            }
            if ws
                .first()
                .is_some_and(|w| w == "just" || w == "kvbench" || w.ends_with("/kvbench"))
            {
                out.push((format!("{}:{line}", page.display()), ws.join(" ")));
            }
        };
        for (info, first, body) in fences(&text) {
            if ["sh", "bash", "console", ""].contains(&info.as_str()) {
                for (k, l) in body.lines().enumerate() {
                    // A comment after the command is prose.
                    push(first + k, l.split(" #").next().unwrap_or(l));
                }
            }
        }
        for (line, span) in inline_spans(&text) {
            push(line, &span);
        }
    }
    out
}

#[test]
fn every_just_recipe_named_in_the_docs_exists() {
    let recipes = recipes();
    assert!(recipes.iter().any(|r| r == "test"), "{recipes:?}");
    let mut n = 0;
    for (at, cmd) in commands() {
        let ws = words(&cmd);
        if ws[0] != "just" {
            continue;
        }
        let Some(name) = ws.get(1).filter(|w| !w.starts_with('-')) else {
            continue;
        };
        if is_placeholder(name) {
            continue;
        }
        assert!(
            recipes.contains(name),
            "{at}: `{cmd}` names no recipe of the justfile (it has {recipes:?})"
        );
        n += 1;
    }
    assert!(n >= 10, "only {n} just commands found");
}

#[test]
fn every_kvbench_flag_named_in_the_docs_exists() {
    let cli = Cli::command();
    let globals: Vec<String> = long_flags(&cli)
        .chain(["help".to_string(), "version".to_string()])
        .collect();
    let mut n = 0;
    for (at, cmd) in commands() {
        let ws = words(&cmd);
        if !(ws[0] == "kvbench" || ws[0].ends_with("/kvbench")) {
            continue;
        }
        let mut rest = ws[1..].iter().peekable();
        // Global flags may come before the subcommand (`kvbench --threads 1 run`).
        while rest.peek().is_some_and(|w| w.starts_with("--")) {
            let flag = rest.next().expect("peeked");
            let name = flag_name(flag);
            assert!(
                globals.iter().any(|g| g == name),
                "{at}: `{cmd}`: no global --{name}"
            );
            if !flag.contains('=') {
                rest.next();
            }
        }
        let Some(sub) = rest.next() else { continue };
        if is_placeholder(sub) {
            continue;
        }
        let Some(sc) = cli.find_subcommand(sub) else {
            panic!("{at}: `{cmd}`: kvbench has no subcommand `{sub}`");
        };
        let flags: Vec<String> = long_flags(sc).chain(globals.iter().cloned()).collect();
        for w in rest.filter(|w| w.starts_with("--")) {
            let name = flag_name(w);
            assert!(
                flags.iter().any(|f| f == name),
                "{at}: `{cmd}`: `kvbench {sub}` has no flag --{name} (it has {flags:?})"
            );
            n += 1;
        }
    }
    assert!(n >= 10, "only {n} kvbench flags found");
}

#[test]
fn a_wrong_flag_or_recipe_would_be_caught() {
    // The checks above must be able to fail: a made-up flag is not among clap's.
    let cli = Cli::command();
    let run = cli.find_subcommand("run").expect("run exists");
    assert!(long_flags(run).any(|f| f == "dry-run"));
    assert!(!long_flags(run).any(|f| f == "dry-runs"));
    assert!(!recipes().iter().any(|r| r == "no-such-recipe"));
    let bad = "name: x\nmodel: preset:tiny\nengines: [{name: full}]\nmatrix: {batch: [1], prompt_len: [8], output_len: [2]}\nbogus_key: 1\n";
    let models = tempfile::tempdir().expect("temporary directory");
    assert!(Plan::parse(bad, Path::new("x.yaml"), models.path()).is_err());
}

/// Every registered strategy has a row of docs/strategies.md's table naming each of its
/// parameters, and a fixed colour of its own in the figures.
#[test]
fn every_registered_strategy_is_documented_and_coloured() {
    use kvbench_engines::policy::registry::registry;
    let page = std::fs::read_to_string(repo().join("docs/strategies.md")).expect("readable");
    let mut colours = Vec::new();
    for s in registry() {
        let row = page
            .lines()
            .find(|l| l.starts_with(&format!("| `{}` |", s.name)))
            .unwrap_or_else(|| panic!("docs/strategies.md: no table row for `{}`", s.name));
        for p in s.params {
            assert!(
                row.contains(&format!("`{}`", p.key)),
                "docs/strategies.md: `{}`'s row does not name `{}`",
                s.name,
                p.key
            );
        }
        let fixed = kvbench_plots::ENGINE_COLOURS
            .iter()
            .find(|(e, _)| *e == s.name)
            .unwrap_or_else(|| panic!("plots: no fixed colour for `{}`", s.name));
        assert!(!colours.contains(&fixed.1), "`{}` shares a colour", s.name);
        colours.push(fixed.1);
    }
}
