//! The `kvroute` command's library half: its settings (flags, `KVROUTE_*` variables and the
//! `--config` TOML), shared with the fuzzer of that file format (`kvroute-bench fuzz`).
#![forbid(unsafe_code)]

pub mod settings;
