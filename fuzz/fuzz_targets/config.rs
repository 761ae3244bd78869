//! The relay's configuration loader on a TOML file (`#env NAME=VALUE` comment lines are
//! environment variables); the properties are `outbox::fuzzing::config`'s.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    outbox::fuzzing::config(data);
});
