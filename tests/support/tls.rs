//! Test certificates made with the `openssl` command: a CA, a server certificate for 127.0.0.1
//! and a client certificate, as PEM files.

use std::path::Path;
use std::process::Command;

/// Runs `openssl` in `dir`, failing the test with its message.
pub fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl ({e}): apt-get install openssl"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes into `dir` a CA (`ca.pem`), a server certificate for 127.0.0.1 (`server.pem`,
/// `server.key`) and a client certificate (`client.pem`, `client.key`).
pub fn make_certs(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509", "-days", "1", "-subj", "/CN=warden-test-ca"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    openssl(dir, &ca);
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    .unwrap();
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (name, cn) in [("server", "127.0.0.1"), ("client", "warden")] {
        let subj = format!("/CN={cn}");
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let mut req = vec!["req", "-new", "-subj", subj.as_str()];
        req.extend(ec);
        req.extend(["-keyout", key.as_str(), "-out", csr.as_str()]);
        openssl(dir, &req);
        let pem = format!("{name}.pem");
        let ext = format!("{name}.ext");
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                &ext,
                "-out",
                &pem,
            ],
        );
    }
}
