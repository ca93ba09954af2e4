//! Small codecs for control payloads: heartbeat, goodbye, and the generic
//! typed envelope the GWTF protocol uses for its own messages.
//!
//! All little-endian; decoders check every length against the bytes present
//! and against fixed limits, never allocate more than the input holds, and
//! reject trailing bytes.

use super::WireError;

/// Largest control payload (envelope body included) accepted from a peer.
pub const MAX_CONTROL_PAYLOAD: usize = 64 * 1024;
/// Largest goodbye message text.
pub const MAX_GOODBYE_TEXT: usize = 512;

fn take<'a>(buf: &mut &'a [u8], n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
    if buf.len() < n {
        return Err(WireError::TooShort {
            what,
            need: n,
            got: buf.len(),
        });
    }
    let (head, rest) = buf.split_at(n);
    *buf = rest;
    Ok(head)
}

fn u16_of(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}
fn u32_of(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}
fn u64_of(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn no_trailing(buf: &[u8], what: &'static str) -> Result<(), WireError> {
    if buf.is_empty() {
        Ok(())
    } else {
        Err(WireError::TrailingBytes {
            what,
            extra: buf.len(),
        })
    }
}

/// Liveness message, sent when a link has been idle for the heartbeat interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    pub seq: u64,
    /// Sender's monotonic clock in microseconds (for RTT estimates).
    pub sent_at_us: u64,
}

impl Heartbeat {
    pub const LEN: usize = 16;
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::LEN);
        v.extend_from_slice(&self.seq.to_le_bytes());
        v.extend_from_slice(&self.sent_at_us.to_le_bytes());
        v
    }
    pub fn decode(mut buf: &[u8]) -> Result<Self, WireError> {
        let b = take(&mut buf, Self::LEN, "heartbeat")?;
        no_trailing(buf, "heartbeat")?;
        Ok(Self {
            seq: u64_of(&b[0..8]),
            sent_at_us: u64_of(&b[8..16]),
        })
    }
}

/// Why a peer says goodbye.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoodbyeReason {
    /// The node is shutting down.
    Shutdown = 0,
    /// The node closes this one link.
    Disconnect = 1,
    /// The node found an error on this link.
    Error = 2,
}

/// A peer announces that it closes the connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Goodbye {
    pub reason: GoodbyeReason,
    pub message: String,
}

impl Goodbye {
    pub fn encode(&self) -> Vec<u8> {
        let mut text = self.message.as_bytes();
        if text.len() > MAX_GOODBYE_TEXT {
            let mut end = MAX_GOODBYE_TEXT;
            while !self.message.is_char_boundary(end) {
                end -= 1;
            }
            text = &text[..end];
        }
        let mut v = Vec::with_capacity(4 + text.len());
        v.extend_from_slice(&(self.reason as u16).to_le_bytes());
        v.extend_from_slice(&(text.len() as u16).to_le_bytes());
        v.extend_from_slice(text);
        v
    }
    pub fn decode(mut buf: &[u8]) -> Result<Self, WireError> {
        let b = take(&mut buf, 4, "goodbye")?;
        let reason = match u16_of(&b[0..2]) {
            0 => GoodbyeReason::Shutdown,
            1 => GoodbyeReason::Disconnect,
            2 => GoodbyeReason::Error,
            v => {
                return Err(WireError::BadField {
                    field: "goodbye.reason",
                    value: v as u64,
                })
            }
        };
        let len = u16_of(&b[2..4]) as usize;
        if len > MAX_GOODBYE_TEXT {
            return Err(WireError::BadField {
                field: "goodbye.len",
                value: len as u64,
            });
        }
        let text = take(&mut buf, len, "goodbye text")?;
        no_trailing(buf, "goodbye")?;
        let message = std::str::from_utf8(text)
            .map_err(|_| WireError::BadUtf8("goodbye text"))?
            .to_string();
        Ok(Self { reason, message })
    }
}

/// A typed control message: the protocol layer owns the meaning of
/// `msg_type`/`msg_version` and the body's encoding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlEnvelope {
    pub msg_type: u16,
    pub msg_version: u16,
    pub body: Vec<u8>,
}

impl ControlEnvelope {
    pub const HEADER_LEN: usize = 8;
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        if self.body.len() > MAX_CONTROL_PAYLOAD - Self::HEADER_LEN {
            return Err(WireError::BadField {
                field: "control.body_len",
                value: self.body.len() as u64,
            });
        }
        let mut v = Vec::with_capacity(Self::HEADER_LEN + self.body.len());
        v.extend_from_slice(&self.msg_type.to_le_bytes());
        v.extend_from_slice(&self.msg_version.to_le_bytes());
        v.extend_from_slice(&(self.body.len() as u32).to_le_bytes());
        v.extend_from_slice(&self.body);
        Ok(v)
    }
    pub fn decode(mut buf: &[u8]) -> Result<Self, WireError> {
        let b = take(&mut buf, Self::HEADER_LEN, "control envelope")?;
        let len = u32_of(&b[4..8]) as usize;
        if len > MAX_CONTROL_PAYLOAD - Self::HEADER_LEN {
            return Err(WireError::BadField {
                field: "control.body_len",
                value: len as u64,
            });
        }
        let body = take(&mut buf, len, "control body")?;
        no_trailing(buf, "control envelope")?;
        Ok(Self {
            msg_type: u16_of(&b[0..2]),
            msg_version: u16_of(&b[2..4]),
            body: body.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrips() {
        let h = Heartbeat {
            seq: 5,
            sent_at_us: 123456,
        };
        assert_eq!(Heartbeat::decode(&h.encode()).unwrap(), h);
        let g = Goodbye {
            reason: GoodbyeReason::Disconnect,
            message: "bye é".into(),
        };
        assert_eq!(Goodbye::decode(&g.encode()).unwrap(), g);
        let c = ControlEnvelope {
            msg_type: 3,
            msg_version: 1,
            body: vec![1, 2, 3],
        };
        assert_eq!(ControlEnvelope::decode(&c.encode().unwrap()).unwrap(), c);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(matches!(
            Heartbeat::decode(&[0; 15]),
            Err(WireError::TooShort { .. })
        ));
        assert!(matches!(
            Heartbeat::decode(&[0; 17]),
            Err(WireError::TrailingBytes { .. })
        ));
        assert!(matches!(
            Goodbye::decode(&[9, 0, 0, 0]),
            Err(WireError::BadField { .. })
        ));
        assert!(matches!(
            Goodbye::decode(&[0, 0, 2, 0, 0xff, 0xfe]),
            Err(WireError::BadUtf8(_))
        ));
        assert!(matches!(
            Goodbye::decode(&[0, 0, 0xff, 0xff]),
            Err(WireError::BadField { .. })
        ));
        // A huge announced body is refused before anything is allocated.
        assert!(matches!(
            ControlEnvelope::decode(&[1, 0, 1, 0, 0xff, 0xff, 0xff, 0xff]),
            Err(WireError::BadField { .. })
        ));
        assert!(matches!(
            ControlEnvelope::decode(&[1, 0, 1, 0, 4, 0, 0, 0, 1]),
            Err(WireError::TooShort { .. })
        ));
    }
}
