//! What a training run reads: the generated corpus (the default) or UTF-8 text files, each
//! cut into a training part and a held-out part that is never trained on, so that the
//! held-out loss says how well the model generalises rather than how well it memorised.
//!
//! Tokens are bytes (ids 0..=255): every model trained here has a vocabulary of exactly
//! 256 (models with a smaller vocabulary are refused by the trainer, larger ones would
//! leave the ids above 255 unused).
use super::data::{generate_corpus, tokenize};
use super::ModelError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// Seed of the generated held-out text: fixed, so that held-out losses of runs with
/// different seeds are measured on the same text.
pub const HELDOUT_SEED: u64 = 0x4845_4C44_4F55_5421;

/// The most held-out sequences evaluated (spread evenly over the held-out text), so that
/// the evaluation stays a small fraction of a short run.
pub const MAX_HELDOUT_SEQUENCES: usize = 64;

/// Where the training text comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSource {
    /// The generated English-like corpus of `bytes` bytes for `seed`; held out: a
    /// separate tenth of that size generated from [`HELDOUT_SEED`].
    Synthetic {
        /// Seed of the training text.
        seed: u64,
        /// Size of the training text.
        bytes: usize,
    },
    /// UTF-8 text files; the last tenth of each (at least one sequence) is held out.
    Files(Vec<PathBuf>),
}

/// One training file as a checkpoint records it (to check that a resumed run reads the
/// same text).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// The path as given on the command line.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the content, lowercase hex.
    pub sha256: String,
    /// Bytes at the end of the file held out for evaluation.
    pub heldout_bytes: u64,
}

/// What a run trained on, as recorded in a checkpoint's `config.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataDescription {
    /// The generated corpus.
    Synthetic {
        /// Seed of the training text.
        seed: u64,
        /// Bytes of training text.
        bytes: usize,
        /// Seed of the held-out text.
        heldout_seed: u64,
        /// Bytes of held-out text.
        heldout_bytes: usize,
    },
    /// Text files.
    Files {
        /// The files, in the order given.
        files: Vec<FileInfo>,
    },
}

impl DataDescription {
    /// Whether `other` is the same text (file paths may differ, contents may not).
    pub fn same_text(&self, other: &DataDescription) -> bool {
        match (self, other) {
            (DataDescription::Files { files: a }, DataDescription::Files { files: b }) => {
                a.len() == b.len()
                    && a.iter().zip(b).all(|(x, y)| {
                        (x.bytes, &x.sha256, x.heldout_bytes)
                            == (y.bytes, &y.sha256, y.heldout_bytes)
                    })
            }
            (a, b) => a == b,
        }
    }

    /// One line for people, e.g. `2 files, 10234 bytes (1024 held out)`.
    pub fn summary(&self) -> String {
        match self {
            DataDescription::Synthetic {
                seed,
                bytes,
                heldout_bytes,
                ..
            } => format!(
                "the generated corpus ({bytes} bytes, seed {seed}; {heldout_bytes} bytes of \
                 separately generated text held out)"
            ),
            DataDescription::Files { files } => {
                let total: u64 = files.iter().map(|f| f.bytes).sum();
                let held: u64 = files.iter().map(|f| f.heldout_bytes).sum();
                let names: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
                format!(
                    "{} ({total} bytes; the last {held} bytes, a tenth of each file, held out)",
                    names.join(", ")
                )
            }
        }
    }
}

/// Token streams to train on and to evaluate on.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// Training documents (one per file), byte tokens.
    pub train: Vec<Vec<u32>>,
    /// Held-out documents, byte tokens.
    pub heldout: Vec<Vec<u32>>,
    /// What it is.
    pub description: DataDescription,
}

impl Dataset {
    /// Loads `src` for sequences of `seq` tokens. Every file is read and checked before
    /// anything is trained: unreadable, not UTF-8, or too short for one training and one
    /// held-out sequence is [`ModelError::Data`] naming the file.
    pub fn load(src: &DataSource, seq: usize) -> Result<Dataset, ModelError> {
        match src {
            DataSource::Synthetic { seed, bytes } => Ok(Self::synthetic(*seed, *bytes, seq)),
            DataSource::Files(paths) => Self::files(paths, seq),
        }
    }

    /// The generated corpus and its held-out text.
    pub fn synthetic(seed: u64, bytes: usize, seq: usize) -> Dataset {
        let heldout_bytes = (bytes / 10).max(4 * (seq + 1));
        Dataset {
            train: vec![tokenize(&generate_corpus(seed, bytes))],
            heldout: vec![tokenize(&generate_corpus(HELDOUT_SEED, heldout_bytes))],
            description: DataDescription::Synthetic {
                seed,
                bytes,
                heldout_seed: HELDOUT_SEED,
                heldout_bytes,
            },
        }
    }

