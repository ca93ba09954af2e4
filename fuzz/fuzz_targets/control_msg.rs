//! Control-message decoders (heartbeat, goodbye, the typed envelope, and the
//! GWTF protocol messages inside it): never panic; what decodes re-encodes
//! exactly.
#![no_main]
use gwtf::protocol::codec;
use gwtf::wire::{ControlEnvelope, Goodbye, Heartbeat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => {
            if let Ok(m) = Heartbeat::decode(body) {
                assert_eq!(m.encode(), body);
            }
        }
        1 => {
            if let Ok(m) = Goodbye::decode(body) {
                assert_eq!(m.encode(), body);
            }
        }
        2 => {
            if let Ok(m) = ControlEnvelope::decode(body) {
                assert_eq!(m.encode().unwrap(), body);
            }
        }
        _ => {
            if let Ok(env) = ControlEnvelope::decode(body) {
                if let Ok(m) = codec::decode(&env) {
                    assert_eq!(codec::encode(&m).unwrap(), env);
                }
            }
        }
    }
});
