//! Request arrival times: all at t = 0 (offline batch, as the study), or a Poisson
//! process with burstiness, vLLM's convention: gamma-distributed inter-arrival times
//! with shape `burstiness` and mean `1 / rate` (burstiness 1 = Poisson; below 1 burstier,
//! above 1 more regular).

use crate::{Error, Result};
use rand::SeedableRng;
use rand_distr::{Distribution, Gamma};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    AllAtZero,
    Poisson { rate: f64, burstiness: f64 },
}

impl Arrivals {
    /// Arrival time in seconds of each of `n` requests, non-decreasing, reproducible.
    pub fn times(&self, n: usize, seed: u64) -> Result<Vec<f64>> {
        match *self {
            Arrivals::AllAtZero => Ok(vec![0.0; n]),
            Arrivals::Poisson { rate, burstiness } => {
                if !(rate.is_finite() && rate > 0.0 && burstiness.is_finite() && burstiness > 0.0) {
                    return Err(Error::Invalid(format!(
                        "request rate {rate} and burstiness {burstiness} must be finite and > 0"
                    )));
                }
                let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness))
                    .map_err(|e| Error::Invalid(format!("gamma arrivals: {e}")))?;
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let mut t = 0.0;
                Ok((0..n)
                    .map(|_| {
                        t += gamma.sample(&mut rng);
                        t
                    })
                    .collect())
            }
        }
    }
}
