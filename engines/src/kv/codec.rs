//! How K/V rows are stored: the seam between the policies and their storage. A row is
//! one token's keys (or values) of one KV head, `dh` elements; a codec says how many
//! bytes it takes and how it is written and read back as f32. Attention never sees the
//! stored form: it asks a [`crate::kv::paged::KvView`] for rows in f32 (in place when
//! they are f32, decoded into a scratch tile otherwise).
//!
//! `int{8,4,2}` is asymmetric min/max integer quantization per token over groups of
//! channels (algorithms.md §8's value scheme, applied to keys and values alike):
//! `scale = (max − min)/(2^bits − 1)`, `code = round((x − min)/scale)`,
//! `x̂ = code·scale + min`, one f32 scale and minimum per group of `group` channels of a
//! row, codes packed low bits first. A row carries its own scales, so it composes with
//! everything the slot stores do to rows (paging, eviction, compaction, copies).
//! KIVI's per-channel keys span several tokens and live in `kivi`'s own storage.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::borrow::Cow;

/// The engine option's key, as `--set` and an experiment's engine `params` spell it.
pub const KV_CODEC_KEY: &str = "kv_codec";

/// Channels per scale of an integer codec unless the option says otherwise.
pub const DEFAULT_GROUP: usize = 32;

/// Storage of one K/V row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCodec {
    F32,
    F16,
    Bf16,
    /// `bits` (2, 4 or 8) per element, an f32 scale and minimum per `group` channels.
    Int {
        bits: u8,
        group: u16,
    },
}

impl KvCodec {
    /// The storage of a model's compute dtype (f32 for anything else).
    pub fn from_candle(d: candle_core::DType) -> Self {
        match d {
            candle_core::DType::F16 => KvCodec::F16,
            candle_core::DType::BF16 => KvCodec::Bf16,
            _ => KvCodec::F32,
        }
    }

    /// The plain type of `elem` bytes per element (4: f32, 2: bf16).
    pub fn from_elem(elem: usize) -> Result<Self> {
        match elem {
            4 => Ok(KvCodec::F32),
            2 => Ok(KvCodec::Bf16),
            _ => Err(Error::Config(format!(
                "KV precision of {elem} bytes: expected 2 (bf16) or 4 (f32)"
            ))),
        }
    }

    /// Bytes of one row's elements or codes.
    pub fn code_bytes(&self, dh: usize) -> usize {
        match *self {
            KvCodec::F32 => 4 * dh,
            KvCodec::F16 | KvCodec::Bf16 => 2 * dh,
            KvCodec::Int { bits, .. } => (dh * bits as usize).div_ceil(8),
        }
    }

    /// f32 scales and minimums of one row (none for plain types).
    pub fn param_floats(&self, dh: usize) -> usize {
        match *self {
            KvCodec::Int { group, .. } => 2 * dh.div_ceil(group as usize),
            _ => 0,
        }
    }

    /// Bytes of one row: codes and parameters.
    pub fn row_bytes(&self, dh: usize) -> usize {
        self.code_bytes(dh) + 4 * self.param_floats(dh)
    }

    /// Bytes of one token's K and V over every layer of `cfg`.
    pub fn token_bytes(&self, cfg: &ModelConfig) -> u64 {
        (2 * cfg.num_layers * cfg.num_kv_heads * self.row_bytes(cfg.head_dim)) as u64
    }

    /// Whether rows come back exactly as written (f32 storage).
    pub fn is_exact(&self) -> bool {
        matches!(self, KvCodec::F32)
    }

    /// Write `x` (one row) of an integer codec as `codes` (`code_bytes` long, zeroed)
    /// and `params`; plain types are stored by [`crate::kv::PagedKv`] as they are.
    pub fn encode_int(&self, x: &[f32], codes: &mut [u8], params: &mut [f32]) {
        if let KvCodec::Int { bits, group } = *self {
            for (gi, g) in x.chunks(group as usize).enumerate() {
                let (scale, min) = quantize_into(g, bits as usize, codes, gi * group as usize);
                params[2 * gi] = scale;
                params[2 * gi + 1] = min;
            }
        }
    }

