#![no_main]
//! See etcd_warden::fuzzing::delta.
libfuzzer_sys::fuzz_target!(|data: &[u8]| etcd_warden::fuzzing::delta(data));
