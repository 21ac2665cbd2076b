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
    make_certs_for(dir, &["127.0.0.1"], &["client"]);
}

/// Writes into `dir` a CA (`ca.pem`), a server certificate for the IP addresses `ips`
/// (`server.pem`, `server.key`) and one client certificate per name in `clients`
/// (`<name>.pem`, `<name>.key`).
#[allow(dead_code)] // each test crate uses one of the two
pub fn make_certs_for(dir: &Path, ips: &[&str], clients: &[&str]) {
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
    let sans: Vec<String> = ips.iter().map(|i| format!("IP:{i}")).collect();
    std::fs::write(
        dir.join("server.ext"),
        format!(
            "subjectAltName={}\nextendedKeyUsage=serverAuth,clientAuth\n",
            sans.join(",")
        ),
    )
    .unwrap();
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    let certs = std::iter::once(("server", "127.0.0.1", "server.ext"))
        .chain(clients.iter().map(|c| (*c, "warden", "client.ext")));
    for (name, cn, ext) in certs {
        let (subj, key, csr, pem) = (
            format!("/CN={cn}"),
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        let mut req = vec!["req", "-new", "-subj", subj.as_str()];
        req.extend(ec);
        req.extend(["-keyout", key.as_str(), "-out", csr.as_str()]);
        openssl(dir, &req);
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
                ext,
                "-out",
                &pem,
            ],
        );
    }
}
