//! The v1 frame header: 96 bytes, little-endian, one `#[repr(C)]` struct that
//! is also the C type `gwtf_frame_header`.
//!
//! Layout (byte offsets): magic 0, version 4, kind 6, flags 8, stage 12,
//! sender 16, microbatch 24, iteration 32, dtype 40, ndim 42, reserved 44,
//! shape 48..80, payload_len 80, payload_crc 88, header_crc 92. `header_crc` is
//! the CRC32C of bytes 0..92; `payload_crc` is the CRC32C of the payload when
//! `FLAG_PAYLOAD_CRC` is set, else 0.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use super::WireError;

/// "GWTF" as little-endian bytes.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"GWTF");
/// The wire version this build speaks.
pub const WIRE_VERSION: u16 = 2;
/// Size of the encoded header in bytes.
pub const HEADER_LEN: usize = 96;
/// The payload carries a CRC32C in `payload_crc`.
pub const FLAG_PAYLOAD_CRC: u32 = 1;
/// Every flag bit this version defines.
pub const KNOWN_FLAGS: u32 = FLAG_PAYLOAD_CRC;
/// Most dimensions a shape may have.
pub const MAX_DIMS: usize = 4;

/// The v1 frame header (`gwtf_frame_header` in C): 96 bytes, little-endian
/// on the wire, in host order in memory (encode/decode convert; on
/// little-endian hosts the two are the same bytes).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct FrameHeader {
    /// `GWTF_FRAME_MAGIC` ("GWTF" as little-endian bytes).
    pub magic: u32,
    /// Wire version, `GWTF_WIRE_VERSION`.
    pub version: u16,
    /// A `GWTF_FRAME_KIND_*` value.
    pub kind: u16,
    /// `GWTF_FRAME_FLAG_*` bits.
    pub flags: u32,
    /// Pipeline stage the payload belongs to.
    pub stage: u32,
    /// Node id of the sender (set by the library on send).
    pub sender: u64,
    /// Microbatch id.
    pub microbatch: u64,
    /// Training iteration.
    pub iteration: u64,
    /// A `GWTF_DTYPE_*` value (0: raw bytes, no shape check).
    pub dtype: u16,
    /// Number of dimensions used in `shape` (0..=4).
    pub ndim: u16,
    /// Must be 0.
    pub reserved: u32,
    /// Tensor shape; entries past `ndim` must be 0.
    pub shape: [u64; 4],
    /// Payload length in bytes (set by the library on send).
    pub payload_len: u64,
    /// CRC32C of the payload when `GWTF_FRAME_FLAG_PAYLOAD_CRC` is set, else 0.
    pub payload_crc: u32,
    /// CRC32C of the first 92 header bytes (set by the library on send).
    pub header_crc: u32,
}

const _: () = assert!(std::mem::size_of::<FrameHeader>() == HEADER_LEN);

/// What a frame carries.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A tensor (activation or gradient) in the payload.
    Data = 1,
    /// Liveness; payload is a [`super::Heartbeat`].
    Heartbeat = 2,
    /// The sender is closing; payload is a [`super::Goodbye`].
    Goodbye = 3,
    /// A typed control message; payload is a [`super::ControlEnvelope`].
    Control = 4,
    /// Opens a data frame whose payload follows in [`FrameKind::Slice`]
    /// frames, between which control frames may travel (so that a long
    /// payload never holds back heartbeats and control messages). Its
    /// header is the data frame's (payload length, checksum, shape); no
    /// payload bytes follow it directly. The engine's own; never handed to
    /// a user (the frame is delivered as `Data`).
    Sliced = 5,
    /// The next `payload_len` bytes (1..=`MAX_SLICE_LEN`) of the open
    /// sliced frame's payload; every other header field is 0.
    Slice = 6,
}

impl FrameKind {
    pub fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            1 => Self::Data,
            2 => Self::Heartbeat,
            3 => Self::Goodbye,
            4 => Self::Control,
            5 => Self::Sliced,
            6 => Self::Slice,
            _ => return None,
        })
    }
}

/// Element types of a tensor payload.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bytes = 0,
    F32 = 1,
    F16 = 2,
    Bf16 = 3,
    F64 = 4,
    I32 = 5,
    I64 = 6,
    U8 = 7,
    I8 = 8,
}

