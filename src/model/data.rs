//! Training data: a deterministic English-like corpus generated from a seed (nothing is
//! downloaded), a byte-level tokenizer and a seeded sampler of (input, target) windows.
use super::rng::Rng;
use super::ModelError;

const NOUNS: &[&str] = &[
    "river", "mountain", "village", "farmer", "teacher", "child", "garden", "window", "letter",
    "market", "road", "forest", "bird", "horse", "ship", "house", "table", "door", "lamp", "book",
    "stone", "field", "city", "king", "queen", "doctor", "miller", "baker", "cat", "dog", "tree",
    "bridge", "storm", "winter", "morning", "evening", "friend", "stranger",
];
const ADJS: &[&str] = &[
    "old", "young", "quiet", "bright", "dark", "small", "large", "green", "cold", "warm", "gentle",
    "strange", "busy", "tired", "happy", "silent", "heavy", "narrow", "golden",
];
const VERBS_T: &[&str] = &[
    "saw",
    "found",
    "carried",
    "painted",
    "opened",
    "watched",
    "followed",
    "built",
    "heard",
    "remembered",
    "visited",
    "crossed",
    "cleaned",
    "sold",
    "bought",
    "wrote",
    "read",
];
const VERBS_I: &[&str] = &[
    "slept", "waited", "laughed", "walked", "sang", "listened", "rested", "smiled", "worked",
    "wandered", "returned", "stayed",
];
const PREPS: &[&str] = &[
    "near", "behind", "under", "beside", "across", "over", "through",
];
const ADVS: &[&str] = &[
    "slowly", "quickly", "again", "often", "softly", "early", "late",
];
const TIMES: &[&str] = &[
    "In the morning",
    "At night",
    "Long ago",
    "One day",
    "After the rain",
    "In winter",
    "Before dawn",
    "That evening",
];
const NAMES: &[&str] = &[
    "Anna", "Tom", "Maria", "John", "Clara", "Peter", "Lucy", "Henry",
];

fn pick<'a>(r: &mut Rng, v: &[&'a str]) -> &'a str {
    v[r.below(v.len())]
}

fn noun_phrase(r: &mut Rng) -> String {
    if r.below(3) == 0 {
        format!("the {} {}", pick(r, ADJS), pick(r, NOUNS))
    } else {
        format!("the {}", pick(r, NOUNS))
    }
}

fn subject(r: &mut Rng) -> String {
    if r.below(4) == 0 {
        pick(r, NAMES).to_string()
    } else {
        noun_phrase(r)
    }
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
        None => String::new(),
    }
}

fn sentence(r: &mut Rng) -> String {
    let s = match r.below(6) {
        0 => format!("{} {} {}", subject(r), pick(r, VERBS_T), noun_phrase(r)),
        1 => format!("{} {} {}", subject(r), pick(r, VERBS_I), pick(r, ADVS)),
        2 => format!(
            "{}, {} {} {} {}",
            pick(r, TIMES),
            subject(r),
            pick(r, VERBS_I),
            pick(r, PREPS),
            noun_phrase(r)
        ),
        3 => format!(
            "{} {} {} and {} {}",
            subject(r),
            pick(r, VERBS_T),
            noun_phrase(r),
            pick(r, VERBS_I),
            pick(r, ADVS)
        ),
        4 => format!("{} was {} and {}", subject(r), pick(r, ADJS), pick(r, ADJS)),
        _ => format!(
            "{} {} {} {} {}",
            subject(r),
            pick(r, VERBS_T),
            noun_phrase(r),
            pick(r, PREPS),
            noun_phrase(r)
        ),
    };
    capitalize(&s) + "."
}

/// About `bytes` bytes of English-like text (sentences in paragraphs), the same for the
/// same seed.
pub fn generate_corpus(seed: u64, bytes: usize) -> String {
    let mut r = Rng::new(seed ^ 0x5EED_C0DE);
    let mut out = String::with_capacity(bytes + 128);
    while out.len() < bytes {
        let n = 3 + r.below(4);
        for i in 0..n {
            if i > 0 {
                out.push(' ');
            }
            out.push_str(&sentence(&mut r));
        }
        out.push('\n');
    }
    out.truncate(bytes);
    out
}

