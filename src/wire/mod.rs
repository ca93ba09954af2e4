//! The v2 wire format: the frame header, control-message codecs, the
//! Noise handshake, frame sealing (a tag on every frame, optional
//! encryption) and the connection as a sans-I/O state machine.
//! Pure: no I/O, no clocks, no threads; the main fuzz surface.

pub mod conn;
pub mod control;
mod error;
pub mod handshake;
pub mod harness;
pub mod header;
pub mod seal;

pub use conn::{
    encode_control_frame, seal_frames, slice_head, sliced_head, ConnEvent, ConnOptions, Connection,
    ReadTarget, MAX_SLICE_LEN,
};
pub use control::{ControlEnvelope, Goodbye, GoodbyeReason, Heartbeat};
pub use error::WireError;
pub use handshake::{node_id_of, NodeKey, Role, SwarmKey};
pub use header::{
    crc32c, crc32c_append, Dtype, FrameHeader, FrameKind, FLAG_PAYLOAD_CRC, FRAME_MAGIC,
    HEADER_LEN, WIRE_VERSION,
};
pub use seal::{HEAD_LEN, TAG_LEN};
