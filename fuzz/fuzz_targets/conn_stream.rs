//! The connection state machine (handshake, then sealed frames) fed
//! arbitrary byte streams cut at arbitrary read sizes. The harness
//! (`gwtf::wire::harness`) can play an honest peer's handshake first and
//! seal the fuzzer's frames, so the framing reader behind the tags is
//! reached too; bytes it did not seal must deliver nothing.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = gwtf::wire::harness::run(data);
});
