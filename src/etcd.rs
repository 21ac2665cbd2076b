//! The etcd seam: clients built from configuration (endpoints, TLS, auth).
