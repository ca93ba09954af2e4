//! The v2 handshake: Noise `XXpsk3` (X25519, ChaCha20-Poly1305, BLAKE2s,
//! through the `snow` crate) with the swarm key as the pre-shared key. It
//! gives each connection two fresh keys, one per direction, that frames are
//! then sealed with (see [`super::seal`]).
//!
//! The messages, in order (each side first sends its 8-byte preamble:
//! magic "GWHS" u32, version u16, role u16, none of it secret):
//! 1. connector -> acceptor, 48 bytes: its ephemeral key (and the tag of
//!    an empty payload, keyed by public values only).
//! 2. acceptor -> connector, 112 bytes: its ephemeral key, its static (node)
//!    key, and its hello (node id, flags), encrypted under the
//!    Diffie-Hellman results only: nothing here depends on the swarm key,
//!    so a stranger who connects learns nothing to guess the key against.
//! 3. connector -> acceptor, 80 bytes: its static key and hello, encrypted
//!    under keys that mix in the swarm key: the connector proves the key
//!    first, and the acceptor checks before it sends anything keyed.
//! 4. acceptor -> connector, 16 bytes: the confirmation, a tag over the
//!    handshake hash under the acceptor's new sending key: the acceptor's
//!    proof, sent only after checking message 3.
//!
//! A passive listener learns nothing to guess the swarm key offline (the
//! key is mixed in after three Diffie-Hellman results). Replaying recorded
//! messages fails: the other side's ephemeral key is new each time.

use snow::params::DHChoice;
use snow::resolvers::{CryptoResolver, DefaultResolver};

use super::WireError;

pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"GWHS");
/// The handshake (and wire) version this build speaks.
pub const HANDSHAKE_VERSION: u16 = 2;
/// Magic, version, role.
pub const PREAMBLE_LEN: usize = 8;
/// The Noise protocol the handshake runs.
pub const NOISE_PARAMS: &str = "Noise_XXpsk3_25519_ChaChaPoly_BLAKE2s";
/// Shortest swarm key accepted.
pub const MIN_KEY_LEN: usize = 16;
/// A node's static key: an X25519 private key.
pub const NODE_KEY_LEN: usize = 32;
/// The hello carried inside messages 2 and 3: node id u64, flags u32,
/// reserved u32 (0).
pub const HELLO_PAYLOAD_LEN: usize = 16;
const DH_LEN: usize = 32;
const AEAD_TAG_LEN: usize = 16;
/// In a PSK pattern even message 1's empty payload carries a tag (under
/// a key from the public values only).
pub const MSG1_LEN: usize = DH_LEN + AEAD_TAG_LEN;
pub const MSG2_LEN: usize = DH_LEN + DH_LEN + AEAD_TAG_LEN + HELLO_PAYLOAD_LEN + AEAD_TAG_LEN;
pub const MSG3_LEN: usize = DH_LEN + AEAD_TAG_LEN + HELLO_PAYLOAD_LEN + AEAD_TAG_LEN;
pub const CONFIRM_LEN: usize = 16;
/// Hello flag: this side wants frame payloads encrypted (on when either
/// side asks).
pub const HELLO_FLAG_ENCRYPT: u32 = 1;
const HELLO_KNOWN_FLAGS: u32 = HELLO_FLAG_ENCRYPT;

/// Which end of the TCP connection a side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Connector = 0,
    Acceptor = 1,
}

impl Role {
    pub fn other(self) -> Role {
        match self {
            Role::Connector => Role::Acceptor,
            Role::Acceptor => Role::Connector,
        }
    }
}

/// The shared swarm key.
#[derive(Clone)]
pub struct SwarmKey(std::sync::Arc<[u8]>);

impl std::fmt::Debug for SwarmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwarmKey({} bytes)", self.0.len())
    }
}

impl SwarmKey {
    pub fn new(bytes: &[u8]) -> Result<Self, WireError> {
        if bytes.len() < MIN_KEY_LEN {
            return Err(WireError::Handshake(format!(
                "swarm key of {} bytes is too short (at least {MIN_KEY_LEN})",
                bytes.len()
            )));
        }
        Ok(Self(bytes.into()))
    }

    /// The Noise pre-shared key: 32 bytes derived from a key of any length.
    pub(crate) fn psk(&self) -> [u8; 32] {
        blake3::derive_key("gwtf 2026 swarm key -> noise psk v2", &self.0)
    }
}

