//! Comparing outputs (logits, attention rows) with a reference: one rule for every
//! check, so that a broken engine can never pass one.

/// Largest |a − b| over the pairs; +∞ when any value is not finite. `f32::max` skips
/// a NaN (`0.0f32.max(NaN)` is 0), so a fold over it would let NaN logits pass any
/// tolerance; a non-finite value is a failure here, whatever the other side holds.
pub fn max_abs_diff(pairs: impl IntoIterator<Item = (f32, f32)>) -> f32 {
    let mut worst = 0f32;
    for (a, b) in pairs {
        if !a.is_finite() || !b.is_finite() {
            return f32::INFINITY;
        }
        worst = worst.max((a - b).abs());
    }
    worst
}

/// [`max_abs_diff`] over two tensors' elements, flattened (f32).
#[cfg(test)]
pub(crate) fn max_abs_diff_tensors(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    max_abs_diff(flat(a).into_iter().zip(flat(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_finite_value_on_either_side_is_never_within_tolerance() {
        let good = [(1.0, 1.5), (-2.0, -2.25)];
        assert_eq!(max_abs_diff(good), 0.5);
        assert!(max_abs_diff(good) <= 0.5);
        assert!(max_abs_diff(good) > 0.4);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for pairs in [
                [(1.0, bad), (0.0, 0.0)],
                [(bad, 1.0), (0.0, 0.0)],
                [(0.0, 0.0), (bad, bad)],
            ] {
                assert_eq!(max_abs_diff(pairs), f32::INFINITY, "{pairs:?}");
            }
        }
        // The fold this replaces let NaN through.
        let old = [(1.0f32, f32::NAN)]
            .iter()
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert_eq!(old, 0.0);
        assert_eq!(max_abs_diff(std::iter::empty()), 0.0);
    }
}