    /// Text files: each file's last tenth (at least `seq + 1` bytes) is held out.
    pub fn files(paths: &[PathBuf], seq: usize) -> Result<Dataset, ModelError> {
        if paths.is_empty() {
            return Err(ModelError::Data("no training file given".into()));
        }
        let mut d = Dataset {
            train: Vec::new(),
            heldout: Vec::new(),
            description: DataDescription::Files { files: Vec::new() },
        };
        let mut infos = Vec::new();
        for p in paths {
            let name = p.display();
            let bytes = std::fs::read(p)
                .map_err(|e| ModelError::Data(format!("{name}: cannot read: {e}")))?;
            if let Err(e) = std::str::from_utf8(&bytes) {
                return Err(ModelError::Data(format!(
                    "{name}: not UTF-8 text (invalid byte at offset {})",
                    e.valid_up_to()
                )));
            }
            let need = 2 * (seq + 1);
            if bytes.len() < need {
                return Err(ModelError::Data(format!(
                    "{name}: {} bytes is too short: sequences of {seq} tokens need at least \
                     {need} bytes (one training and one held-out sequence of {} bytes)",
                    bytes.len(),
                    seq + 1
                )));
            }
            let held = bytes.len().div_ceil(10).max(seq + 1);
            let cut = bytes.len() - held;
            let tokens: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
            d.train.push(tokens[..cut].to_vec());
            d.heldout.push(tokens[cut..].to_vec());
            infos.push(FileInfo {
                path: p.display().to_string(),
                bytes: bytes.len() as u64,
                sha256: hex(&Sha256::digest(&bytes)),
                heldout_bytes: held as u64,
            });
        }
        d.description = DataDescription::Files { files: infos };
        Ok(d)
    }

    /// The held-out (input, target) sequences of `seq` tokens that the held-out loss is
    /// measured on: consecutive windows of each held-out document, at most
    /// [`MAX_HELDOUT_SEQUENCES`] taken evenly over all of them. Deterministic.
    pub fn heldout_windows(&self, seq: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
        let mut all = Vec::new();
        for d in &self.heldout {
            let mut s = 0;
            while s + seq < d.len() {
                all.push((d[s..s + seq].to_vec(), d[s + 1..s + seq + 1].to_vec()));
                s += seq;
            }
        }
        let n = all.len();
        if n <= MAX_HELDOUT_SEQUENCES {
            return all;
        }
        (0..MAX_HELDOUT_SEQUENCES)
            .map(|i| all[i * n / MAX_HELDOUT_SEQUENCES].clone())
            .collect()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, content: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gwtf-dataset-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        p
    }

    #[test]
    fn files_are_split_into_train_and_heldout() {
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(10);
        let p = write("fox.txt", text.as_bytes());
        let d = Dataset::files(std::slice::from_ref(&p), 16).unwrap();
        assert_eq!(d.train.len(), 1);
        let held = text.len().div_ceil(10);
        assert_eq!(d.heldout[0].len(), held);
        assert_eq!(d.train[0].len() + held, text.len());
        let mut joined = d.train[0].clone();
        joined.extend(&d.heldout[0]);
        assert_eq!(joined, tokenize(&text));
        let w = d.heldout_windows(16);
        assert_eq!(w.len(), (held - 1) / 16);
        assert_eq!(w[0].0[1..], w[0].1[..15]);
    }

    #[test]
    fn bad_files_are_named() {
        let missing = PathBuf::from("/nonexistent/gwtf/none.txt");
        let e = Dataset::files(&[missing], 16).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/gwtf/none.txt: cannot read"), "{e}");
        let bin = write("bin.txt", &[b'a', 0xff, 0xfe, b'b']);
        let e = Dataset::files(&[bin], 16).unwrap_err().to_string();
        assert!(
            e.contains("bin.txt: not UTF-8 text (invalid byte at offset 1)"),
            "{e}"
        );
        let short = write("short.txt", b"too short");
        let e = Dataset::files(&[short], 16).unwrap_err().to_string();
        assert!(e.contains("short.txt: 9 bytes is too short"), "{e}");
        assert!(e.contains("at least 34 bytes"), "{e}");
    }

    #[test]
    fn synthetic_heldout_is_fixed_and_capped() {
        let a = Dataset::synthetic(1, 8192, 16);
        let b = Dataset::synthetic(2, 8192, 16);
        assert_eq!(a.heldout, b.heldout);
        assert_ne!(a.train, b.train);
        assert_eq!(
            a.heldout_windows(16).len(),
            MAX_HELDOUT_SEQUENCES.min(818 / 16)
        );
        let big = Dataset::synthetic(1, 64 * 1024, 16);
        assert_eq!(big.heldout_windows(16).len(), MAX_HELDOUT_SEQUENCES);
    }
}
