//! The envelope reader, `outbox::envelope::Received::from_headers`, on a broker's headers
//! (one `name: value` per line); the properties are `outbox::fuzzing::envelope`'s.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    outbox::fuzzing::envelope(data);
});
