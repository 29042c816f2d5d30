//! The retention test: a verifiable fact stated at the start of a conversation, asked
//! back later, in context-length buckets.
//!
//! Two forms:
//! - **chat** (the study's): multi-turn conversations. Turn 1's user message is the fact
//!   followed by a real conversation's first user message; the assistant acknowledges
//!   (`ACKNOWLEDGMENT`, then that conversation's real first reply). Turns 2 … t−1 are
//!   filler; at turn t the user asks the retention question. One prompt per
//!   (conversation, question turn t).
//! - **passkey**: one user message with a 5-digit key first, prose filler, and the
//!   question last (turn 1). Small models that cannot recall a fact across chat turns
//!   still do this.
//!
//! How the filler is laid out (chat form). Each prompt has a target length in its
//! bucket `[lo, hi)`: the question turns, sorted, are spread evenly over the bucket
//! (the i-th of n targets `lo + (hi − lo)(2i + 1)/(2n)`), so a later turn sees a longer
//! context, as in the study, and every prompt stays in its bucket. The filler is a
//! stream of real (user, assistant) exchanges: the conversation's own exchanges after
//! its first, then the exchanges of the next conversations (in a seeded order,
//! wrapping), skipping any exchange longer than a quarter of the bucket's width.
//! Exchanges are taken in stream order until the target is reached; the m taken are
//! split into t − 1 contiguous groups of ⌊m/(t−1)⌋ or ⌈m/(t−1)⌉ exchanges, and group k
//! becomes turn k + 1: its user parts joined by a blank line form the user message and
//! its assistant parts the assistant message (turn 1 keeps the fact and the
//! acknowledgment first). All turns of one conversation use the same stream, so the
//! prompt at turn t + 2 extends the material of the prompt at turn t. Lengths are
//! counted with the caller's [`Measure`] (the model's tokenizer over the rendered chat
//! template, generation prompt included), and the final length is measured exactly and
//! corrected by whole exchanges until it lies in the bucket.
//!
//! Passkey form: the same target spread over the items of a bucket; the filler is whole
//! paragraphs of a prose text from a seeded offset (wrapping).

use crate::{Error, Result};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// What the assistant says after the fact (before the conversation's real reply).
pub const ACKNOWLEDGMENT: &str = "Got it, I will remember that.";

/// Introduction of the passkey message (the format of the passkey-retrieval tests).
pub const PASSKEY_INTRO: &str = "There is a pass key hidden inside a lot of irrelevant text. \
Find it and memorize it. I will quiz you about the pass key.";

pub const PASSKEY_QUESTION: &str = "What is the pass key?";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: Role::User,
            content: content.into(),
        }
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            role: Role::Assistant,
            content: content.into(),
        }
    }
}

/// A real conversation: user and assistant messages alternating, user first.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub id: String,
    pub messages: Vec<Message>,
}

impl Conversation {
    /// (user, assistant) pairs in order.
    pub fn exchanges(&self) -> impl Iterator<Item = (&str, &str)> {
        self.messages
            .chunks_exact(2)
            .map(|p| (p[0].content.as_str(), p[1].content.as_str()))
    }
}

/// Read a chat messages file (`chat/hh-rlhf_harmless-base_test_messages.jsonl`): one
/// JSON object per line, `{"id", "messages": [{"role", "content"}, …]}`, roles
/// alternating user/assistant from user. Blank lines are skipped; anything else that
/// does not fit is an error naming the file and the line.
pub fn load_conversations(path: &Path) -> Result<Vec<Conversation>> {
    let bytes = crate::tasks::read_data_file(path)?;
    let text = String::from_utf8(bytes).map_err(|e| Error::Format {
        path: path.into(),
        message: format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ),
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |message: String| Error::Line {
            path: path.into(),
            line: i + 1,
            message,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| err(format!("not JSON: {e}")))?;
        let id = match v.get("id") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => return Err(err("expected an `id` (string or number)".into())),
        };
        let msgs = v
            .get("messages")
            .and_then(|m| m.as_array())
            .ok_or_else(|| err("expected `messages`, an array".into()))?;
        if msgs.is_empty() {
            return Err(err("`messages` is empty".into()));
        }
        let mut messages = Vec::with_capacity(msgs.len());
        for (j, m) in msgs.iter().enumerate() {
            let role = m.get("role").and_then(|r| r.as_str());
            let content = m.get("content").and_then(|c| c.as_str());
            let want = if j % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            let role = match role {
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                other => {
                    return Err(err(format!(
                        "message {j}: role {other:?}, expected \"user\" or \"assistant\""
                    )))
                }
            };
            if role != want {
                return Err(err(format!(
                    "message {j}: role \"{}\", expected \"{}\" (user and assistant alternate, user first)",
                    role.as_str(),
                    want.as_str()
                )));
            }
            let content =
                content.ok_or_else(|| err(format!("message {j}: expected `content`, a string")))?;
            messages.push(Message {
                role,
                content: content.trim().to_string(),
            });
        }
        out.push(Conversation { id, messages });
    }
    if out.is_empty() {
        return Err(Error::Format {
            path: path.into(),
            message: "no conversations".into(),
        });
    }
    Ok(out)
}

