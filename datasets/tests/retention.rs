//! The retention test's data: facts, the correctness check, buckets, the chat file
//! loader, and the chat and passkey prompt builders (layout and lengths). Token counts
//! here come from a word counter over a ChatML rendering; the harness's tests check the
//! lengths again with the model's real tokenizer.

use kvbench_datasets::corpus::Corpus;
use kvbench_datasets::retention::{
    build_chat, build_passkey, facts, is_correct, load_conversations, passkey, Bucket, BuildSpec,
    Form, Message, Role, ACKNOWLEDGMENT, PASSKEY_INTRO, PASSKEY_QUESTION,
};
use kvbench_datasets::Error;
use std::collections::HashSet;
use std::path::PathBuf;

/// A file of the committed fixtures (`datasets/fixtures/`, the evaluation data's layout).
fn data(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(rel)
}

/// Words of the ChatML rendering, generation prompt included.
fn words(msgs: &[Message]) -> Result<usize, String> {
    let mut s = String::new();
    for m in msgs {
        s.push_str(&format!(
            "<|im_start|> {}\n{} <|im_end|>\n",
            m.role.as_str(),
            m.content
        ));
    }
    s.push_str("<|im_start|> assistant\n");
    Ok(s.split_whitespace().count())
}

fn spec(buckets: &[&str], turns: &[usize], items: usize) -> BuildSpec {
    BuildSpec {
        buckets: buckets.iter().map(|b| Bucket::parse(b).unwrap()).collect(),
        turns: turns.to_vec(),
        items,
        facts: 20,
        seed: 3,
    }
}

#[test]
fn facts_are_distinct_reproducible_and_answerable() {
    let f = facts(40, 7);
    assert_eq!(f.len(), 40);
    assert_eq!(f, facts(40, 7));
    assert_ne!(f, facts(40, 8));
    let statements: HashSet<_> = f.iter().map(|x| x.statement.as_str()).collect();
    assert_eq!(statements.len(), 40);
    let questions: HashSet<_> = f.iter().take(20).map(|x| x.question.as_str()).collect();
    assert!(questions.len() >= 12, "{questions:?}");
    for (i, x) in f.iter().enumerate() {
        assert_eq!(x.id, i);
        assert!(x.statement.contains(&x.answer), "{x:?}");
        assert!(!is_correct(&x.question, &x.answer), "{x:?}");
        assert!(is_correct(&x.statement, &x.answer), "{x:?}");
    }
    let k = passkey(4, 1);
    assert_eq!(k.answer.len(), 5);
    assert!(k.answer.chars().all(|c| c.is_ascii_digit()));
    assert_eq!(k, passkey(4, 1));
    assert_ne!(k.answer, passkey(5, 1).answer);
}

#[test]
fn correct_means_the_answer_is_in_the_response() {
    assert!(is_correct("The pass key is 48213.", "48213"));
    assert!(is_correct("48213", "48213"));
    assert!(!is_correct("The pass key is 482130.", "48213"));
    assert!(!is_correct("The pass key is 148213", "48213"));
    assert!(!is_correct("The pass key is 4821.", "48213"));
    assert!(is_correct("key: 148213, no: 48213!", "48213"));
    assert!(is_correct("Your cat is called BISCUIT.", "Biscuit"));
    assert!(!is_correct("Your cat is called Pepper.", "Biscuit"));
    assert!(is_correct("It is KL417", "kl417"));
    assert!(!is_correct("anything", ""));
}

#[test]
fn buckets_parse_and_label() {
    let b = Bucket::parse("1K-2K").unwrap();
    assert_eq!((b.lo, b.hi), (1024, 2048));
    assert_eq!(b.label(), "1K-2K");
    assert_eq!(Bucket::parse("8k-16k").unwrap().label(), "8K-16K");
    assert_eq!(Bucket::parse("1000-2000").unwrap().label(), "1000-2000");
    assert!(b.contains(1024) && b.contains(2047) && !b.contains(2048) && !b.contains(1023));
    for bad in ["2K-1K", "1K", "x-2K", "0-5", "1K-1K"] {
        let e = Bucket::parse(bad).unwrap_err().to_string();
        assert!(e.contains(bad) && e.contains("1K-2K"), "{e}");
    }
    assert_eq!(Form::parse("passkey").unwrap(), Form::Passkey);
    assert!(Form::parse("Chat").is_err());
}

