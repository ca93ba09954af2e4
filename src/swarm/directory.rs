//! Who is where: the directory message a runtime node sends first on every
//! connection (its stage, its listening address, and the peers it knows),
//! so that any peer the protocol names can be reached.
//!
//! It travels as a control frame of its own `msg_type` ([`DIRECTORY_MSG`],
//! outside the protocol's message kinds): `count u16`, then per peer
//! `id u32`, `stage u16`, `addr_len u8`, `addr` (text).
use crate::protocol::{NodeId, Stage};
use crate::wire::ControlEnvelope;
use std::net::SocketAddr;

/// `msg_type` of the directory message.
pub const DIRECTORY_MSG: u16 = 0x8000;
/// Peers one directory message carries at most.
pub const DIRECTORY_MAX: usize = 512;
/// The stage of a joiner's entry before the swarm chose its stage: no
/// stage (it claims none).
pub const NO_STAGE: Stage = Stage::MAX;

/// A swarm member as the directory knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub id: NodeId,
    pub stage: Stage,
    pub addr: SocketAddr,
}

/// The directory message of `me`, who knows `others`.
pub fn message<'a>(me: &'a Peer, others: impl Iterator<Item = &'a Peer>) -> ControlEnvelope {
    let mut body = Vec::new();
    let entries: Vec<&Peer> = std::iter::once(me)
        .chain(others)
        .take(DIRECTORY_MAX)
        .collect();
    body.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    for p in entries {
        body.extend_from_slice(&p.id.to_le_bytes());
        body.extend_from_slice(&p.stage.to_le_bytes());
        let a = p.addr.to_string();
        body.push(a.len() as u8);
        body.extend_from_slice(a.as_bytes());
    }
    ControlEnvelope {
        msg_type: DIRECTORY_MSG,
        msg_version: 1,
        body,
    }
}

/// Parses a directory message's body.
pub fn parse(mut body: &[u8]) -> Result<Vec<Peer>, String> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
        if b.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Ok(head)
    }
    let count = u16::from_le_bytes(take(&mut body, 2)?.try_into().expect("2 bytes")) as usize;
    if count > DIRECTORY_MAX || count * 7 > body.len() {
        return Err(format!("{count} entries in {} bytes", body.len()));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let id = u32::from_le_bytes(take(&mut body, 4)?.try_into().expect("4 bytes"));
        let stage = u16::from_le_bytes(take(&mut body, 2)?.try_into().expect("2 bytes"));
        let len = take(&mut body, 1)?[0] as usize;
        let text = std::str::from_utf8(take(&mut body, len)?).map_err(|_| "address is not text")?;
        let addr = text.parse().map_err(|_| format!("bad address {text:?}"))?;
        out.push(Peer { id, stage, addr });
    }
    if !body.is_empty() {
        return Err(format!("{} trailing bytes", body.len()));
    }
    Ok(out)
}