impl Dtype {
    pub fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            0 => Self::Bytes,
            1 => Self::F32,
            2 => Self::F16,
            3 => Self::Bf16,
            4 => Self::F64,
            5 => Self::I32,
            6 => Self::I64,
            7 => Self::U8,
            8 => Self::I8,
            _ => return None,
        })
    }
    pub fn size(self) -> u64 {
        match self {
            Self::Bytes | Self::U8 | Self::I8 => 1,
            Self::F16 | Self::Bf16 => 2,
            Self::F32 | Self::I32 => 4,
            Self::F64 | Self::I64 => 8,
        }
    }
}

/// CRC32C (Castagnoli), hardware-accelerated where the CPU has it.
pub fn crc32c(data: &[u8]) -> u32 {
    ::crc32c::crc32c(data)
}

/// Continues a CRC32C over more bytes.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    ::crc32c::crc32c_append(crc, data)
}

impl FrameHeader {
    /// A data header with the fixed fields set and everything else zero.
    pub fn data() -> Self {
        Self {
            magic: FRAME_MAGIC,
            version: WIRE_VERSION,
            kind: FrameKind::Data as u16,
            ..Self::default()
        }
    }

    /// A header of `kind` for a payload of `len` bytes.
    pub fn new(kind: FrameKind, sender: u64, len: u64) -> Self {
        Self {
            magic: FRAME_MAGIC,
            version: WIRE_VERSION,
            kind: kind as u16,
            sender,
            payload_len: len,
            ..Self::default()
        }
    }

    fn to_le(self) -> Self {
        Self {
            magic: self.magic.to_le(),
            version: self.version.to_le(),
            kind: self.kind.to_le(),
            flags: self.flags.to_le(),
            stage: self.stage.to_le(),
            sender: self.sender.to_le(),
            microbatch: self.microbatch.to_le(),
            iteration: self.iteration.to_le(),
            dtype: self.dtype.to_le(),
            ndim: self.ndim.to_le(),
            reserved: self.reserved.to_le(),
            shape: self.shape.map(u64::to_le),
            payload_len: self.payload_len.to_le(),
            payload_crc: self.payload_crc.to_le(),
            header_crc: self.header_crc.to_le(),
        }
    }

