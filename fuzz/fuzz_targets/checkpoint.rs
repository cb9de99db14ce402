//! libFuzzer entry point of the `checkpoint` target (see `specdraft_fuzz::targets::checkpoint`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    specdraft_fuzz::run("checkpoint", data, specdraft_fuzz::targets::checkpoint);
});