#[test]
fn a_malformed_chat_file_is_rejected_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"id": 1, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}"#;
    let cases = [
        ("not json {", "not JSON"),
        (r#"{"messages": []}"#, "`id`"),
        (r#"{"id": 2, "messages": "x"}"#, "`messages`"),
        (
            r#"{"id": 2, "messages": [{"role": "assistant", "content": "x"}]}"#,
            "expected \"user\"",
        ),
        (
            r#"{"id": 2, "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}"#,
            "alternate",
        ),
        (r#"{"id": 2, "messages": [{"role": "user"}]}"#, "`content`"),
        (
            r#"{"id": 2, "messages": [{"role": "bot", "content": "x"}]}"#,
            "\"bot\"",
        ),
    ];
    for (i, (bad, what)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("chat{i}.jsonl"));
        std::fs::write(&path, format!("{good}\n\n{bad}\n{good}\n")).unwrap();
        let e = load_conversations(&path).unwrap_err();
        match &e {
            Error::Line { path: p, line, .. } => {
                assert_eq!(p, &path);
                assert_eq!(*line, 3, "{e}");
            }
            other => panic!("expected a line error, got {other:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains(&format!("chat{i}.jsonl:3:")), "{msg}");
        assert!(msg.contains(what), "{msg} should say {what}");
    }
    let path = dir.path().join("ok.jsonl");
    std::fs::write(&path, format!("{good}\n")).unwrap();
    let c = load_conversations(&path).unwrap();
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].id, "1");
    assert_eq!(c[0].messages[1].role, Role::Assistant);
}

#[test]
fn the_chat_fixture_loads() {
    // The first 100 conversations of the chat file (ids are its line numbers, 0-based;
    // none of the first 100 was dropped when the file was built).
    let c = load_conversations(&data("chat/hh-rlhf_harmless-base_test_messages.jsonl")).unwrap();
    assert_eq!(c.len(), 100);
    assert!(c.iter().enumerate().all(|(i, c)| c.id == i.to_string()));
    assert!(c.iter().all(|c| c.messages.len() % 2 == 0));
    assert_eq!(c.iter().filter(|c| c.messages.len() >= 4).count(), 78);
    let e = load_conversations(&data("chat/missing.jsonl")).unwrap_err();
    assert!(matches!(e, Error::Missing { .. }), "{e:?}");
    assert!(e.to_string().contains("just fetch-data"), "{e}");
}

#[test]
fn chat_prompts_state_the_fact_first_and_ask_at_exactly_the_requested_turns() {
    let convs =
        load_conversations(&data("chat/hh-rlhf_harmless-base_test_messages.jsonl")).unwrap();
    let turns = [2, 4, 6, 8, 10, 12];
    let s = spec(&["1K-2K", "2K-4K"], &turns, 3);
    let prompts = build_chat(&convs, &s, &words).unwrap();
    assert_eq!(prompts.len(), 2 * 3 * turns.len());
    let mut per_bucket_turns: Vec<(String, usize)> = Vec::new();
    for p in &prompts {
        assert_eq!(p.form, Form::Chat);
        let m = &p.messages;
        // Turns 1..t−1 are a user and an assistant message each; turn t is the question.
        assert_eq!(m.len(), 2 * p.turn - 1, "turn {}", p.turn);
        for (i, msg) in m.iter().enumerate() {
            let want = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            assert_eq!(msg.role, want);
            assert!(!msg.content.trim().is_empty(), "message {i} is empty");
        }
        let first_user = &m[0].content;
        assert!(first_user.starts_with(&p.fact.statement), "{first_user}");
        let conv = convs.iter().find(|c| c.id == p.conversation_id).unwrap();
        let after_fact = first_user[p.fact.statement.len()..].trim_start();
        assert!(after_fact.starts_with(&conv.messages[0].content));
        assert!(m[1].content.starts_with(ACKNOWLEDGMENT));
        assert!(m[1].content[ACKNOWLEDGMENT.len()..]
            .trim_start()
            .starts_with(&conv.messages[1].content));
        // The statement appears once, at the start; the question once, at the end.
        let all: Vec<&str> = m.iter().map(|x| x.content.as_str()).collect();
        assert_eq!(all.join("\n").matches(&p.fact.statement).count(), 1);
        assert_eq!(m.last().unwrap().content, p.fact.question);
        assert_eq!(
            all[..all.len() - 1]
                .join("\n")
                .matches(&p.fact.question)
                .count(),
            0
        );
        // In the bucket, as measured.
        assert_eq!(words(m).unwrap(), p.context_tokens);
        assert!(
            p.bucket.contains(p.context_tokens),
            "{} tokens in {}",
            p.context_tokens,
            p.bucket.label()
        );
        per_bucket_turns.push((p.bucket.label(), p.turn));
    }
    for b in ["1K-2K", "2K-4K"] {
        for t in turns {
            let n = per_bucket_turns
                .iter()
                .filter(|x| x.0 == b && x.1 == t)
                .count();
            assert_eq!(n, 3, "bucket {b} turn {t}");
        }
    }
    // Within a conversation a later question sees a longer context (the targets are
    // spread over the bucket by turn) and the earlier prompt's filler is a prefix of
    // the later one's material.
    let conv0: Vec<_> = prompts
        .iter()
        .filter(|p| {
            p.conversation_id == prompts[0].conversation_id && p.bucket == prompts[0].bucket
        })
        .collect();
    assert_eq!(conv0.len(), turns.len());
    for w in conv0.windows(2) {
        assert!(w[0].turn < w[1].turn);
        assert!(w[0].context_tokens < w[1].context_tokens);
    }
    // Conversations and facts differ across items; the build is reproducible.
    let ids: HashSet<_> = prompts.iter().map(|p| &p.conversation_id).collect();
    assert_eq!(ids.len(), 6);
    let fact_ids: HashSet<_> = prompts.iter().map(|p| p.fact.id).collect();
    assert_eq!(fact_ids.len(), 6);
    let again = build_chat(&convs, &s, &words).unwrap();
    assert!(prompts
        .iter()
        .zip(&again)
        .all(|(a, b)| a.messages == b.messages && a.context_tokens == b.context_tokens));
}

#[test]
fn filler_turns_are_real_exchanges_user_and_reply_aligned() {
    let convs =
        load_conversations(&data("chat/hh-rlhf_harmless-base_test_messages.jsonl")).unwrap();
    let pairs: Vec<(&str, &str)> = convs.iter().flat_map(|c| c.exchanges()).collect();
    let s = spec(&["1K-2K"], &[4, 12], 2);
    for p in build_chat(&convs, &s, &words).unwrap() {
        // Every filler turn (2..t−1) starts with a real user message, and its
        // assistant message with that message's real reply.
        for k in 1..p.turn - 1 {
            let (u, a) = (&p.messages[2 * k].content, &p.messages[2 * k + 1].content);
            assert!(
                pairs
                    .iter()
                    .any(|(pu, pa)| u.starts_with(pu) && a.starts_with(pa)),
                "turn {} of {}: {u:.80} / {a:.80}",
                k + 1,
                p.turn
            );
        }
    }
}

#[test]
fn passkey_prompts_put_the_key_first_and_the_question_last() {
    let prose = Corpus::from_file(&data("prose/pride_and_prejudice_pg42671.txt")).unwrap();
    let s = spec(&["1K-2K", "2K-4K"], &[1], 4);
    let prompts = build_passkey(&prose.text, &s, &words).unwrap();
    assert_eq!(prompts.len(), 8);
    let mut keys = HashSet::new();
    for p in &prompts {
        assert_eq!(p.form, Form::Passkey);
        assert_eq!(p.turn, 1);
        assert_eq!(p.messages.len(), 1);
        let text = &p.messages[0].content;
        assert_eq!(p.messages[0].role, Role::User);
        assert!(text.starts_with(PASSKEY_INTRO));
        let key_at = text.find(&p.fact.answer).unwrap();
        assert!(key_at < PASSKEY_INTRO.len() + 40, "key at {key_at}");
        assert_eq!(
            text.matches(&p.fact.answer).count(),
            2,
            "stated twice, once"
        );
        assert!(text.ends_with(&format!("\n\n{PASSKEY_QUESTION}")));
        assert_eq!(words(&p.messages).unwrap(), p.context_tokens);
        assert!(p.bucket.contains(p.context_tokens), "{}", p.context_tokens);
        // Filler is most of the prompt.
        assert!(text.len() > 4 * p.bucket.lo);
        keys.insert(p.fact.answer.clone());
    }
    assert_eq!(keys.len(), 8);
}

#[test]
fn bad_specs_are_rejected_with_what_was_expected() {
    let convs =
        load_conversations(&data("chat/hh-rlhf_harmless-base_test_messages.jsonl")).unwrap();
    let e = build_chat(&convs, &spec(&["1K-2K"], &[1, 2], 1), &words)
        .unwrap_err()
        .to_string();
    assert!(e.contains("turns ≥ 2"), "{e}");
    let e = build_passkey("Some prose.\n\nMore.", &spec(&["1K-2K"], &[2], 1), &words)
        .unwrap_err()
        .to_string();
    assert!(e.contains("turns must be [1]"), "{e}");
    // Not enough prose for the bucket.
    let e = build_passkey("Some prose.\n\nMore.", &spec(&["1K-2K"], &[1], 1), &words)
        .unwrap_err()
        .to_string();
    assert!(e.contains("could not fit") && e.contains("1K-2K"), "{e}");
}
