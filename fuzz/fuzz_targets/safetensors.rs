//! libFuzzer entry point of the `safetensors` target (see `specdraft_fuzz::targets::safetensors`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    specdraft_fuzz::run("safetensors", data, specdraft_fuzz::targets::safetensors);
});