/// A node's static key pair (X25519): what its id is bound to.
#[derive(Clone)]
pub struct NodeKey {
    private: std::sync::Arc<[u8; NODE_KEY_LEN]>,
    public: [u8; NODE_KEY_LEN],
}

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeKey(public {})", hex(&self.public[..8]))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn dh() -> Box<dyn snow::types::Dh> {
    DefaultResolver
        .resolve_dh(&DHChoice::Curve25519)
        .expect("snow built with curve25519")
}

impl NodeKey {
    /// A fresh key pair from the system's random source.
    pub fn generate() -> Result<Self, WireError> {
        let mut private = [0u8; NODE_KEY_LEN];
        getrandom::fill(&mut private)
            .map_err(|e| WireError::Handshake(format!("no random source for a node key: {e}")))?;
        Self::from_private(&private)
    }

    /// The key pair of a stored private key.
    pub fn from_private(bytes: &[u8]) -> Result<Self, WireError> {
        let private: [u8; NODE_KEY_LEN] = bytes.try_into().map_err(|_| {
            WireError::Handshake(format!(
                "a node key has {NODE_KEY_LEN} bytes, not {}",
                bytes.len()
            ))
        })?;
        let mut d = dh();
        d.set(&private);
        let mut public = [0u8; NODE_KEY_LEN];
        public.copy_from_slice(d.pubkey());
        Ok(Self {
            private: std::sync::Arc::new(private),
            public,
        })
    }

    pub fn public(&self) -> &[u8; NODE_KEY_LEN] {
        &self.public
    }

    /// The node id that follows from this key ([`node_id_of`] of its
    /// public half).
    pub fn node_id(&self) -> u32 {
        node_id_of(&self.public)
    }

    /// Reads the private key stored at `path`, or creates one there (owner
    /// read and write only) when there is no file; the key, and whether it
    /// was created.
    pub fn load_or_create(path: &std::path::Path) -> Result<(Self, bool), String> {
        match std::fs::read(path) {
            Ok(bytes) => Self::from_file_bytes(&bytes)
                .map(|k| (k, false))
                .map_err(|e| format!("node key {}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = Self::generate().map_err(|e| e.to_string())?;
                match key.store_new(path) {
                    Ok(()) => Ok((key, true)),
                    // Another process created it meanwhile: its key is
                    // this node's (never two keys for one file).
                    Err(_) if path.exists() => {
                        let bytes = std::fs::read(path)
                            .map_err(|e| format!("cannot read node key {}: {e}", path.display()))?;
                        Self::from_file_bytes(&bytes)
                            .map(|k| (k, false))
                            .map_err(|e| format!("node key {}: {e}", path.display()))
                    }
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(format!("cannot read node key {}: {e}", path.display())),
        }
    }

    /// The key of a node key file's bytes: 64 hex digits (a newline may
    /// follow).
    pub fn from_file_bytes(bytes: &[u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| "not text (a node key file holds 64 hex digits)".to_string())?
            .trim_end();
        if text.len() != 2 * NODE_KEY_LEN {
            return Err(format!(
                "{} characters, not the {} hex digits of a node key",
                text.len(),
                2 * NODE_KEY_LEN
            ));
        }
        let mut private = [0u8; NODE_KEY_LEN];
        for (i, b) in private.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
                .map_err(|_| format!("not hex at character {}", 2 * i))?;
        }
        Self::from_private(&private).map_err(|e| e.to_string())
    }

    /// Writes this key to a new file (never over an existing one), owner
    /// read and write only.
    pub fn store_new(&self, path: &std::path::Path) -> Result<(), String> {
        use std::io::Write;
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        let mut f = o
            .open(path)
            .map_err(|e| format!("cannot create node key {}: {e}", path.display()))?;
        writeln!(f, "{}", hex(&self.private[..]))
            .and_then(|_| f.sync_all())
            .map_err(|e| format!("cannot write node key {}: {e}", path.display()))
    }

    /// The private key's bytes (to store it).
    pub fn private_bytes(&self) -> &[u8; NODE_KEY_LEN] {
        &self.private
    }
}

/// The node id a public key stands for: 32 bits of a keyed BLAKE3 hash,
/// never 0. The handshake checks that a peer's claimed id is the one of
/// the key it proved, so a holder of the swarm key cannot act as another
/// node (short of finding, by about 2^32 key generations, a key whose id
/// is the other node's).
pub fn node_id_of(public: &[u8; NODE_KEY_LEN]) -> u32 {
    let h = blake3::derive_key("gwtf 2026 node public key -> node id v1", public);
    match u32::from_le_bytes([h[0], h[1], h[2], h[3]]) {
        0 => 1,
        id => id,
    }
}

/// The plain first 8 bytes each side sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preamble {
    pub role: Role,
}

impl Preamble {
    pub fn encode(&self) -> [u8; PREAMBLE_LEN] {
        let mut b = [0u8; PREAMBLE_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&HANDSHAKE_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.role as u16).to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() != PREAMBLE_LEN {
            return Err(WireError::TooShort {
                what: "hello",
                need: PREAMBLE_LEN,
                got: b.len(),
            });
        }
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != HELLO_MAGIC {
            return Err(WireError::BadMagic {
                what: "hello",
                got: magic,
            });
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != HANDSHAKE_VERSION {
            return Err(WireError::UnsupportedVersion {
                what: "hello",
                got: version,
            });
        }
        let role = match u16::from_le_bytes([b[6], b[7]]) {
            0 => Role::Connector,
            1 => Role::Acceptor,
            v => {
                return Err(WireError::BadField {
                    field: "hello.role",
                    value: v as u64,
                })
            }
        };
        Ok(Self { role })
    }
}

/// What each side says about itself, inside the encrypted handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub node_id: u64,
    pub flags: u32,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_PAYLOAD_LEN] {
        let mut b = [0u8; HELLO_PAYLOAD_LEN];
        b[0..8].copy_from_slice(&self.node_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() != HELLO_PAYLOAD_LEN {
            return Err(WireError::TooShort {
                what: "hello payload",
                need: HELLO_PAYLOAD_LEN,
                got: b.len(),
            });
        }
        let node_id = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
        let flags = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        if flags & !HELLO_KNOWN_FLAGS != 0 {
            return Err(WireError::UnknownFlags(flags));
        }
        if b[12..16] != [0; 4] {
            return Err(WireError::ReservedNotZero("hello.reserved"));
        }
        Ok(Self { node_id, flags })
    }
}

/// One side's Noise handshake state.
pub struct Noise {
    state: snow::HandshakeState,
}

fn noise_err(what: &str, e: snow::Error) -> WireError {
    WireError::Handshake(format!("{what}: {e}"))
}

impl Noise {
    /// `ephemeral`: a fixed ephemeral private key, for tests only (a
    /// reproducible transcript); `None` draws a fresh one.
    pub fn new(
        role: Role,
        key: &SwarmKey,
        node: &NodeKey,
        ephemeral: Option<&[u8; 32]>,
    ) -> Result<Self, WireError> {
        let params = NOISE_PARAMS.parse().expect("valid noise parameters");
        let psk = key.psk();
        let mut b = snow::Builder::new(params)
            .local_private_key(&node.private[..])
            .and_then(|b| b.psk(3, &psk))
            .map_err(|e| noise_err("setting up", e))?;
        if let Some(e) = ephemeral {
            b = b.fixed_ephemeral_key_for_testing_only(e);
        }
        let state = match role {
            Role::Connector => b.build_initiator(),
            Role::Acceptor => b.build_responder(),
        }
        .map_err(|e| noise_err("setting up", e))?;
        Ok(Self { state })
    }

