//! Prompts of exact token length: contiguous windows of a corpus's token stream at
//! seeded random offsets. Prompts are token ids, so their length is exact (decoding and
//! re-encoding a window would not always give the same count).

use crate::{Error, Result};
use rand::{Rng, SeedableRng};

/// How prompt lengths are drawn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LengthDist {
    Fixed(usize),
    /// Uniform over `min..=max`.
    Uniform {
        min: usize,
        max: usize,
    },
    /// These lengths in order, repeated as needed (a TTFT-vs-length sweep).
    List(Vec<usize>),
}

impl LengthDist {
    pub fn validate(&self) -> Result<()> {
        let why = match self {
            LengthDist::Fixed(0) => Some("0: expected a length of at least 1 token".to_string()),
            LengthDist::Uniform { min, max } if *min == 0 || min > max => {
                Some(format!("uniform [{min}, {max}]: expected 1 ≤ min ≤ max"))
            }
            LengthDist::List(l) if l.is_empty() || l.contains(&0) => Some(format!(
                "list {l:?}: expected a non-empty list of lengths of at least 1 token"
            )),
            _ => None,
        };
        match why {
            None => Ok(()),
            Some(why) => Err(Error::Invalid(format!("prompt lengths {why}"))),
        }
    }

    pub fn max(&self) -> usize {
        match self {
            LengthDist::Fixed(n) => *n,
            LengthDist::Uniform { max, .. } => *max,
            LengthDist::List(l) => l.iter().copied().max().unwrap_or(0),
        }
    }

    /// `n` lengths, reproducible for a seed.
    pub fn sample(&self, n: usize, seed: u64) -> Result<Vec<usize>> {
        self.validate()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        Ok(match self {
            LengthDist::Fixed(l) => vec![*l; n],
            LengthDist::Uniform { min, max } => {
                (0..n).map(|_| rng.random_range(*min..=*max)).collect()
            }
            LengthDist::List(l) => l.iter().copied().cycle().take(n).collect(),
        })
    }
}

/// One window of `len` tokens per length, each at a seeded random offset of `tokens`.
pub fn slice_prompts(tokens: &[u32], lengths: &[usize], seed: u64) -> Result<Vec<Vec<u32>>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    lengths
        .iter()
        .map(|&len| {
            if len == 0 || len > tokens.len() {
                return Err(Error::Invalid(format!(
                    "a prompt of {len} tokens does not fit in a corpus of {} tokens",
                    tokens.len()
                )));
            }
            let start = rng.random_range(0..=tokens.len() - len);
            Ok(tokens[start..start + len].to_vec())
        })
        .collect()
}
