//! The README's demo: a control-plane migration (seed 001) on one machine, with real etcd,
//! DNS, `etcd-warden` sidecars and the copy Job; prints the timeline and PASS or FAIL.
//!
//! `cargo build --bin etcd-warden --example migration_demo && target/debug/examples/migration_demo
//! [--s3] [--store-outage]` (`scripts/demo` does this). The scenario itself is
//! `tests/support/migration.rs`, the same code the CI test runs.

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::ExitCode;

use support::migration::{Options, Stores, run};

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut options = Options::demo();
    for a in &args {
        match a.as_str() {
            "--s3" => options.stores = Stores::S3,
            "--store-outage" => {
                options.stores = Stores::S3;
                options.source_store_outage = true;
            }
            other => {
                eprintln!(
                    "migration_demo: unknown argument {other:?} (known: --s3, --store-outage)"
                );
                return ExitCode::from(64);
            }
        }
    }
    println!(
        "== migrating etcd from seed-a to seed-b ({} stores{})",
        match options.stores {
            Stores::File => "file://",
            Stores::S3 => "S3",
        },
        if options.source_store_outage {
            ", the source's store unreachable at the flip"
        } else {
            ""
        }
    );
    println!("(seconds since the owner record flipped)");
    // Ctrl-C drops the scenario, which stops every process it started and removes its files.
    let report = tokio::select! {
        report = run(options) => report,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("migration_demo: interrupted; stopped everything it started");
            return ExitCode::from(130);
        }
    };
    println!("{}", report.summary());
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
