//! `gwtf_frame`: a frame to send (allocated from a node's pool) or a received
//! one (a lease on a pool slot), and `gwtf_frame_header`, the v1 wire header.

use parking_lot::Mutex;

use super::boundary::{
    check_handle, free_handle, guard, guard_handle, require_out, write_out, FfiError, FfiHandle,
    FfiResult, HandleHeader,
};
use super::error::gwtf_error;
use super::status::gwtf_status;
use crate::engine::Frame;
use crate::wire::FrameHeader;

/// "GWTF" as a little-endian `uint32_t`: the `magic` of every frame header.
pub const GWTF_FRAME_MAGIC: u32 = 0x4654_5747;
/// The wire version this library speaks (`gwtf_frame_header.version`).
pub const GWTF_WIRE_VERSION: u32 = 2;
/// Size of the encoded frame header in bytes (== sizeof(gwtf_frame_header)).
pub const GWTF_FRAME_HEADER_LEN: u32 = 96;
/// Flag: the payload carries a CRC32C. Set it on a frame to ask for a
/// checksum even above the node's `payload_crc_max_bytes`.
pub const GWTF_FRAME_FLAG_PAYLOAD_CRC: u32 = 1;
/// Most dimensions a frame's shape may have (`gwtf_frame_header.shape`).
pub const GWTF_FRAME_MAX_DIMS: u32 = 4;

/// Kinds of frames (`gwtf_frame_header.kind`); trainers send data frames.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gwtf_frame_kind {
    /// A tensor (activation or gradient).
    Data = 1,
    /// Liveness (internal).
    Heartbeat = 2,
    /// A closing peer (internal).
    Goodbye = 3,
    /// A typed control message (internal).
    Control = 4,
}

/// Element types (`gwtf_frame_header.dtype`). With `ndim > 0`, the shape
/// times the element size must equal the payload length.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gwtf_dtype {
    /// Raw bytes (no shape check when ndim is 0).
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

const _: () = assert!(std::mem::size_of::<FrameHeader>() == GWTF_FRAME_HEADER_LEN as usize);
const _: () = assert!(crate::wire::header::MAX_DIMS == GWTF_FRAME_MAX_DIMS as usize);
const _: () = assert!(crate::wire::header::FRAME_MAGIC == GWTF_FRAME_MAGIC);
const _: () = assert!(crate::wire::header::WIRE_VERSION as u32 == GWTF_WIRE_VERSION);
const _: () = assert!(crate::wire::FRAME_MAGIC == GWTF_FRAME_MAGIC);

/// A frame (opaque): allocated with `gwtf_node_frame_alloc` or received with
/// `gwtf_node_recv`.
pub struct gwtf_frame {
    header: HandleHeader,
    frame: Mutex<Option<Frame>>,
}

impl FfiHandle for gwtf_frame {
    const MAGIC: u64 = 0x6777_7466_6672_6d65; // "gwtffrme"
    const NAME: &'static str = "gwtf_frame";
    fn header(&self) -> &HandleHeader {
        &self.header
    }
}

impl gwtf_frame {
    pub(crate) fn boxed(frame: Frame) -> *mut gwtf_frame {
        gwtf_frame {
            header: HandleHeader::new(Self::MAGIC),
            frame: Mutex::new(Some(frame)),
        }
        .into_raw()
    }
}

impl gwtf_frame {
    /// Takes the frame out (the handle stays, empty).
    pub(crate) fn take(&self) -> Option<Frame> {
        self.frame.lock().take()
    }

    /// Puts a frame taken out back.
    pub(crate) fn put(&self, f: Frame) {
        *self.frame.lock() = Some(f);
    }
}

/// Takes the frame out of a handle and frees the handle (ownership passes).
///
/// # Safety
/// `ptr` must be NULL or a `gwtf_frame` from libgwtf not yet released.
pub(crate) unsafe fn take_frame(ptr: *mut gwtf_frame) -> FfiResult<Frame> {
    // SAFETY: per the function contract.
    let h = unsafe { check_handle(ptr as *const gwtf_frame) };
    let taken = h.map(|h| h.frame.lock().take());
    // SAFETY: ownership passed to us; free_handle ignores wrong types.
    unsafe { free_handle(ptr) };
    taken?.ok_or_else(|| FfiError::invalid("frame was already consumed"))
}

