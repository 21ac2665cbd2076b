//! A real DNS server for tests: hickory-server embedded in the test process, serving one in-memory
//! zone (`warden.test.`) over UDP and TCP on `127.0.0.1:<ephemeral>`.
//!
//! `support::dns` (declared in `tests/support/mod.rs`).
//!
//! ```ignore
//! let dns = DnsServer::start().await;
//! dns.set_txt("owner.warden.test", &["seed-a"]).await;   // replaces the record set
//! dns.remove_txt("owner.warden.test").await;             // NXDOMAIN afterwards
//! dns.set_mode(Mode::ServFail);                          // or Mode::Silent (no answer: timeouts)
//! dns.stop().await; dns.restart().await;                 // same port
//! ```
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use hickory_server::Server;
use hickory_server::net::runtime::{Time, TokioRuntimeProvider};
use hickory_server::proto::op::{Header, HeaderCounts, MessageType, Metadata, ResponseCode};
use hickory_server::proto::rr::rdata::{SOA, TXT};
use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordSet, RecordType, RrKey};
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::store::in_memory::InMemoryZoneHandler;
use hickory_server::zone_handler::{
    AxfrPolicy, Catalog, MessageResponseBuilder, ZoneHandler, ZoneType,
};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::Mutex;

/// The zone every test name lives in.
pub const ZONE: &str = "warden.test.";

/// TTL of records set with [`DnsServer::set_txt`].
pub const DEFAULT_TTL: u32 = 60;

/// How the server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Answer from the zone.
    Normal = 0,
    /// Answer every query with SERVFAIL.
    ServFail = 1,
    /// Read queries and never answer (clients time out).
    Silent = 2,
}

/// One change of what the server answers, as [`DnsServer::changes`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsEvent {
    /// The TXT record set at `name` now holds `values` (each record's strings joined); None:
    /// removed.
    Txt {
        name: String,
        values: Option<Vec<String>>,
    },
    /// [`DnsServer::set_mode`].
    Mode(Mode),
    /// [`DnsServer::stop`].
    Stopped,
    /// [`DnsServer::restart`] serves again.
    Serving,
}

/// A running (or stopped) test DNS server; the zone survives `stop`/`restart`.
pub struct DnsServer {
    addr: SocketAddr,
    zone: Arc<InMemoryZoneHandler<TokioRuntimeProvider>>,
    mode: Arc<AtomicU8>,
    server: Mutex<Option<Server<Handler>>>,
    /// Every change, each stamped once it is in effect (the ownership timeline reads it).
    changes: std::sync::Mutex<Vec<(std::time::Instant, DnsEvent)>>,
}

impl DnsServer {
    /// Starts a server on an ephemeral loopback port (the same port for UDP and TCP).
    pub async fn start() -> DnsServer {
        let zone = Arc::new(new_zone());
        let mode = Arc::new(AtomicU8::new(Mode::Normal as u8));
        // The UDP port is picked by the kernel; TCP may find it taken, then try another.
        for _ in 0..50 {
            let udp = UdpSocket::bind("127.0.0.1:0").await.expect("bind UDP");
            let addr = udp.local_addr().expect("UDP address");
            let Ok(tcp) = TcpListener::bind(addr).await else {
                continue;
            };
            let server = serve(udp, tcp, zone.clone(), mode.clone());
            return DnsServer {
                addr,
                zone,
                mode,
                server: Mutex::new(Some(server)),
                changes: std::sync::Mutex::new(Vec::new()),
            };
        }
        panic!("no free loopback port for both UDP and TCP after 50 tries");
    }

