//! libFuzzer entry point of the `config_json` target (see `specdraft_fuzz::targets::config_json`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    specdraft_fuzz::run("config_json", data, specdraft_fuzz::targets::config_json);
});