/// A verifiable fact: a statement, the question that asks it back and the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fact {
    pub id: usize,
    pub statement: String,
    pub question: String,
    pub answer: String,
}

#[derive(Clone, Copy)]
enum Slot {
    Digits(usize),
    Name,
    Colour,
    City,
    Fruit,
    Make,
    Flight,
}

/// (statement with `{}`, question, the value's kind).
const TEMPLATES: &[(&str, &str, Slot)] = &[
    (
        "My locker code is {}.",
        "What is my locker code?",
        Slot::Digits(4),
    ),
    (
        "The name of my cat is {}.",
        "What is the name of my cat?",
        Slot::Name,
    ),
    ("My dog's name is {}.", "What is my dog's name?", Slot::Name),
    (
        "My favourite colour is {}.",
        "What is my favourite colour?",
        Slot::Colour,
    ),
    ("I was born in {}.", "In which city was I born?", Slot::City),
    (
        "My employee number is {}.",
        "What is my employee number?",
        Slot::Digits(6),
    ),
    (
        "My best friend is called {}.",
        "What is my best friend called?",
        Slot::Name,
    ),
    (
        "My flight number is {}.",
        "What is my flight number?",
        Slot::Flight,
    ),
    (
        "My favourite fruit is {}.",
        "What is my favourite fruit?",
        Slot::Fruit,
    ),
    ("My car is a {}.", "What make is my car?", Slot::Make),
    (
        "My apartment number is {}.",
        "What is my apartment number?",
        Slot::Digits(3),
    ),
    (
        "My sister's name is {}.",
        "What is my sister's name?",
        Slot::Name,
    ),
    (
        "The PIN of my bank card is {}.",
        "What is the PIN of my bank card?",
        Slot::Digits(4),
    ),
    (
        "My grandmother lives in {}.",
        "In which city does my grandmother live?",
        Slot::City,
    ),
];

const NAMES: &[&str] = &[
    "Biscuit",
    "Barkley",
    "Pepper",
    "Marigold",
    "Oliver",
    "Juniper",
    "Clementine",
    "Rufus",
    "Waffles",
    "Theodora",
    "Mortimer",
    "Hazel",
    "Pickles",
    "Ignatius",
    "Beatrix",
    "Gulliver",
    "Matilda",
    "Percival",
    "Tallulah",
    "Bartholomew",
];
const COLOURS: &[&str] = &[
    "turquoise",
    "magenta",
    "olive",
    "lavender",
    "crimson",
    "teal",
    "amber",
    "indigo",
];
const CITIES: &[&str] = &[
    "Lisbon",
    "Winnipeg",
    "Nairobi",
    "Valparaiso",
    "Tbilisi",
    "Dundee",
    "Osaka",
    "Reykjavik",
    "Adelaide",
    "Krakow",
    "Montevideo",
    "Hanoi",
];
const FRUITS: &[&str] = &[
    "mango",
    "papaya",
    "apricot",
    "pomegranate",
    "kiwi",
    "lychee",
    "persimmon",
    "gooseberry",
];
const MAKES: &[&str] = &[
    "Volvo", "Subaru", "Peugeot", "Skoda", "Mazda", "Fiat", "Lancia", "Saab",
];