    /// Every change so far, each with the moment it was in effect.
    pub fn changes(&self) -> Vec<(std::time::Instant, DnsEvent)> {
        self.changes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn changed(&self, event: DnsEvent) {
        self.changes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((std::time::Instant::now(), event));
    }

    /// The address clients send queries to (UDP and TCP).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Replaces the TXT record set at `name` with one record per value, each a single string.
    pub async fn set_txt(&self, name: &str, values: &[&str]) {
        let records: Vec<Vec<&str>> = values.iter().map(|v| vec![*v]).collect();
        self.set_txt_records(name, DEFAULT_TTL, &records).await;
    }

    /// Replaces the TXT record set at `name`: one record per entry of `records`, each made of the
    /// given character-strings, all with `ttl`. The replacement is atomic: a concurrent query sees
    /// the old set or the new one, never nothing.
    pub async fn set_txt_records(&self, name: &str, ttl: u32, records: &[Vec<&str>]) {
        let name = fqdn(name);
        let serial = self.zone.serial().await;
        let mut set = RecordSet::with_ttl(name.clone(), RecordType::TXT, ttl);
        for strings in records {
            let txt = TXT::new(strings.iter().map(|s| s.to_string()).collect());
            // `insert` deduplicates equal records, like a real zone.
            set.insert(
                Record::from_rdata(name.clone(), ttl, RData::TXT(txt)),
                serial,
            );
        }
        let key = RrKey::new(LowerName::new(&name), RecordType::TXT);
        self.zone.records_mut().await.insert(key, Arc::new(set));
        let values = records.iter().map(|r| r.concat()).collect();
        self.changed(DnsEvent::Txt {
            name: name.to_string(),
            values: Some(values),
        });
    }

    /// Removes the TXT record set at `name`; the name then answers NXDOMAIN (when nothing else
    /// lives there).
    pub async fn remove_txt(&self, name: &str) {
        let key = RrKey::new(LowerName::new(&fqdn(name)), RecordType::TXT);
        self.zone.records_mut().await.remove(&key);
        self.changed(DnsEvent::Txt {
            name: fqdn(name).to_string(),
            values: None,
        });
    }

    /// Puts an A record at `name` so that a TXT query there answers NOERROR with no records.
    pub async fn set_a(&self, name: &str, ip: std::net::Ipv4Addr) {
        let name = fqdn(name);
        let serial = self.zone.serial().await;
        let record = Record::from_rdata(name.clone(), DEFAULT_TTL, RData::A(ip.into()));
        let mut set = RecordSet::with_ttl(name.clone(), RecordType::A, DEFAULT_TTL);
        set.insert(record, serial);
        let key = RrKey::new(LowerName::new(&name), RecordType::A);
        self.zone.records_mut().await.insert(key, Arc::new(set));
    }

    /// Changes how the server answers from now on.
    pub fn set_mode(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
        self.changed(DnsEvent::Mode(mode));
    }

    /// Stops serving; the port is free until [`DnsServer::restart`].
    pub async fn stop(&self) {
        if let Some(mut server) = self.server.lock().await.take() {
            self.changed(DnsEvent::Stopped);
            // Errors here are from sockets that are going away anyway.
            let _ = server.shutdown_gracefully().await;
        }
    }

    /// Serves again on the same port with the same zone (stopping first if running).
    pub async fn restart(&self) {
        self.stop().await;
        let mut last_error = None;
        // The kernel may need a moment to release the port after the listener is dropped.
        for _ in 0..100 {
            let udp = match UdpSocket::bind(self.addr).await {
                Ok(udp) => udp,
                Err(error) => {
                    last_error = Some(error);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            match TcpListener::bind(self.addr).await {
                Ok(tcp) => {
                    let server = serve(udp, tcp, self.zone.clone(), self.mode.clone());
                    *self.server.lock().await = Some(server);
                    self.changed(DnsEvent::Serving);
                    return;
                }
                Err(error) => {
                    last_error = Some(error);
                    drop(udp);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        panic!("cannot rebind {}: {last_error:?}", self.addr);
    }
}

/// Turns `name` into a fully qualified name inside [`ZONE`], panicking on names outside it.
fn fqdn(name: &str) -> Name {
    let mut name = Name::from_str(name).unwrap_or_else(|e| panic!("bad DNS name {name:?}: {e}"));
    name.set_fqdn(true);
    let zone = Name::from_str(ZONE).expect("zone name");
    assert!(
        zone.zone_of(&name),
        "{name} is outside the test zone {ZONE}"
    );
    name
}

fn new_zone() -> InMemoryZoneHandler<TokioRuntimeProvider> {
    let origin = Name::from_str(ZONE).expect("zone name");
    let soa = SOA::new(
        Name::from_str("ns.warden.test.").expect("ns name"),
        Name::from_str("admin.warden.test.").expect("admin name"),
        1,
        3600,
        600,
        86400,
        // Negative TTL: short so that a resolver which does cache forgets NXDOMAIN quickly.
        1,
    );
    let soa_record = Record::from_rdata(origin.clone(), 3600, RData::SOA(soa));
    let mut records = BTreeMap::new();
    records.insert(
        RrKey::new(LowerName::new(&origin), RecordType::SOA),
        RecordSet::from(soa_record),
    );
    InMemoryZoneHandler::new(origin, records, ZoneType::Primary, AxfrPolicy::Deny)
        .expect("valid test zone")
}

fn serve(
    udp: UdpSocket,
    tcp: TcpListener,
    zone: Arc<InMemoryZoneHandler<TokioRuntimeProvider>>,
    mode: Arc<AtomicU8>,
) -> Server<Handler> {
    let mut catalog = Catalog::new();
    let origin = LowerName::new(&Name::from_str(ZONE).expect("zone name"));
    catalog.upsert(origin, vec![zone as Arc<dyn ZoneHandler>]);
    let mut server = Server::new(Handler { catalog, mode });
    server.register_socket(udp);
    server.register_listener(tcp, Duration::from_secs(5), 16);
    server
}

/// Answers from the catalog, or fails on purpose according to the mode.
struct Handler {
    catalog: Catalog,
    mode: Arc<AtomicU8>,
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        mut response_handle: R,
    ) -> ResponseInfo {
        let mode = self.mode.load(Ordering::SeqCst);
        if mode == Mode::Normal as u8 {
            return self
                .catalog
                .handle_request::<R, T>(request, response_handle)
                .await;
        }
        let failed = || {
            let mut metadata = Metadata::new(
                request.metadata.id,
                MessageType::Response,
                request.metadata.op_code,
            );
            metadata.response_code = ResponseCode::ServFail;
            ResponseInfo::from(Header {
                metadata,
                counts: HeaderCounts::default(),
            })
        };
        if mode == Mode::ServFail as u8 {
            let response = MessageResponseBuilder::new(&request.queries, None)
                .error_msg(&request.metadata, ResponseCode::ServFail);
            return response_handle
                .send_response(response)
                .await
                .unwrap_or_else(|_| failed());
        }
        // Silent: say nothing to the client.
        failed()
    }
}
