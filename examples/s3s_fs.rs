//! The S3-compatible server the tests run against: the `s3s-fs` library (buckets are folders
//! of a root directory) behind a plain HTTP listener, built by `cargo test` with the tests, so
//! a fresh machine needs no `cargo install` for it. Same arguments as the `s3s-fs` binary the
//! tests used before (`tests/support/s3.rs` runs it):
//!
//! ```text
//! s3s_fs --host 127.0.0.1 --port 9000 --access-key AK --secret-key SK <root>
//! ```

use std::path::PathBuf;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;

struct Args {
    host: String,
    port: u16,
    keys: Option<(String, String)>,
    root: PathBuf,
}

fn usage(why: &str) -> ! {
    eprintln!(
        "s3s_fs: {why}\nusage: s3s_fs [--host H] [--port P] [--access-key AK --secret-key SK] <root>"
    );
    std::process::exit(64)
}

fn parse() -> Args {
    let mut host = "localhost".to_string();
    let mut port = 8014u16;
    let (mut access, mut secret) = (None, None);
    let mut root = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .unwrap_or_else(|| usage(&format!("{name} needs a value")))
        };
        match a.as_str() {
            "--host" => host = value("--host"),
            "--port" => {
                let v = value("--port");
                port = v
                    .parse()
                    .unwrap_or_else(|_| usage(&format!("--port {v:?} is no port number")));
            }
            "--access-key" => access = Some(value("--access-key")),
            "--secret-key" => secret = Some(value("--secret-key")),
            flag if flag.starts_with("--") => usage(&format!("unknown flag {flag:?}")),
            path if root.is_none() => root = Some(PathBuf::from(path)),
            extra => usage(&format!("one root directory only, not also {extra:?}")),
        }
    }
    let keys = match (access, secret) {
        (Some(a), Some(s)) => Some((a, s)),
        (None, None) => None,
        _ => usage("--access-key and --secret-key go together"),
    };
    let root = root.unwrap_or_else(|| usage("the root directory is missing"));
    Args {
        host,
        port,
        keys,
        root,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse();
    let fs = s3s_fs::FileSystem::new(&args.root)
        .map_err(|e| format!("root {}: {e:?}", args.root.display()))?;
    let mut builder = S3ServiceBuilder::new(fs);
    if let Some((ak, sk)) = args.keys {
        builder.set_auth(SimpleAuth::from_single(ak, sk));
    }
    let service = builder.build();
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port)).await?;
    loop {
        let (socket, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                eprintln!("s3s_fs: accept: {e}");
                continue;
            }
        };
        let service = service.clone();
        tokio::spawn(async move {
            let _ = Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(socket), service)
                .await;
        });
    }
}
