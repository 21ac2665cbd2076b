#![no_main]
//! See etcd_warden::fuzzing::bolt.
libfuzzer_sys::fuzz_target!(|data: &[u8]| etcd_warden::fuzzing::bolt(data));
