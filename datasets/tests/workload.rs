//! Corpora, prompt slicing and arrivals.

use kvbench_datasets::arrivals::Arrivals;
use kvbench_datasets::corpus::{clean, Corpus};
use kvbench_datasets::prompts::{slice_prompts, LengthDist};
use kvbench_datasets::{Error, Tokenize};
use std::path::PathBuf;

/// Whitespace words → ids (tests only).
struct Words;
impl Tokenize for Words {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text
            .split_whitespace()
            .map(|w| {
                w.bytes()
                    .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32))
                    % 50_000
            })
            .collect())
    }
}

/// A prose file of the committed fixtures.
fn prose(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/prose")
        .join(name)
}

#[test]
fn gutenberg_header_footer_bom_and_crlf_are_removed() {
    let raw = "\u{feff}The Project Gutenberg eBook\r\nlicense text\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n\r\nChapter 1\r\nIt was.\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nfooter\r\n";
    assert_eq!(clean(raw), "Chapter 1\nIt was.");
    let old = "header\n***START OF THIS BOOK***\nbody\n***END OF THIS BOOK***\n";
    assert_eq!(clean(old), "body");
    assert_eq!(clean("no markers at all\r\n"), "no markers at all");
}

#[test]
fn the_book_fixture_is_cleaned() {
    // Chapters I–VI verbatim (BOM-less, CRLF, no Gutenberg header or footer: those are
    // checked on the whole books by tests/full_data.rs).
    let raw = std::fs::read_to_string(prose("pride_and_prejudice_pg42671.txt")).unwrap();
    assert!(raw.contains("\r\n"));
    let c = Corpus::from_file(&prose("pride_and_prejudice_pg42671.txt")).unwrap();
    assert!(!c.text.contains('\r'));
    assert!(c
        .text
        .starts_with("CHAPTER I.\n\n\nIt is a truth universally acknowledged, that a single man"));
    assert!(
        c.text.ends_with("her wit flowed long."),
        "{:?}",
        &c.text[c.text.len() - 40..]
    );
    assert_eq!(c.text, raw.replace("\r\n", "\n").trim());
    assert!(c.text.split_whitespace().count() > 7000);
}

#[test]
fn bad_corpus_files_are_named() {
    let tmp = std::env::temp_dir().join(format!("kvbench-bad-{}.txt", std::process::id()));
    std::fs::write(&tmp, [b'a', 0xff, 0xfe, b'b']).unwrap();
    let e = Corpus::from_file(&tmp).unwrap_err().to_string();
    assert!(e.contains("kvbench-bad") && e.contains("UTF-8"), "{e}");
    std::fs::write(&tmp, "*** START OF X ***\n\n*** END OF X ***\n").unwrap();
    let e = Corpus::from_file(&tmp).unwrap_err().to_string();
    assert!(e.contains("no text left"), "{e}");
    std::fs::remove_file(&tmp).unwrap();
    let e = Corpus::from_file(&PathBuf::from("/nonexistent/corpus.txt")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }));
}

#[test]
fn prompts_have_exact_lengths_and_are_reproducible() {
    let c = Corpus::from_file(&prose("pride_and_prejudice_pg42671.txt")).unwrap();
    let tokens = c.tokenize(&Words).unwrap();
    let lengths = LengthDist::Uniform {
        min: 100,
        max: 5000,
    }
    .sample(50, 1)
    .unwrap();
    assert!(lengths.iter().all(|&l| (100..=5000).contains(&l)));
    assert!(lengths.iter().any(|&l| l != lengths[0]));
    let a = slice_prompts(&tokens, &lengths, 7).unwrap();
    let b = slice_prompts(&tokens, &lengths, 7).unwrap();
    assert_eq!(a, b);
    assert!(a.iter().zip(&lengths).all(|(p, &l)| p.len() == l));
    // Every prompt is a contiguous window of the corpus.
    let w = &a[0];
    assert!(tokens.windows(w.len()).any(|x| x == w.as_slice()));
    assert_ne!(slice_prompts(&tokens, &lengths, 8).unwrap(), a);
    let e = slice_prompts(&tokens, &[tokens.len() + 1], 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not fit"), "{e}");
}

#[test]
fn length_distributions() {
    assert_eq!(LengthDist::Fixed(3).sample(2, 0).unwrap(), vec![3, 3]);
    assert_eq!(
        LengthDist::List(vec![1, 5]).sample(5, 0).unwrap(),
        vec![1, 5, 1, 5, 1]
    );
    let u = LengthDist::Uniform { min: 1, max: 10 };
    assert_eq!(u.sample(20, 3).unwrap(), u.sample(20, 3).unwrap());
    for bad in [
        LengthDist::Fixed(0),
        LengthDist::Uniform { min: 9, max: 2 },
        LengthDist::List(vec![]),
    ] {
        assert!(bad.sample(1, 0).is_err(), "{bad:?}");
    }
}

#[test]
fn gamma_arrivals_have_the_requested_rate_and_burstiness() {
    assert_eq!(Arrivals::AllAtZero.times(3, 0).unwrap(), vec![0.0; 3]);
    for burstiness in [0.5, 1.0, 4.0] {
        let t = Arrivals::Poisson {
            rate: 8.0,
            burstiness,
        }
        .times(20_000, 11)
        .unwrap();
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        let gaps: Vec<f64> = std::iter::once(t[0])
            .chain(t.windows(2).map(|w| w[1] - w[0]))
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((mean * 8.0 - 1.0).abs() < 0.03, "mean gap {mean}");
        // Gamma(k, θ): squared coefficient of variation = 1 / k.
        let cv2 = var / (mean * mean);
        assert!(
            (cv2 * burstiness - 1.0).abs() < 0.1,
            "burstiness {burstiness}: CV² {cv2}"
        );
    }
    assert!(Arrivals::Poisson {
        rate: 0.0,
        burstiness: 1.0
    }
    .times(1, 0)
    .is_err());
    assert!(Arrivals::Poisson {
        rate: 1.0,
        burstiness: -1.0
    }
    .times(1, 0)
    .is_err());
}

#[test]
fn the_last_arrival_is_at_n_over_rate_as_vllm_rescales_the_gaps() {
    for (n, rate, burstiness, seed) in [(10, 2.0, 1.0, 0), (37, 0.5, 0.3, 5), (1, 4.0, 2.0, 9)] {
        let t = Arrivals::Poisson { rate, burstiness }
            .times(n, seed)
            .unwrap();
        let want = n as f64 / rate;
        let last = *t.last().unwrap();
        assert!(
            (last - want).abs() <= 1e-12 * want,
            "{n} at {rate}/s: last {last}"
        );
        // The first request still waits one gap; the order and the seed stand.
        assert!(t[0] > 0.0 && t.windows(2).all(|w| w[0] <= w[1]), "{t:?}");
        assert_eq!(
            t,
            Arrivals::Poisson { rate, burstiness }
                .times(n, seed)
                .unwrap()
        );
    }
    let a = Arrivals::Poisson {
        rate: 2.0,
        burstiness: 1.0,
    };
    // Seeds change the gaps, not where the last one lands.
    let (x, y) = (a.times(10, 1).unwrap(), a.times(10, 2).unwrap());
    assert_ne!(x, y);
    assert!((x[9] - y[9]).abs() < 1e-12);
    assert!(a.times(0, 1).unwrap().is_empty());
}
