//! The JSON-lines parser of `outbox enqueue --stdin` on standard input's text; the
//! properties are `outbox::fuzzing::enqueue_line`'s.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    outbox::fuzzing::enqueue_line(data);
});
