#![no_main]
//! See etcd_warden::fuzzing::config.
libfuzzer_sys::fuzz_target!(|data: &[u8]| etcd_warden::fuzzing::config(data));
