//! `etcd-warden-operator`: quorum-safe etcd member replacement.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "etcd-warden-operator",
    version,
    about = "Keeps etcd quorum safe while control-plane machines are replaced"
)]
struct Cli {}

fn main() {
    let _ = Cli::parse();
}
