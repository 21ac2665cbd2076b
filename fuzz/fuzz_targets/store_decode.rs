#![no_main]
//! See etcd_warden::fuzzing::store_decode.
libfuzzer_sys::fuzz_target!(|data: &[u8]| etcd_warden::fuzzing::store_decode(data));
