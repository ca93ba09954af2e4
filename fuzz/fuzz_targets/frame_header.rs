//! Frame header decode: never panics; what decodes re-encodes to the same bytes.
#![no_main]
use gwtf::wire::FrameHeader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let max = 1u64 << 30;
    if let Ok(h) = FrameHeader::decode(data, max) {
        assert!(h.payload_len <= max);
        let again = h.encode();
        assert_eq!(&again[..], &data[..again.len()]);
        assert_eq!(FrameHeader::decode(&again, max), Ok(h));
    }
});
