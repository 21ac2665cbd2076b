#![no_main]
//! See etcd_warden::fuzzing::layout.
libfuzzer_sys::fuzz_target!(|data: &[u8]| etcd_warden::fuzzing::layout(data));