/// `n` distinct facts, the same for a seed. The first ones cycle through every kind of
/// statement (in a seeded order) before any kind repeats.
pub fn facts(n: usize, seed: u64) -> Vec<Fact> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed_fac7);
    let mut order: Vec<usize> = (0..TEMPLATES.len()).collect();
    order.shuffle(&mut rng);
    let mut out: Vec<Fact> = Vec::with_capacity(n);
    let mut i = 0usize;
    // Values are drawn until distinct; the value space is far larger than any n used,
    // and the bound keeps a huge n from looping.
    while out.len() < n && i < n.saturating_mul(100) + 1000 {
        let (statement, question, slot) = TEMPLATES[order[i % order.len()]];
        i += 1;
        let pick = |rng: &mut rand::rngs::StdRng, list: &[&str]| {
            list[rng.random_range(0..list.len())].to_string()
        };
        let answer = match slot {
            Slot::Digits(d) => {
                let lo = 10u64.pow(d as u32 - 1);
                rng.random_range(lo..lo * 10).to_string()
            }
            Slot::Name => pick(&mut rng, NAMES),
            Slot::Colour => pick(&mut rng, COLOURS),
            Slot::City => pick(&mut rng, CITIES),
            Slot::Fruit => pick(&mut rng, FRUITS),
            Slot::Make => pick(&mut rng, MAKES),
            Slot::Flight => {
                let a = (b'A' + rng.random_range(0..26u8)) as char;
                let b = (b'A' + rng.random_range(0..26u8)) as char;
                format!("{a}{b}{}", rng.random_range(100..1000))
            }
        };
        let statement = statement.replace("{}", &answer);
        if out.iter().any(|f| f.statement == statement) {
            continue;
        }
        out.push(Fact {
            id: out.len(),
            statement,
            question: question.to_string(),
            answer,
        });
    }
    out
}

/// The passkey fact of item `i`: a 5-digit key, the same for a seed.
pub fn passkey(i: usize, seed: u64) -> Fact {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
    let key = rng.random_range(10_000..100_000u32).to_string();
    Fact {
        id: i,
        statement: format!("The pass key is {key}. Remember it. {key} is the pass key."),
        question: PASSKEY_QUESTION.to_string(),
        answer: key,
    }
}

/// Whether a response gives the answer: case-insensitive containment; a numeric answer
/// must appear as a whole number (`4827` is not in `48271`).
pub fn is_correct(response: &str, answer: &str) -> bool {
    let (r, a) = (response.to_lowercase(), answer.trim().to_lowercase());
    if a.is_empty() {
        return false;
    }
    if !a.chars().all(|c| c.is_ascii_digit()) {
        return r.contains(&a);
    }
    let b = r.as_bytes();
    r.match_indices(&a).any(|(i, _)| {
        let before = i.checked_sub(1).map(|j| b[j].is_ascii_digit());
        let after = b.get(i + a.len()).map(u8::is_ascii_digit);
        before != Some(true) && after != Some(true)
    })
}

/// A context-length bucket `[lo, hi)` in tokens, `K` = 1024.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket {
    pub lo: usize,
    pub hi: usize,
}

impl Bucket {
    /// `1K-2K`, `1k-2k`, `1024-2048`.
    pub fn parse(s: &str) -> Result<Self> {
        let num = |p: &str| -> Option<usize> {
            let p = p.trim();
            match p.strip_suffix(['K', 'k']) {
                Some(n) => n.trim().parse::<usize>().ok().map(|n| n * 1024),
                None => p.parse().ok(),
            }
        };
        let parsed = s
            .split_once('-')
            .and_then(|(a, b)| Some((num(a)?, num(b)?)));
        match parsed {
            Some((lo, hi)) if 0 < lo && lo < hi => Ok(Bucket { lo, hi }),
            _ => Err(Error::Invalid(format!(
                "bucket `{s}`: expected LO-HI in tokens with LO < HI, such as 1K-2K or 1024-2048"
            ))),
        }
    }

    /// `1K-2K` (or `1000-2000` when not multiples of 1024).
    pub fn label(&self) -> String {
        let f = |n: usize| match n % 1024 {
            0 => format!("{}K", n / 1024),
            _ => n.to_string(),
        };
        format!("{}-{}", f(self.lo), f(self.hi))
    }

    pub fn contains(&self, n: usize) -> bool {
        self.lo <= n && n < self.hi
    }

    /// The i-th of n targets spread evenly over the bucket.
    fn target(&self, i: usize, n: usize) -> usize {
        self.lo + (self.hi - self.lo) * (2 * i + 1) / (2 * n.max(1))
    }

