#![no_main]
//! See etcd_warden::fuzzing::ebr_secret.
libfuzzer_sys::fuzz_target!(|data: &[u8]| etcd_warden::fuzzing::ebr_secret(data));
