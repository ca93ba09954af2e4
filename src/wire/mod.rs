//! The v1 wire format: the frame header, control-message codecs, the
//! authenticated handshake and the connection as a sans-I/O state machine.
//! Pure: no I/O, no clocks, no threads; the main fuzz surface.

pub mod conn;
pub mod control;
mod error;
pub mod handshake;
pub mod header;

pub use conn::{
    encode_control_frame, slice_head, sliced_head, ConnEvent, Connection, ReadTarget, MAX_SLICE_LEN,
};
pub use control::{ControlEnvelope, Goodbye, GoodbyeReason, Heartbeat};
pub use error::WireError;
pub use handshake::{Role, SwarmKey};
pub use header::{
    crc32c, crc32c_append, Dtype, FrameHeader, FrameKind, FLAG_PAYLOAD_CRC, FRAME_MAGIC,
    HEADER_LEN, WIRE_VERSION,
};
