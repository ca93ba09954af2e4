//! The authenticated handshake: both sides send a Hello with a fresh random
//! nonce, then each proves knowledge of the swarm key with an HMAC-SHA256 over
//! both nonces, both node ids and a direction label. A peer without the key
//! cannot produce the proof; a replayed proof fails because the other side's
//! nonce is new; the ids are bound because the MAC covers them.
//!
//! Hello (48 bytes): magic "GWHS" u32, version u16, role u16 (0 connector,
//! 1 acceptor), node id u64, nonce [u8; 32]. Auth (32 bytes): the MAC.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::WireError;

pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"GWHS");
pub const HANDSHAKE_VERSION: u16 = 1;
pub const HELLO_LEN: usize = 48;
pub const AUTH_LEN: usize = 32;
pub const NONCE_LEN: usize = 32;
/// Shortest swarm key accepted.
pub const MIN_KEY_LEN: usize = 16;

/// Which end of the TCP connection a side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Connector = 0,
    Acceptor = 1,
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    pub node_id: u64,
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&HANDSHAKE_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.role as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.node_id.to_le_bytes());
        b[16..48].copy_from_slice(&self.nonce);
        b
    }
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() != HELLO_LEN {
            return Err(WireError::TooShort {
                what: "hello",
                need: HELLO_LEN,
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
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[16..48]);
        Ok(Self {
            role,
            node_id: u64::from_le_bytes(id),
            nonce,
        })
    }
}

/// The transcript both sides MAC: connector's hello fields, then acceptor's.
pub struct Transcript {
    pub connector_id: u64,
    pub connector_nonce: [u8; NONCE_LEN],
    pub acceptor_id: u64,
    pub acceptor_nonce: [u8; NONCE_LEN],
}

fn mac_for(key: &SwarmKey, prover: Role, t: &Transcript) -> Hmac<Sha256> {
    // HMAC accepts keys of any length.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&key.0).expect("hmac takes any key length");
    m.update(b"gwtf handshake v1\0");
    m.update(match prover {
        Role::Connector => b"connector->acceptor",
        Role::Acceptor => b"acceptor->connector",
    });
    m.update(&t.connector_nonce);
    m.update(&t.acceptor_nonce);
    m.update(&t.connector_id.to_le_bytes());
    m.update(&t.acceptor_id.to_le_bytes());
    m
}

/// The proof that `prover` knows the key.
pub fn prove(key: &SwarmKey, prover: Role, t: &Transcript) -> [u8; AUTH_LEN] {
    mac_for(key, prover, t).finalize().into_bytes().into()
}

/// Checks the peer's proof in constant time.
pub fn verify(key: &SwarmKey, prover: Role, t: &Transcript, mac: &[u8]) -> Result<(), WireError> {
    mac_for(key, prover, t)
        .verify_slice(mac)
        .map_err(|_| WireError::AuthFailed)
}