    /// Writes the next message (with `payload`) into `out`.
    pub fn write(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Result<(), WireError> {
        let mut buf = [0u8; MSG2_LEN];
        let n = self
            .state
            .write_message(payload, &mut buf)
            .map_err(|e| noise_err("writing", e))?;
        out.extend_from_slice(&buf[..n]);
        Ok(())
    }

    /// Reads the peer's next message; returns its payload.
    pub fn read(&mut self, msg: &[u8]) -> Result<Vec<u8>, WireError> {
        let mut buf = [0u8; MSG2_LEN];
        let n = self
            .state
            .read_message(msg, &mut buf)
            // A message that does not decrypt: the wrong swarm key, or a
            // tampered or replayed message.
            .map_err(|_| WireError::AuthFailed)?;
        Ok(buf[..n].to_vec())
    }

    /// The peer's static key (after message 2 for the connector, 3 for the
    /// acceptor).
    pub fn remote_static(&self) -> Option<[u8; NODE_KEY_LEN]> {
        self.state.get_remote_static()?.try_into().ok()
    }

    /// The hash of the whole handshake, the same at both ends.
    pub fn handshake_hash(&self) -> [u8; 32] {
        let mut h = [0u8; 32];
        let src = self.state.get_handshake_hash();
        let n = src.len().min(32);
        h[..n].copy_from_slice(&src[..n]);
        h
    }

    /// The two directions' keys (connector to acceptor, acceptor to
    /// connector), once the handshake is finished.
    pub fn split(&mut self) -> ([u8; 32], [u8; 32]) {
        self.state.dangerously_get_raw_split()
    }
}