    /// Longest filler piece taken.
    fn max_piece(&self) -> usize {
        ((self.hi - self.lo) / 4).max(1)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Form {
    Chat,
    Passkey,
}

impl Form {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "chat" => Ok(Form::Chat),
            "passkey" => Ok(Form::Passkey),
            _ => Err(Error::Invalid(format!(
                "retention form `{s}`: expected chat or passkey"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Form::Chat => "chat",
            Form::Passkey => "passkey",
        }
    }
}

/// The question turns of the study.
pub const STUDY_TURNS: [usize; 6] = [2, 4, 6, 8, 10, 12];

/// What to build.
#[derive(Debug, Clone)]
pub struct BuildSpec {
    pub buckets: Vec<Bucket>,
    /// Question turns (chat: each ≥ 2; passkey: `[1]`).
    pub turns: Vec<usize>,
    /// Conversations (chat) or keys (passkey) per bucket.
    pub items: usize,
    /// Distinct facts cycled over the conversations (chat).
    pub facts: usize,
    pub seed: u64,
}

impl BuildSpec {
    fn check(&self, form: Form) -> Result<Vec<usize>> {
        if self.buckets.is_empty() || self.items == 0 {
            return Err(Error::Invalid(
                "retention needs at least one bucket and one item per bucket".into(),
            ));
        }
        let mut turns = self.turns.clone();
        turns.sort_unstable();
        turns.dedup();
        match form {
            Form::Chat if turns.is_empty() || turns[0] < 2 => Err(Error::Invalid(format!(
                "chat retention turns {:?}: expected turns ≥ 2 (turn 1 states the fact)",
                self.turns
            ))),
            Form::Chat if self.facts == 0 => {
                Err(Error::Invalid("chat retention needs at least one fact".into()))
            }
            Form::Passkey if turns != [1] => Err(Error::Invalid(format!(
                "passkey retention turns {:?}: the passkey form is one user message, turns must be [1]",
                self.turns
            ))),
            _ => Ok(turns),
        }
    }
}

/// One retention prompt: the conversation up to the question, and what it asks.
#[derive(Debug, Clone)]
pub struct RetentionPrompt {
    pub form: Form,
    pub bucket: Bucket,
    /// The turn at which the question is asked (its user message is the last one).
    pub turn: usize,
    pub fact: Fact,
    /// The real conversation turn 1 comes from (chat), or `prose:PARAGRAPH` (passkey).
    pub conversation_id: String,
    pub messages: Vec<Message>,
    /// Tokens of the rendered prompt, as the [`Measure`] counted them.
    pub context_tokens: usize,
}

/// Tokens of a conversation rendered with the model's chat template, generation
/// prompt included.
pub type Measure<'a> = dyn Fn(&[Message]) -> std::result::Result<usize, String> + 'a;

fn measure(m: &Measure, msgs: &[Message]) -> Result<usize> {
    m(msgs).map_err(Error::Tokenizer)
}

/// A piece of filler: its index in the source and its estimated tokens.
type Piece = (usize, usize);

/// The next candidate piece of a filler source, or `None` when it is exhausted.
type NextPiece<'a> = dyn FnMut() -> Result<Option<Piece>> + 'a;

/// Take pieces towards `target` and correct until `render(taken)` measures in
/// `bucket`. `base` is the measured length without filler, `min_pieces` the fewest
/// pieces the layout needs.
fn fill(
    next: &mut NextPiece,
    bucket: Bucket,
    target: usize,
    base: usize,
    min_pieces: usize,
    exact: &mut dyn FnMut(&[usize]) -> Result<usize>,
) -> Result<(Vec<usize>, usize)> {
    let mut taken: Vec<Piece> = Vec::new();
    let mut est = base;
    // Bounded so that a source without enough material ends in an error.
    let mut budget = 100_000usize;
    let mut take = |taken: &mut Vec<Piece>, est: usize, limit: usize| -> Result<bool> {
        while budget > 0 {
            budget -= 1;
            match next()? {
                None => return Ok(false),
                Some((i, cost)) if cost <= bucket.max_piece() && est + cost < limit => {
                    taken.push((i, cost));
                    return Ok(true);
                }
                Some(_) => {}
            }
        }
        Ok(false)
    };
    while est < target || taken.len() < min_pieces {
        if !take(&mut taken, est, bucket.hi)? {
            break;
        }
        est += taken.last().map_or(0, |t| t.1);
    }
    for _ in 0..64 {
        let ids: Vec<usize> = taken.iter().map(|t| t.0).collect();
        let n = exact(&ids)?;
        if bucket.contains(n) && taken.len() >= min_pieces {
            return Ok((ids, n));
        }
        if n >= bucket.hi && taken.len() > min_pieces {
            taken.pop();
        } else if n < bucket.lo || taken.len() < min_pieces {
            if !take(&mut taken, n, bucket.hi)? {
                break;
            }
        } else {
            break;
        }
    }
    Err(Error::Invalid(format!(
        "could not fit a prompt in bucket {} (target {target} tokens): the filler source ran out or its pieces do not fit",
        bucket.label()
    )))
}

/// Chat-form prompts: for each bucket, `items` conversations (a seeded order of those
/// given), each with fact `k mod facts`, one prompt per question turn. See the module
/// documentation for the layout.
pub fn build_chat(
    conversations: &[Conversation],
    spec: &BuildSpec,
    m: &Measure,
) -> Result<Vec<RetentionPrompt>> {
    let turns = spec.check(Form::Chat)?;
    let convs: Vec<&Conversation> = conversations
        .iter()
        .filter(|c| c.messages.len() >= 2)
        .collect();
    if convs.is_empty() {
        return Err(Error::Invalid(
            "no conversation has a user message and a reply".into(),
        ));
    }
    let facts = facts(spec.facts, spec.seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed);
    let mut order: Vec<usize> = (0..convs.len()).collect();
    order.shuffle(&mut rng);
    let empty = measure(m, &[])?;
    let pair_overhead = measure(m, &[Message::user(""), Message::assistant("")])? - empty;
    let exchange_cost = |u: &str, a: &str| -> Result<usize> {
        Ok(measure(m, &[Message::user(u), Message::assistant(a)])?
            .saturating_sub(empty + pair_overhead))
    };
    let mut out = Vec::new();
    let mut next_conv = 0usize;
    for (b_idx, bucket) in spec.buckets.iter().enumerate() {
        for item in 0..spec.items {
            // The item's conversation: the next in the seeded order whose first
            // exchange is short enough for the bucket.
            let start = loop {
                if next_conv >= order.len() * (spec.buckets.len() + 1) {
                    return Err(Error::Invalid(format!(
                        "no conversation left whose first exchange fits bucket {}",
                        bucket.label()
                    )));
                }
                let k = next_conv % order.len();
                next_conv += 1;
                let (u, a) = convs[order[k]]
                    .exchanges()
                    .next()
                    .expect("filtered: at least one exchange");
                if exchange_cost(u, a)? <= bucket.max_piece() {
                    break k;
                }
            };
            let conv = convs[order[start]];
            let fact = &facts[(b_idx * spec.items + item) % facts.len()];
            let (u1, a1) = conv.exchanges().next().expect("checked above");
            // The filler stream: (conversation position in `order`, exchange index),
            // its cost, read lazily and shared by every turn of this item.
            let mut stream: Vec<(usize, usize, usize)> = Vec::new();
            let mut cursor = (start, 1usize);
            for (t_idx, &turn) in turns.iter().enumerate() {
                let target = bucket.target(t_idx, turns.len());
                let groups = turn - 1;
                let layout = |ids: &[usize], stream: &[(usize, usize, usize)]| {
                    let pieces: Vec<(&str, &str)> = ids
                        .iter()
                        .map(|&i| {
                            let (k, e, _) = stream[i];
                            let c = convs[order[k]];
                            (
                                c.messages[2 * e].content.as_str(),
                                c.messages[2 * e + 1].content.as_str(),
                            )
                        })
                        .collect();
                    chat_layout(fact, u1, a1, &pieces, groups)
                };
                let base = measure(m, &layout(&[], &stream))?;
                let mut pos = 0usize;
                let stream_cell = std::cell::RefCell::new(&mut stream);
                let mut next = || -> Result<Option<Piece>> {
                    let mut s = stream_cell.borrow_mut();
                    while pos >= s.len() {
                        // Extend the stream by one exchange.
                        let (k, e) = cursor;
                        let c = convs[order[k]];
                        if 2 * e + 1 < c.messages.len() {
                            let cost = exchange_cost(
                                &c.messages[2 * e].content,
                                &c.messages[2 * e + 1].content,
                            )?;
                            s.push((k, e, cost));
                            cursor = (k, e + 1);
                        } else {
                            // One pass over every conversation at most.
                            let k2 = (k + 1) % order.len();
                            if k2 == start {
                                return Ok(None);
                            }
                            cursor = (k2, 0);
                        }
                    }
                    pos += 1;
                    Ok(Some((pos - 1, s[pos - 1].2)))
                };
                let mut exact = |ids: &[usize]| -> Result<usize> {
                    let s = stream_cell.borrow();
                    measure(m, &layout(ids, &s))
                };
                let (ids, n) = fill(&mut next, *bucket, target, base, groups - 1, &mut exact)?;
                let messages = layout(&ids, &stream_cell.borrow());
                out.push(RetentionPrompt {
                    form: Form::Chat,
                    bucket: *bucket,
                    turn,
                    fact: fact.clone(),
                    conversation_id: conv.id.clone(),
                    messages,
                    context_tokens: n,
                });
            }
        }
    }
    Ok(out)
}

/// Turn 1 (fact + first user message, acknowledgment + first reply), the filler
/// exchanges split into `groups` contiguous groups (group k joins turn k + 1; group 0
/// joins turn 1), then the question as the last user message.
fn chat_layout(
    fact: &Fact,
    u1: &str,
    a1: &str,
    pieces: &[(&str, &str)],
    groups: usize,
) -> Vec<Message> {
    let m = pieces.len();
    let mut msgs = Vec::with_capacity(2 * groups + 1);
    for k in 0..groups {
        let group = &pieces[k * m / groups..(k + 1) * m / groups];
        let mut user: Vec<&str> = Vec::new();
        let mut asst: Vec<&str> = Vec::new();
        let head_u;
        let head_a;
        if k == 0 {
            head_u = format!("{} {u1}", fact.statement);
            head_a = format!("{ACKNOWLEDGMENT} {a1}");
            user.push(&head_u);
            asst.push(&head_a);
        }
        for (u, a) in group {
            user.push(u);
            asst.push(a);
        }
        msgs.push(Message::user(user.join("\n\n")));
        msgs.push(Message::assistant(asst.join("\n\n")));
    }
    msgs.push(Message::user(fact.question.clone()));
    msgs
}

/// Paragraphs of a prose text (already cleaned): blank-line separated, inner
/// whitespace collapsed, empty ones dropped.
pub fn paragraphs(text: &str) -> Vec<String> {
    text.split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|p| !p.is_empty())
        .collect()
}

/// Passkey prompts: for each bucket, `items` keys; one user message with the
/// introduction, the key, whole paragraphs of `prose` from a seeded offset until the
/// item's target length, and the question last.
pub fn build_passkey(prose: &str, spec: &BuildSpec, m: &Measure) -> Result<Vec<RetentionPrompt>> {
    spec.check(Form::Passkey)?;
    let paras = paragraphs(prose);
    if paras.is_empty() {
        return Err(Error::Invalid("the prose filler has no paragraphs".into()));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed ^ 0x7a55_c0de);
    let empty_user = measure(m, &[Message::user("")])?;
    let mut costs: Vec<Option<usize>> = vec![None; paras.len()];
    let mut out = Vec::new();
    for bucket in &spec.buckets {
        for item in 0..spec.items {
            let fact = passkey(out.len(), spec.seed);
            let target = bucket.target(item, spec.items);
            let offset = rng.random_range(0..paras.len());
            let layout = |ids: &[usize]| {
                let filler: Vec<&str> = ids.iter().map(|&i| paras[i].as_str()).collect();
                vec![Message::user(passkey_message(&fact, &filler))]
            };
            let base = measure(m, &layout(&[]))?;
            let mut step = 0usize;
            let costs = &mut costs;
            let mut next = || -> Result<Option<Piece>> {
                if step >= paras.len() {
                    return Ok(None);
                }
                let i = (offset + step) % paras.len();
                step += 1;
                let cost = match costs[i] {
                    Some(c) => c,
                    None => {
                        let c = measure(m, &[Message::user(paras[i].as_str())])?
                            .saturating_sub(empty_user);
                        costs[i] = Some(c);
                        c
                    }
                };
                Ok(Some((i, cost)))
            };
            let mut exact = |ids: &[usize]| measure(m, &layout(ids));
            let (ids, n) = fill(&mut next, *bucket, target, base, 0, &mut exact)?;
            out.push(RetentionPrompt {
                form: Form::Passkey,
                bucket: *bucket,
                turn: 1,
                fact: fact.clone(),
                conversation_id: format!("prose:{offset}"),
                messages: layout(&ids),
                context_tokens: n,
            });
        }
    }
    Ok(out)
}

/// Introduction, key, filler paragraphs, question: blank lines between.
fn passkey_message(fact: &Fact, filler: &[&str]) -> String {
    let mut parts = vec![PASSKEY_INTRO, fact.statement.as_str()];
    parts.extend_from_slice(filler);
    parts.push(fact.question.as_str());
    parts.join("\n\n")
}
