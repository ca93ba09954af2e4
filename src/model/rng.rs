//! A small deterministic PRNG (SplitMix64) so that every run is reproducible for a seed.

/// SplitMix64: tiny, fast, good enough for initialisation, data sampling and tests.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator seeded with `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// A generator derived from a seed and a list of identifiers (layer, tensor, ...), so
    /// that a tensor gets the same values however the model is cut into stages.
    pub fn derived(seed: u64, ids: &[u64]) -> Self {
        let mut r = Rng::new(seed ^ 0x9E37_79B9_7F4A_7C15);
        for &id in ids {
            let x = r.next_u64();
            r = Rng::new(x ^ id.wrapping_mul(0xD1B5_4A32_D192_ED03));
        }
        r
    }

    /// The whole state: `Rng::new(r.state())` continues exactly where `r` is (what a
    /// checkpoint keeps of the data order).
    pub fn state(&self) -> u64 {
        self.state
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [0, n) (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() >> 11) % n.max(1) as u64) as usize
    }

    /// Standard normal sample (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}
