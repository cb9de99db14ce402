//! libFuzzer entry point of the `gguf` target (see `specdraft_fuzz::targets::gguf`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    specdraft_fuzz::run("gguf", data, specdraft_fuzz::targets::gguf);
});
