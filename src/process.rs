//! Finding and killing etcd in the shared PID namespace.
