//! Frame protection after the handshake. On the wire every frame is its
//! header (96 bytes), a 16-byte tag, then its payload. The tag covers the
//! frame's sequence number (frames counted from 0 in each direction, never
//! sent), the header and the payload, under the direction's key from the
//! handshake: a frame changed, replayed, reordered or dropped on the way
//! fails the check of that frame or the next one.
//!
//! Integrity (always on): the tag is keyed BLAKE3 over sequence number,
//! header and payload, computed over the payload where it lies (the
//! sender's pool slot, the receiver's lease): no copy.
//! Encryption (when either side asks): AES-256-GCM with the sequence number
//! as nonce and the header as associated data; the payload is encrypted in
//! a copy on the sending side (a pool slot may go to several peers) and
//! decrypted in place on the receiving side.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

use super::header::HEADER_LEN;
use super::WireError;

/// Bytes of the tag that follows every header.
pub const TAG_LEN: usize = 16;
/// Header and tag: what precedes every payload.
pub const HEAD_LEN: usize = HEADER_LEN + TAG_LEN;

const MAC_CONTEXT: &str = "gwtf 2026 frame tag v2";
const AEAD_CONTEXT: &str = "gwtf 2026 frame aes-256-gcm v2";
const CONFIRM_CONTEXT: &str = "gwtf 2026 handshake confirmation v2";

/// The keys of one direction of a connection.
struct DirectionKeys {
    mac: [u8; 32],
    aead: Option<LessSafeKey>,
    /// The AEAD key's bytes (to make a copy of these keys).
    aead_bytes: Option<[u8; 32]>,
}

fn aead_key(k: &[u8; 32]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, k).expect("a 32-byte AES-256 key"))
}

impl Clone for DirectionKeys {
    fn clone(&self) -> Self {
        Self {
            mac: self.mac,
            aead: self.aead_bytes.as_ref().map(aead_key),
            aead_bytes: self.aead_bytes,
        }
    }
}

impl DirectionKeys {
    fn new(raw: &[u8; 32], encrypt: bool) -> Self {
        let aead_bytes = encrypt.then(|| blake3::derive_key(AEAD_CONTEXT, raw));
        Self {
            mac: blake3::derive_key(MAC_CONTEXT, raw),
            aead: aead_bytes.as_ref().map(aead_key),
            aead_bytes,
        }
    }

    fn tag(&self, seq: u64, head: &[u8; HEADER_LEN], payload: &[u8]) -> [u8; TAG_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.mac);
        h.update(&seq.to_le_bytes());
        h.update(head);
        h.update(payload);
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&h.finalize().as_bytes()[..TAG_LEN]);
        t
    }
}

fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

/// The tag an acceptor sends to prove the swarm key after checking the
/// connector's proof: keyed by its sending direction, over the handshake
/// hash.
pub(crate) fn confirmation(raw: &[u8; 32], handshake_hash: &[u8; 32]) -> [u8; TAG_LEN] {
    let k = blake3::derive_key(CONFIRM_CONTEXT, raw);
    let mut t = [0u8; TAG_LEN];
    t.copy_from_slice(&blake3::keyed_hash(&k, handshake_hash).as_bytes()[..TAG_LEN]);
    t
}

/// Seals the frames one side sends, in the order they go on the wire.
#[derive(Clone)]
pub struct Sealer {
    keys: DirectionKeys,
    seq: u64,
}

impl Sealer {
    pub(crate) fn new(raw: &[u8; 32], encrypt: bool) -> Self {
        Self {
            keys: DirectionKeys::new(raw, encrypt),
            seq: 0,
        }
    }

    /// Payloads are encrypted (sent from a sealed copy).
    pub fn encrypts(&self) -> bool {
        self.keys.aead.is_some()
    }

    /// Frames sealed so far.
    pub fn sealed(&self) -> u64 {
        self.seq
    }

    /// Seals the next frame: its tag, and with encryption on and a
    /// payload, the encrypted copy to send instead of `payload`.
    pub fn seal(
        &mut self,
        head: &[u8; HEADER_LEN],
        payload: &[u8],
    ) -> ([u8; TAG_LEN], Option<Vec<u8>>) {
        let seq = self.seq;
        self.seq += 1;
        match &self.keys.aead {
            None => (self.keys.tag(seq, head, payload), None),
            Some(k) => {
                let mut copy = payload.to_vec();
                let tag = k
                    .seal_in_place_separate_tag(nonce(seq), Aad::from(&head[..]), &mut copy)
                    .expect("a frame is far below AES-GCM's length limit");
                let mut t = [0u8; TAG_LEN];
                t.copy_from_slice(tag.as_ref());
                (t, (!payload.is_empty()).then_some(copy))
            }
        }
    }
}