    /// The wire bytes, with `header_crc` computed over the first 92 bytes
    /// (the `header_crc` field of `self` is ignored).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let le = self.to_le();
        out.copy_from_slice(le.as_bytes());
        let crc = crc32c(&out[..HEADER_LEN - 4]);
        out[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and validates a header: magic, checksum, version, kind, flags,
    /// dtype and shape, and the payload length against `max_payload` (before
    /// anything is allocated for it). Never panics.
    pub fn decode(bytes: &[u8], max_payload: u64) -> Result<Self, WireError> {
        if bytes.len() < HEADER_LEN {
            return Err(WireError::TooShort {
                what: "frame header",
                need: HEADER_LEN,
                got: bytes.len(),
            });
        }
        let bytes = &bytes[..HEADER_LEN];
        let h = Self::read_from_bytes(bytes)
            .map_err(|_| WireError::TooShort {
                what: "frame header",
                need: HEADER_LEN,
                got: bytes.len(),
            })?
            .to_le(); // to_le is its own inverse
        if h.magic != FRAME_MAGIC {
            return Err(WireError::BadMagic {
                what: "frame header",
                got: h.magic,
            });
        }
        let computed = crc32c(&bytes[..HEADER_LEN - 4]);
        if computed != h.header_crc {
            return Err(WireError::HeaderChecksum {
                expected: h.header_crc,
                computed,
            });
        }
        if h.version != WIRE_VERSION {
            return Err(WireError::UnsupportedVersion {
                what: "frame header",
                got: h.version,
            });
        }
        h.validate(max_payload)?;
        Ok(h)
    }

    /// The checks that do not involve the encoding (also run before a send).
    pub fn validate(&self, max_payload: u64) -> Result<(), WireError> {
        let kind = FrameKind::from_u16(self.kind).ok_or(WireError::UnknownKind(self.kind))?;
        if self.flags & !KNOWN_FLAGS != 0 {
            return Err(WireError::UnknownFlags(self.flags & !KNOWN_FLAGS));
        }
        if self.flags & FLAG_PAYLOAD_CRC == 0 && self.payload_crc != 0 {
            return Err(WireError::ReservedNotZero(
                "payload_crc (without GWTF_FRAME_FLAG_PAYLOAD_CRC)",
            ));
        }
        if self.reserved != 0 {
            return Err(WireError::ReservedNotZero("reserved"));
        }
        if self.payload_len > max_payload {
            return Err(WireError::PayloadTooLarge {
                len: self.payload_len,
                max: max_payload,
            });
        }
        let dtype = Dtype::from_u16(self.dtype).ok_or(WireError::UnknownDtype(self.dtype))?;
        let ndim = self.ndim as usize;
        if ndim > MAX_DIMS {
            return Err(WireError::BadShape(format!("ndim {ndim} > {MAX_DIMS}")));
        }
        if self.shape[ndim..].iter().any(|&d| d != 0) {
            return Err(WireError::BadShape(
                "dimensions past ndim must be 0".to_string(),
            ));
        }
        let data = matches!(kind, FrameKind::Data | FrameKind::Sliced);
        if data && ndim > 0 {
            let elems = self.shape[..ndim]
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .and_then(|e| e.checked_mul(dtype.size()));
            if elems != Some(self.payload_len) {
                return Err(WireError::BadShape(format!(
                    "shape {:?} of {:?} does not describe {} bytes",
                    &self.shape[..ndim],
                    dtype,
                    self.payload_len
                )));
            }
        } else if !data && (ndim != 0 || self.dtype != 0) {
            return Err(WireError::BadShape(
                "control frames carry no shape or dtype".to_string(),
            ));
        }
        Ok(())
    }

    pub fn frame_kind(&self) -> Option<FrameKind> {
        FrameKind::from_u16(self.kind)
    }

    pub fn has_payload_crc(&self) -> bool {
        self.flags & FLAG_PAYLOAD_CRC != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> FrameHeader {
        let mut h = FrameHeader::data();
        h.sender = 7;
        h.microbatch = 9;
        h.iteration = 3;
        h.stage = 2;
        h.dtype = Dtype::F32 as u16;
        h.ndim = 2;
        h.shape = [3, 5, 0, 0];
        h.payload_len = 60;
        h
    }

    #[test]
    fn roundtrip_and_layout() {
        let h = sample();
        let bytes = h.encode();
        assert_eq!(&bytes[0..4], b"GWTF");
        assert_eq!(u64::from_le_bytes(bytes[80..88].try_into().unwrap()), 60);
        let d = FrameHeader::decode(&bytes, 1 << 20).unwrap();
        assert_eq!(d.header_crc, crc32c(&bytes[..92]));
        assert_eq!(FrameHeader { header_crc: 0, ..d }, h);
    }

    #[test]
    fn every_single_bit_flip_is_caught() {
        let bytes = sample().encode();
        for i in 0..HEADER_LEN * 8 {
            let mut b = bytes;
            b[i / 8] ^= 1 << (i % 8);
            assert!(FrameHeader::decode(&b, 1 << 20).is_err(), "bit {i}");
        }
    }

    #[test]
    fn typed_errors() {
        let max = 1 << 20;
        let mut h = sample();
        h.magic = 1;
        assert!(matches!(
            FrameHeader::decode(&h.encode(), max),
            Err(WireError::BadMagic { .. })
        ));
        let mut h = sample();
        h.version = 1;
        assert!(matches!(
            FrameHeader::decode(&h.encode(), max),
            Err(WireError::UnsupportedVersion { got: 1, .. })
        ));
        let mut h = sample();
        h.kind = 99;
        assert_eq!(
            FrameHeader::decode(&h.encode(), max),
            Err(WireError::UnknownKind(99))
        );
        let mut h = sample();
        h.ndim = 0;
        h.shape = [0; 4];
        h.payload_len = u64::MAX;
        let e = FrameHeader::decode(&h.encode(), max).unwrap_err();
        assert!(matches!(e, WireError::PayloadTooLarge { .. }), "{e}");
        assert!(e.to_string().contains("exceeds the limit"));
        let mut h = sample();
        h.shape = [u64::MAX, u64::MAX, 0, 0];
        assert!(matches!(
            FrameHeader::decode(&h.encode(), max),
            Err(WireError::BadShape(_))
        ));
        let mut h = sample();
        h.ndim = 9;
        assert!(matches!(
            FrameHeader::decode(&h.encode(), max),
            Err(WireError::BadShape(_))
        ));
        assert!(matches!(
            FrameHeader::decode(&[0u8; 10], max),
            Err(WireError::TooShort { got: 10, .. })
        ));
        let mut b = sample().encode();
        b[50] ^= 1;
        assert!(matches!(
            FrameHeader::decode(&b, max),
            Err(WireError::HeaderChecksum { .. })
        ));
    }
}