    /// The row `x` becomes once stored and read back.
    pub fn round_trip(&self, x: &[f32]) -> Vec<f32> {
        match *self {
            KvCodec::F32 => x.to_vec(),
            KvCodec::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
            KvCodec::Bf16 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
            KvCodec::Int { bits, group } => {
                let mut codes = vec![0u8; self.code_bytes(x.len())];
                let mut params = vec![0f32; self.param_floats(x.len())];
                self.encode_int(x, &mut codes, &mut params);
                let mut out = vec![0f32; x.len()];
                decode_int(&codes, &params, bits, group as usize, &mut out);
                out
            }
        }
    }

    /// Every row of `x` (rows of `dh`) as stored and read back (what a policy reads
    /// when it derives something from the keys it stores, e.g. Quest's page bounds).
    pub fn round_trip_rows<'a>(&self, x: &'a [f32], dh: usize) -> Cow<'a, [f32]> {
        if self.is_exact() {
            return Cow::Borrowed(x);
        }
        Cow::Owned(
            x.chunks_exact(dh)
                .flat_map(|r| self.round_trip(r))
                .collect(),
        )
    }
}

impl std::fmt::Display for KvCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            KvCodec::F32 => f.write_str("f32"),
            KvCodec::F16 => f.write_str("f16"),
            KvCodec::Bf16 => f.write_str("bf16"),
            KvCodec::Int { bits, group } if group as usize == DEFAULT_GROUP => {
                write!(f, "int{bits}")
            }
            KvCodec::Int { bits, group } => write!(f, "int{bits}/{group}"),
        }
    }
}

impl serde::Serialize for KvCodec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl std::str::FromStr for KvCodec {
    type Err = Error;
    fn from_str(v: &str) -> Result<Self> {
        let bad = || {
            Error::Config(format!(
                "`{KV_CODEC_KEY}={v}`: expected f32, f16, bf16, or int8, int4, int2 (per-token \
                 codes with a scale and minimum per {DEFAULT_GROUP} channels; `int4/64` sets \
                 the channels per scale)"
            ))
        };
        match v {
            "f32" => return Ok(KvCodec::F32),
            "f16" => return Ok(KvCodec::F16),
            "bf16" => return Ok(KvCodec::Bf16),
            _ => {}
        }
        let rest = v.strip_prefix("int").ok_or_else(bad)?;
        let (bits, group) = match rest.split_once('/') {
            Some((b, g)) => (b, g.parse::<u16>().ok().filter(|&g| g > 0).ok_or_else(bad)?),
            None => (rest, DEFAULT_GROUP as u16),
        };
        match bits {
            "8" | "4" | "2" => Ok(KvCodec::Int {
                bits: bits.parse().map_err(|_| bad())?,
                group,
            }),
            _ => Err(bad()),
        }
    }
}

/// Codes of `x` (min/max asymmetric, `bits` wide) packed low bits first into `codes`
/// from element `start` on (those bits zeroed beforehand); returns the scale and the
/// minimum: `x̂ = code·scale + min`.
pub fn quantize_into(x: &[f32], bits: usize, codes: &mut [u8], start: usize) -> (f32, f32) {
    let (lo, hi) = x
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
            (l.min(v), h.max(v))
        });
    let levels = ((1u32 << bits) - 1) as f32;
    let scale = (hi - lo) / levels;
    for (j, &v) in x.iter().enumerate() {
        let c = if scale > 0.0 {
            ((v - lo) / scale).round().clamp(0.0, levels) as u8
        } else {
            0
        };
        let i = start + j;
        codes[i * bits / 8] |= c << (i * bits % 8);
    }
    (scale, lo)
}

/// Code `i` of packed `codes`.
#[inline]
pub fn code(codes: &[u8], i: usize, bits: usize) -> f32 {
    ((codes[i * bits / 8] >> (i * bits % 8)) & ((1u16 << bits) - 1) as u8) as f32
}

