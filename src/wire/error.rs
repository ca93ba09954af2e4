//! Typed decode and protocol errors: every failure says what and why.

use std::fmt;

/// Why a header, a control message or a byte stream was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    /// Fewer bytes than the fixed size of the thing being decoded.
    TooShort {
        what: &'static str,
        need: usize,
        got: usize,
    },
    /// Bytes left over after a complete message.
    TrailingBytes { what: &'static str, extra: usize },
    /// The magic number is not ours (not a gwtf peer, or a desynchronised stream).
    BadMagic { what: &'static str, got: u32 },
    /// A protocol version this build does not speak.
    UnsupportedVersion { what: &'static str, got: u16 },
    /// An unknown frame kind.
    UnknownKind(u16),
    /// Flag bits this version does not define.
    UnknownFlags(u32),
    /// An unknown element type.
    UnknownDtype(u16),
    /// The header checksum does not match (corrupted or forged header).
    HeaderChecksum { expected: u32, computed: u32 },
    /// The payload checksum does not match.
    PayloadChecksum { expected: u32, computed: u32 },
    /// The announced payload is larger than the configured limit.
    PayloadTooLarge { len: u64, max: u64 },
    /// The shape is malformed or does not describe the payload length.
    BadShape(String),
    /// A reserved field is not zero.
    ReservedNotZero(&'static str),
    /// A field has a value outside its range.
    BadField { field: &'static str, value: u64 },
    /// Text that is not UTF-8.
    BadUtf8(&'static str),
    /// The handshake failed (bad MAC, wrong role, self connection).
    Handshake(String),
    /// The peer's proof of the swarm key did not verify.
    AuthFailed,
    /// A frame's tag did not verify (changed, replayed, reordered or
    /// forged on the way); `seq` is the frame's place in the stream.
    Mac { seq: u64 },
    /// A message arrived in a state where it is not allowed.
    Unexpected(String),
    /// The peer claimed a node id that is not the one of the key it
    /// proved (ids follow from node keys).
    IdNotBound { claimed: u64, key_id: u64 },
    /// A node id connected before with another key (whose id is the same:
    /// a key found by trying keys until one hashes to the id).
    KeyChanged { id: u64 },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use WireError::*;
        match self {
            TooShort { what, need, got } => {
                write!(f, "{what}: truncated ({got} bytes, {need} needed)")
            }
            TrailingBytes { what, extra } => write!(f, "{what}: {extra} unexpected trailing bytes"),
            BadMagic { what, got } => write!(f, "{what}: bad magic 0x{got:08x}"),
            UnsupportedVersion { what, got } => write!(
                f,
                "{what}: unsupported version {got} (this build speaks version {})",
                super::handshake::HANDSHAKE_VERSION
            ),
            UnknownKind(k) => write!(f, "frame header: unknown kind {k}"),
            UnknownFlags(x) => write!(f, "frame header: unknown flag bits 0x{x:x}"),
            UnknownDtype(d) => write!(f, "frame header: unknown dtype {d}"),
            HeaderChecksum { expected, computed } => write!(
                f,
                "frame header: bad header checksum (carried 0x{expected:08x}, computed 0x{computed:08x})"
            ),
            PayloadChecksum { expected, computed } => write!(
                f,
                "frame payload: bad checksum (carried 0x{expected:08x}, computed 0x{computed:08x})"
            ),
            PayloadTooLarge { len, max } => {
                write!(f, "frame header: payload length {len} exceeds the limit {max}")
            }
            BadShape(why) => write!(f, "frame header: bad shape: {why}"),
            ReservedNotZero(field) => write!(f, "reserved field {field} is not zero"),
            BadField { field, value } => write!(f, "field {field} has invalid value {value}"),
            BadUtf8(what) => write!(f, "{what}: text is not UTF-8"),
            Handshake(why) => write!(f, "handshake: {why}"),
            AuthFailed => write!(
                f,
                "handshake: authentication failed (wrong swarm key, or a replayed handshake)"
            ),
            Mac { seq } => write!(
                f,
                "frame {seq}: tag does not verify (changed, replayed or reordered on the way)"
            ),
            Unexpected(why) => write!(f, "unexpected message: {why}"),
            IdNotBound { claimed, key_id } => write!(
                f,
                "handshake: the peer claims node id {claimed:x}, but the key it proved is node \
                 {key_id:x}'s (ids follow from node keys)"
            ),
            KeyChanged { id } => write!(
                f,
                "handshake: node {id:x} connected before with another key (of the same id: \
                 one found by trying keys?)"
            ),
        }
    }
}

impl std::error::Error for WireError {}