/// Checks (and with encryption, decrypts) the frames one side receives.
#[derive(Clone)]
pub struct Opener {
    keys: DirectionKeys,
    seq: u64,
}

impl Opener {
    pub(crate) fn new(raw: &[u8; 32], encrypt: bool) -> Self {
        Self {
            keys: DirectionKeys::new(raw, encrypt),
            seq: 0,
        }
    }

    pub fn decrypts(&self) -> bool {
        self.keys.aead.is_some()
    }

    /// Checks the next frame's tag over its header and payload; with
    /// encryption, decrypts the payload in place. On failure the payload
    /// must not be used (and the connection ends).
    pub fn open(
        &mut self,
        head: &[u8; HEADER_LEN],
        tag: &[u8; TAG_LEN],
        payload: &mut [u8],
    ) -> Result<(), WireError> {
        let seq = self.seq;
        self.seq += 1;
        let ok = match &self.keys.aead {
            None => {
                let want = blake3::Hash::from_bytes({
                    let mut full = [0u8; 32];
                    full[..TAG_LEN].copy_from_slice(&self.keys.tag(seq, head, payload));
                    full
                });
                let mut got = [0u8; 32];
                got[..TAG_LEN].copy_from_slice(tag);
                // blake3::Hash compares in constant time.
                want == blake3::Hash::from_bytes(got)
            }
            Some(k) => k
                .open_in_place_separate_tag(
                    nonce(seq),
                    Aad::from(&head[..]),
                    ring::aead::Tag::from(*tag),
                    payload,
                    0..,
                )
                .is_ok(),
        };
        if ok {
            Ok(())
        } else {
            Err(WireError::Mac { seq })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(b: u8) -> [u8; HEADER_LEN] {
        [b; HEADER_LEN]
    }

    #[test]
    fn sealed_frames_open_in_order_only() {
        for encrypt in [false, true] {
            let raw = [9u8; 32];
            let mut s = Sealer::new(&raw, encrypt);
            let mut o = Opener::new(&raw, encrypt);
            let frames: Vec<(Vec<u8>, [u8; TAG_LEN])> = (0..3u8)
                .map(|i| {
                    let p = vec![i; 1000];
                    let (t, c) = s.seal(&head(i), &p);
                    assert_eq!(c.is_some(), encrypt);
                    if let Some(c) = &c {
                        assert_ne!(c, &p, "encrypted");
                    }
                    (c.unwrap_or(p), t)
                })
                .collect();
            // Frame 0 opens; frame 2 in frame 1's place does not.
            let mut p0 = frames[0].0.clone();
            o.open(&head(0), &frames[0].1, &mut p0).unwrap();
            assert_eq!(p0, vec![0u8; 1000]);
            let mut p2 = frames[2].0.clone();
            assert!(matches!(
                o.open(&head(2), &frames[2].1, &mut p2),
                Err(WireError::Mac { seq: 1 })
            ));
            // Replayed frame 0 as the next frame: refused.
            let mut o = Opener::new(&raw, encrypt);
            let mut p = frames[0].0.clone();
            o.open(&head(0), &frames[0].1, &mut p).unwrap();
            let mut p = frames[0].0.clone();
            assert!(o.open(&head(0), &frames[0].1, &mut p).is_err());
            // One bit of header or payload changed: refused.
            for flip in [0usize, 1] {
                let mut o = Opener::new(&raw, encrypt);
                let mut h = head(0);
                let mut p = frames[0].0.clone();
                if flip == 0 {
                    h[40] ^= 1;
                } else {
                    p[999] ^= 0x80;
                }
                assert!(o.open(&h, &frames[0].1, &mut p).is_err());
            }
            // Another key: refused.
            let mut o = Opener::new(&[8u8; 32], encrypt);
            let mut p = frames[0].0.clone();
            assert!(o.open(&head(0), &frames[0].1, &mut p).is_err());
        }
    }
}
