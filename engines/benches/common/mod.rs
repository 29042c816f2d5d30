//! What the criterion benches share.

/// `n` token ids from a seeded LCG, skipping the 17 special tokens at the start of
/// SmolLM2's vocabulary of 49 152: the same prompt for every engine compared.
pub fn seeded_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            17 + ((s >> 33) % (49_152 - 17)) as u32
        })
        .collect()
}