/// What a frame holds: its header, the peer it came from, and its payload.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct gwtf_frame_view {
    /// The header (for a frame to send: the fields set so far).
    pub header: FrameHeader,
    /// The sending peer's node id (0 for a frame allocated to send).
    pub peer_id: u64,
    /// The payload: writable, `len` bytes; NULL when `len` is 0.
    pub data: *mut u8,
    /// Payload length in bytes.
    pub len: usize,
}

/// Describes `frame`: header, peer and payload pointer.
///
/// Ownership: `frame` is only borrowed. `out_view->data` points into the
/// frame's pool slot and stays valid until the frame is released or sent,
/// also after its node was freed; write a frame to send through it.
///
/// Thread safety: a frame may be used from any thread, one at a time.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (not a
/// live frame, or already sent).
#[no_mangle]
pub extern "C" fn gwtf_frame_get_view(
    frame: *const gwtf_frame,
    out_view: *mut gwtf_frame_view,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, frame, |f| {
        require_out(out_view, "out_view")?;
        let g = f.frame.lock();
        let fr = g
            .as_ref()
            .ok_or_else(|| FfiError::invalid("frame was already consumed"))?;
        let view = gwtf_frame_view {
            header: fr.header,
            peer_id: fr.peer(),
            data: fr.payload_ptr(),
            len: fr.len(),
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_view, view) };
        Ok(())
    })
}

/// Sets the header of a frame to send: `kind` (must be
/// `GWTF_FRAME_KIND_DATA`), `flags`, `stage`, `microbatch`, `iteration`,
/// `dtype`, `ndim` and `shape` are taken from `header`; magic, version,
/// sender, payload length and checksums are filled by the library at send.
///
/// Ownership: `header` is only read during the call.
///
/// Thread safety: a frame may be used from any thread, one at a time.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (kind
/// not data, unknown flags or dtype, ndim > 4).
#[no_mangle]
pub extern "C" fn gwtf_frame_set_header(
    frame: *mut gwtf_frame,
    header: *const FrameHeader,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, frame, |f| {
        if header.is_null() {
            return Err(FfiError::null("header"));
        }
        // SAFETY: non-NULL; the caller passes a readable header.
        let h = unsafe { *header };
        if h.kind != gwtf_frame_kind::Data as u16 {
            return Err(FfiError::invalid(format!(
                "kind {} is not GWTF_FRAME_KIND_DATA",
                h.kind
            )));
        }
        if h.flags & !GWTF_FRAME_FLAG_PAYLOAD_CRC != 0 {
            return Err(FfiError::invalid(format!(
                "unknown flag bits 0x{:x}",
                h.flags
            )));
        }
        if crate::wire::Dtype::from_u16(h.dtype).is_none() {
            return Err(FfiError::invalid(format!("unknown dtype {}", h.dtype)));
        }
        if h.ndim > 4 {
            return Err(FfiError::invalid(format!("ndim {} > 4", h.ndim)));
        }
        let mut g = f.frame.lock();
        let fr = g
            .as_mut()
            .ok_or_else(|| FfiError::invalid("frame was already consumed"))?;
        let o = &mut fr.header;
        o.kind = h.kind;
        o.flags = h.flags;
        o.stage = h.stage;
        o.microbatch = h.microbatch;
        o.iteration = h.iteration;
        o.dtype = h.dtype;
        o.ndim = h.ndim;
        o.shape = h.shape;
        Ok(())
    })
}

/// Gives a frame back: its pool slot returns to its node's pool.
/// `gwtf_frame_release(NULL)` does nothing.
///
/// Ownership: takes ownership of `frame`; it must not be used afterwards.
/// A frame passed to `gwtf_node_send` must not be released (send took it).
///
/// Thread safety: any thread; no other thread may use `frame` meanwhile.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_frame_release(frame: *mut gwtf_frame) {
    // SAFETY: the caller passes NULL or a live frame, once.
    unsafe { free_handle(frame) }
}

/// Fills `*out_header` with a data-frame header: magic, version, kind
/// `GWTF_FRAME_KIND_DATA`, every other field 0.
///
/// Ownership: `out_header` is caller memory; it is only written.
///
/// Thread safety: may be called from any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_frame_header_init(out_header: *mut FrameHeader) -> gwtf_status {
    guard(std::ptr::null_mut(), || {
        require_out(out_header, "out_header")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_header, FrameHeader::data()) };
        Ok(())
    })
}
