#![no_main]
//! See etcd_warden::fuzzing::wal.
libfuzzer_sys::fuzz_target!(|data: &[u8]| etcd_warden::fuzzing::wal(data));