/// Byte-level tokenizer: one token per byte (vocabulary 256).
pub fn tokenize(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Inverse of [`tokenize`] (lossy for ids >= 256 or invalid UTF-8).
pub fn detokenize(tokens: &[u32]) -> String {
    let b: Vec<u8> = tokens.iter().map(|&t| t.min(255) as u8).collect();
    String::from_utf8_lossy(&b).into_owned()
}

/// Samples (input, target) windows of token streams with a seeded generator. A window
/// never crosses from one document (file) into another: every start position of every
/// document is equally likely.
pub struct Batcher {
    docs: Vec<Vec<u32>>,
    rng: Rng,
}

impl Batcher {
    /// A sampler over one token stream (needs more than one token).
    pub fn new(tokens: Vec<u32>, seed: u64) -> Result<Self, ModelError> {
        Self::from_documents(vec![tokens], seed)
    }

    /// A sampler over several documents (each needs more than one token). With one
    /// document it draws exactly what [`Batcher::new`] draws.
    pub fn from_documents(docs: Vec<Vec<u32>>, seed: u64) -> Result<Self, ModelError> {
        if docs.is_empty() || docs.iter().any(|d| d.len() < 2) {
            return Err(ModelError::InvalidConfig(
                "corpus shorter than 2 tokens".into(),
            ));
        }
        Ok(Batcher {
            docs,
            rng: Rng::new(seed),
        })
    }

    /// The sampler's position in its random stream (saved in checkpoints, so that a
    /// resumed run draws the same windows as an uninterrupted one).
    pub fn rng_state(&self) -> u64 {
        self.rng.state()
    }

    /// Continues from a position given by [`Batcher::rng_state`].
    pub fn set_rng_state(&mut self, state: u64) {
        self.rng = Rng::new(state);
    }

    /// `batch` random windows of `seq` tokens: inputs and next-token targets, each
    /// `[batch * seq]`.
    pub fn next_batch(
        &mut self,
        batch: usize,
        seq: usize,
    ) -> Result<(Vec<u32>, Vec<u32>), ModelError> {
        if let Some(d) = self.docs.iter().find(|d| seq + 1 > d.len()) {
            return Err(ModelError::InvalidConfig(format!(
                "corpus of {} tokens is too short for seq {seq}",
                d.len()
            )));
        }
        Ok(sample_windows(&self.docs, &mut self.rng, batch, seq))
    }
}

/// `batch` windows of `seq` tokens drawn with `rng` from `docs` (every start position of
/// every document equally likely; each document must be longer than `seq`): inputs and
/// next-token targets, each `[batch * seq]`.
pub fn sample_windows(
    docs: &[Vec<u32>],
    rng: &mut Rng,
    batch: usize,
    seq: usize,
) -> (Vec<u32>, Vec<u32>) {
    let total: usize = docs.iter().map(|d| d.len() - seq).sum();
    let mut x = Vec::with_capacity(batch * seq);
    let mut y = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut s = rng.below(total);
        let mut doc = &docs[0];
        for d in docs {
            doc = d;
            if s < d.len() - seq {
                break;
            }
            s -= d.len() - seq;
        }
        x.extend_from_slice(&doc[s..s + seq]);
        y.extend_from_slice(&doc[s + 1..s + seq + 1]);
    }
    (x, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_stay_inside_one_document() {
        let a: Vec<u32> = (0..40).collect();
        let b: Vec<u32> = (100..120).collect();
        let mut s = Batcher::from_documents(vec![a, b], 5).unwrap();
        let (mut in_a, mut in_b) = (0, 0);
        for _ in 0..200 {
            let (x, y) = s.next_batch(1, 8).unwrap();
            assert!(x.windows(2).all(|w| w[1] == w[0] + 1), "{x:?}");
            assert_eq!(y[0], x[0] + 1);
            if x[0] < 100 {
                in_a += 1;
            } else {
                in_b += 1;
            }
        }
        // Start positions: 32 in the first document, 12 in the second.
        assert!(in_a > in_b && in_b > 20, "{in_a} {in_b}");
        // A position in the random stream can be saved and restored.
        let saved = s.rng_state();
        let next = s.next_batch(2, 8).unwrap();
        s.set_rng_state(saved);
        assert_eq!(s.next_batch(2, 8).unwrap(), next);
    }

    #[test]
    fn one_document_draws_as_before() {
        let t: Vec<u32> = (0..300).map(|i| i % 256).collect();
        let mut a = Batcher::new(t.clone(), 9).unwrap();
        let mut r = Rng::new(9);
        let (x, _) = a.next_batch(4, 16).unwrap();
        for i in 0..4 {
            let s = r.below(300 - 16);
            assert_eq!(x[i * 16..(i + 1) * 16], t[s..s + 16]);
        }
    }
}