/// Codes `start..start + out.len()` as f32 (2-, 4- and 8-bit unpacking specialized).
pub fn unpack(codes: &[u8], start: usize, bits: usize, out: &mut [f32]) {
    match bits {
        2 => {
            for (j, o) in out.iter_mut().enumerate() {
                let i = start + j;
                *o = ((codes[i >> 2] >> ((i & 3) << 1)) & 3) as f32;
            }
        }
        4 => {
            for (j, o) in out.iter_mut().enumerate() {
                let i = start + j;
                *o = ((codes[i >> 1] >> ((i & 1) << 2)) & 15) as f32;
            }
        }
        _ => {
            for (o, &c) in out.iter_mut().zip(&codes[start..]) {
                *o = c as f32;
            }
        }
    }
}

/// One integer row: `codes` and `params` (scale, minimum per group) into `out`.
#[inline]
pub fn decode_int(codes: &[u8], params: &[f32], bits: u8, group: usize, out: &mut [f32]) {
    unpack(codes, 0, bits as usize, out);
    for (gi, g) in out.chunks_mut(group).enumerate() {
        let (s, m) = (params[2 * gi], params[2 * gi + 1]);
        for x in g {
            *x = *x * s + m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn names_parse_and_print_back() {
        for v in [
            "f32", "f16", "bf16", "int8", "int4", "int2", "int4/64", "int8/16",
        ] {
            let c: KvCodec = v.parse().unwrap();
            assert_eq!(c.to_string(), v);
        }
        assert_eq!(
            "int4/32".parse::<KvCodec>().unwrap(),
            KvCodec::Int { bits: 4, group: 32 }
        );
        for bad in ["int3", "int4/0", "int4/x", "fp8", "", "int"] {
            let e = bad.parse::<KvCodec>().unwrap_err().to_string();
            assert!(e.contains(KV_CODEC_KEY) && e.contains("int4"), "{e}");
        }
    }

    #[test]
    fn row_bytes_follow_the_layout() {
        assert_eq!(KvCodec::F32.row_bytes(64), 256);
        assert_eq!(KvCodec::Bf16.row_bytes(64), 128);
        // 64 × 4 bits = 32 bytes of codes, 2 groups × (scale, min) × 4 bytes.
        assert_eq!(KvCodec::Int { bits: 4, group: 32 }.row_bytes(64), 32 + 16);
        assert_eq!(KvCodec::Int { bits: 2, group: 32 }.row_bytes(64), 16 + 16);
        assert_eq!(KvCodec::Int { bits: 8, group: 48 }.row_bytes(64), 64 + 16);
        // A short last group still has its own scale.
        assert_eq!(KvCodec::Int { bits: 2, group: 48 }.param_floats(64), 4);
    }

    /// Every element comes back within half a scale of its group (and exactly for the
    /// plain types that hold it), for each width, group and a row with a ragged group.
    #[test]
    fn rows_come_back_within_half_a_scale() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for dh in [8, 64, 80] {
            let x: Vec<f32> = (0..dh).map(|_| rng.random_range(-4.0..4.0)).collect();
            for bits in [2u8, 4, 8] {
                for group in [4u16, 32, 48] {
                    let c = KvCodec::Int { bits, group };
                    let back = c.round_trip(&x);
                    for (gi, g) in x.chunks(group as usize).enumerate() {
                        let lo = g.iter().copied().fold(f32::INFINITY, f32::min);
                        let hi = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let half = (hi - lo) / ((1u32 << bits) - 1) as f32 / 2.0;
                        for (j, &v) in g.iter().enumerate() {
                            let b = back[gi * group as usize + j];
                            assert!((b - v).abs() <= half + 1e-5, "{c} dh {dh}: {v} → {b}");
                        }
                    }
                }
            }
            assert_eq!(KvCodec::F32.round_trip(&x), x);
            for (a, b) in KvCodec::Bf16.round_trip(&x).iter().zip(&x) {
                assert_eq!(*a, bf16::from_f32(*b).to_f32());
            }
        }
        // A constant group has scale 0 and comes back exactly.
        let c = KvCodec::Int { bits: 2, group: 8 };
        assert_eq!(c.round_trip(&[1.5; 8]), vec![1.5; 8]);
    }
}
