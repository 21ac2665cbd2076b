#![no_main]
//! See etcd_warden::fuzzing::etcdbrctl_flags.
libfuzzer_sys::fuzz_target!(|data: &[u8]| etcd_warden::fuzzing::etcdbrctl_flags(data));
