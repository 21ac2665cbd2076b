//! Owner DNS lookups: the TXT record at the owner name, classified into a [`CheckResult`], and
//! consecutive failures turned into a [`Verdict`] by the [`FailureCounter`].
//!
//! Classification (DESIGN.md "The ownership protocol"):
//!
//! | lookup result | [`CheckResult`] | verdict |
//! |---|---|---|
//! | every TXT record equals our ID | `Owner` | owner |
//! | TXT records, none equals our ID | `OtherOwner` | not owner |
//! | NXDOMAIN, or NOERROR with no TXT record (NODATA, with or without the zone's SOA) | `NoRecord` | not owner |
//! | SERVFAIL (any error rcode), timeout, network error, a referral (NS records, no SOA) | `Failed` | unresolvable after `failure_threshold` in a row |
//! | TXT records, one equals our ID and another does not | `Failed(Ambiguous)` | unresolvable after `failure_threshold` in a row |
//!
//! A TXT record made of several character-strings is read as their concatenation, as RFC 7208
//! does for SPF, because long values are split at 255 bytes and DNS providers split differently.
//!
//! Several TXT records: we are the owner only when **every** record names us. A set that names us
//! and someone else is ambiguous: taking it as "owner" could leave two seeds active at once, and
//! taking it as "not owner" would deactivate us for good (Deactivated is sticky and takes the
//! final snapshot) because of what may be a half-applied record update. So it counts as a failed
//! lookup: after `failure_threshold` of them etcd is suspended, which is reversible and takes no
//! final snapshot. A set that does not name us at all is "not owner".
//!
//! The owner name is looked up as a fully qualified name, so a resolv.conf search list (ndots:5
//! in Kubernetes) never turns it into another name. The resolver's cache honours the record's TTL
//! but never trusts an answer (positive or negative) longer than `ttl_cap`; a zero cap disables
//! the cache.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::{DnsError, NetError, NoRecords};
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::{Name, RData};

use crate::config::OwnerConfig;

/// What an owner check concluded. `Unresolvable` is only produced after the configured number of
/// consecutive failed lookups (see [`FailureCounter`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The record names our ID.
    Owner,
    /// The record names someone else, or there is authoritatively no record.
    NotOwner,
    /// The record could not be looked up often enough in a row.
    Unresolvable,
}

/// Errors building the owner resolver.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The owner name is not a valid DNS name.
    #[error("owner name {name:?} is not a valid DNS name: {message}")]
    InvalidName {
        /// The configured name.
        name: String,
        /// Why it is invalid.
        message: String,
    },
    /// The system resolver configuration (resolv.conf) could not be read.
    #[error("cannot read the system resolver configuration: {0}")]
    SystemConfig(String),
    /// The resolver could not be built.
    #[error("cannot build the DNS resolver: {0}")]
    Build(String),
}

/// What one lookup of the owner record found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckResult {
    /// Every TXT record names our ID.
    Owner,
    /// TXT records exist and none names our ID; the values found.
    OtherOwner(Vec<String>),
    /// Authoritatively no TXT record (NXDOMAIN or NODATA).
    NoRecord,
    /// The lookup gave no usable answer.
    Failed(Failure),
}

/// Why a lookup gave no usable answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// No answer within the timeout.
    Timeout,
    /// The server answered with an error code (SERVFAIL, REFUSED, ...).
    ServerError(String),
    /// Sending or receiving failed (connection refused, no route, ...).
    Network(String),
    /// An answer that says neither yes nor no (a referral without SOA, an undecodable reply).
    Inconclusive(String),
    /// The record set names us and someone else.
    Ambiguous(Vec<String>),
}

impl CheckResult {
    /// A bounded label for metrics: `owner`, `other_owner`, `no_record`, `timeout`,
    /// `server_error`, `network`, `inconclusive`, `ambiguous`.
    pub fn label(&self) -> &'static str {
        match self {
            CheckResult::Owner => "owner",
            CheckResult::OtherOwner(_) => "other_owner",
            CheckResult::NoRecord => "no_record",
            CheckResult::Failed(Failure::Timeout) => "timeout",
            CheckResult::Failed(Failure::ServerError(_)) => "server_error",
            CheckResult::Failed(Failure::Network(_)) => "network",
            CheckResult::Failed(Failure::Inconclusive(_)) => "inconclusive",
            CheckResult::Failed(Failure::Ambiguous(_)) => "ambiguous",
        }
    }

    /// The verdict this result stands for on its own; `None` for a failure, which only becomes
    /// `Unresolvable` through the [`FailureCounter`].
    pub fn verdict(&self) -> Option<Verdict> {
        match self {
            CheckResult::Owner => Some(Verdict::Owner),
            CheckResult::OtherOwner(_) | CheckResult::NoRecord => Some(Verdict::NotOwner),
            CheckResult::Failed(_) => None,
        }
    }
}

impl fmt::Display for CheckResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckResult::Owner => f.write_str("owner"),
            CheckResult::OtherOwner(values) => write!(f, "owned by {values:?}"),
            CheckResult::NoRecord => f.write_str("no owner record"),
            CheckResult::Failed(Failure::Timeout) => f.write_str("lookup timed out"),
            CheckResult::Failed(Failure::ServerError(code)) => write!(f, "server answered {code}"),
            CheckResult::Failed(Failure::Network(e)) => write!(f, "network error: {e}"),
            CheckResult::Failed(Failure::Inconclusive(e)) => write!(f, "inconclusive answer: {e}"),
            CheckResult::Failed(Failure::Ambiguous(values)) => {
                write!(f, "ambiguous owner record {values:?}")
            }
        }
    }
}

/// Classifies the TXT records found (each a list of character-strings) against our ID.
pub fn classify_records(records: &[Vec<Vec<u8>>], id: &str) -> CheckResult {
    if records.is_empty() {
        return CheckResult::NoRecord;
    }
    let values: Vec<Vec<u8>> = records.iter().map(|strings| strings.concat()).collect();
    let ours = values
        .iter()
        .filter(|v| v.as_slice() == id.as_bytes())
        .count();
    let text = || {
        values
            .iter()
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect()
    };
    if ours == values.len() {
        CheckResult::Owner
    } else if ours == 0 {
        CheckResult::OtherOwner(text())
    } else {
        CheckResult::Failed(Failure::Ambiguous(text()))
    }
}

/// Classifies a failed lookup: authoritative "nothing there" or a failure.
pub fn classify_error(error: &NetError) -> CheckResult {
    match error {
        NetError::Dns(DnsError::NoRecordsFound(NoRecords {
            response_code,
            soa,
            ns,
            ..
        })) => {
            // NXDOMAIN says the name does not exist. NOERROR without records is NODATA, "no TXT
            // record here" (RFC 2308; servers that omit the SOA still mean it), unless it is a
            // referral: name servers for a zone below and no SOA, which answers nothing.
            let referral = soa.is_none() && ns.as_ref().is_some_and(|ns| !ns.is_empty());
            if *response_code == ResponseCode::NXDomain || !referral {
                CheckResult::NoRecord
            } else {
                CheckResult::Failed(Failure::Inconclusive(format!(
                    "{response_code}: a referral without records or SOA"
                )))
            }
        }
        NetError::Dns(DnsError::ResponseCode(code)) => {
            CheckResult::Failed(Failure::ServerError(code.to_string()))
        }
        NetError::Timeout => CheckResult::Failed(Failure::Timeout),
        NetError::Io(_) | NetError::NoConnections | NetError::Busy => {
            CheckResult::Failed(Failure::Network(error.to_string()))
        }
        other => CheckResult::Failed(Failure::Inconclusive(other.to_string())),
    }
}

/// Counts consecutive failed lookups; a failure becomes `Unresolvable` only at the threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureCounter {
    threshold: u32,
    consecutive: u32,
}

impl FailureCounter {
    /// A counter that says `Unresolvable` after `threshold` consecutive failures (at least 1).
    pub fn new(threshold: u32) -> Self {
        FailureCounter {
            threshold: threshold.max(1),
            consecutive: 0,
        }
    }

    /// Consecutive failures so far.
    pub fn consecutive(&self) -> u32 {
        self.consecutive
    }

    /// Records one lookup result and returns the verdict it yields, if any. Every failure at or
    /// past the threshold yields `Unresolvable` again, so a watchdog that missed one still acts.
    pub fn observe(&mut self, result: &CheckResult) -> Option<Verdict> {
        match result.verdict() {
            Some(verdict) => {
                self.consecutive = 0;
                Some(verdict)
            }
            None => {
                self.consecutive = self.consecutive.saturating_add(1);
                (self.consecutive >= self.threshold).then_some(Verdict::Unresolvable)
            }
        }
    }
}

/// Looks up the owner record; the I/O seam of the watchdog.
#[async_trait::async_trait]
pub trait OwnerLookup: Send + Sync {
    /// One lookup, classified.
    async fn check(&self) -> CheckResult;
}

/// Looks up the owner TXT record with hickory-resolver.
pub struct OwnerResolver {
    resolver: TokioResolver,
    name: Name,
    id: String,
    timeout: Duration,
}

impl fmt::Debug for OwnerResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnerResolver")
            .field("name", &self.name.to_string())
            .field("id", &self.id)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl OwnerResolver {
    /// A resolver for `config`: its nameservers (UDP and TCP), or the system's when empty.
    pub fn new(config: &OwnerConfig) -> Result<Self, ResolveError> {
        let mut name =
            Name::from_str_relaxed(&config.name).map_err(|e| ResolveError::InvalidName {
                name: config.name.clone(),
                message: e.to_string(),
            })?;
        name.set_fqdn(true);

        let mut builder = if config.nameservers.is_empty() {
            TokioResolver::builder_tokio().map_err(|e| ResolveError::SystemConfig(e.to_string()))?
        } else {
            TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(
                    config.nameservers.iter().map(name_server).collect(),
                ),
                TokioRuntimeProvider::default(),
            )
        };
        let options = builder.options_mut();
        options.timeout = config.timeout;
        // No retries within a check (`attempts` counts retries after the first try): the failure
        // threshold across checks is the retry policy, and a check stays within its timeout.
        options.attempts = 0;
        options.cache_size = if config.ttl_cap.is_zero() { 0 } else { 4 };
        options.positive_max_ttl = Some(config.ttl_cap);
        options.negative_max_ttl = Some(config.ttl_cap);
        let resolver = builder
            .build()
            .map_err(|e| ResolveError::Build(e.to_string()))?;
        Ok(OwnerResolver {
            resolver,
            name,
            id: config.id.clone(),
            timeout: config.timeout,
        })
    }

    /// The fully qualified owner name looked up.
    pub fn name(&self) -> String {
        self.name.to_string()
    }
}

#[async_trait::async_trait]
impl OwnerLookup for OwnerResolver {
    async fn check(&self) -> CheckResult {
        // The resolver's own timeout is per request; this bounds the whole lookup.
        let lookup =
            tokio::time::timeout(self.timeout, self.resolver.txt_lookup(self.name.clone()));
        match lookup.await {
            Err(_elapsed) => CheckResult::Failed(Failure::Timeout),
            Ok(Err(error)) => classify_error(&error),
            Ok(Ok(lookup)) => {
                let records: Vec<Vec<Vec<u8>>> = lookup
                    .answers()
                    .iter()
                    .filter_map(|record| match &record.data {
                        RData::TXT(txt) => Some(txt.txt_data.iter().map(|s| s.to_vec()).collect()),
                        _ => None,
                    })
                    .collect();
                classify_records(&records, &self.id)
            }
        }
    }
}

fn name_server(addr: &SocketAddr) -> NameServerConfig {
    let mut server = NameServerConfig::udp_and_tcp(addr.ip());
    for connection in &mut server.connections {
        connection.port = addr.port();
    }
    server
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(strings: &[&str]) -> Vec<Vec<u8>> {
        strings.iter().map(|s| s.as_bytes().to_vec()).collect()
    }

    fn failed() -> CheckResult {
        CheckResult::Failed(Failure::Timeout)
    }

    #[test]
    fn single_record_is_compared_exactly() {
        assert_eq!(
            classify_records(&[record(&["seed-a"])], "seed-a"),
            CheckResult::Owner
        );
        assert_eq!(
            classify_records(&[record(&["seed-b"])], "seed-a"),
            CheckResult::OtherOwner(vec!["seed-b".into()])
        );
        // No trimming or case folding: an ID that differs in any byte is someone else's.
        for other in ["Seed-a", "seed-a ", " seed-a", "seed-", ""] {
            assert_eq!(
                classify_records(&[record(&[other])], "seed-a").verdict(),
                Some(Verdict::NotOwner),
                "{other:?}"
            );
        }
    }

    #[test]
    fn character_strings_of_one_record_are_concatenated() {
        assert_eq!(
            classify_records(&[record(&["seed-", "a"])], "seed-a"),
            CheckResult::Owner
        );
        assert_eq!(
            classify_records(&[record(&["seed-", "b"])], "seed-a"),
            CheckResult::OtherOwner(vec!["seed-b".into()])
        );
    }

    #[test]
    fn several_records_are_ours_only_when_all_are() {
        assert_eq!(
            classify_records(&[record(&["seed-a"]), record(&["seed-a"])], "seed-a"),
            CheckResult::Owner
        );
        assert_eq!(
            classify_records(&[record(&["seed-a"]), record(&["seed-b"])], "seed-a"),
            CheckResult::Failed(Failure::Ambiguous(vec!["seed-a".into(), "seed-b".into()]))
        );
        assert_eq!(
            classify_records(&[record(&["seed-b"]), record(&["seed-c"])], "seed-a"),
            CheckResult::OtherOwner(vec!["seed-b".into(), "seed-c".into()])
        );
    }

    #[test]
    fn no_records_is_no_record() {
        assert_eq!(classify_records(&[], "seed-a"), CheckResult::NoRecord);
    }

    #[test]
    fn dns_errors_are_classified_as_in_the_design_table() {
        use hickory_resolver::proto::op::Query;
        let query = Query::default();
        let nx = NetError::from(NoRecords::new(query.clone(), ResponseCode::NXDomain));
        assert_eq!(classify_error(&nx), CheckResult::NoRecord);
        // NODATA: NOERROR, no TXT record, no SOA (some servers omit it): not owner.
        let nodata = NetError::from(NoRecords::new(query.clone(), ResponseCode::NoError));
        assert_eq!(classify_error(&nodata), CheckResult::NoRecord);
        // A referral (name servers of a zone below, no SOA) answers nothing: a failure.
        let mut referral = NoRecords::new(query, ResponseCode::NoError);
        let zone = Name::from_ascii("shoot.example.").unwrap();
        let ns = hickory_resolver::proto::rr::Record::from_rdata(
            zone.clone(),
            60,
            RData::NS(hickory_resolver::proto::rr::rdata::NS(zone)),
        );
        referral.ns = Some(std::sync::Arc::from(vec![
            hickory_resolver::net::ForwardNSData {
                ns,
                glue: std::sync::Arc::from(Vec::new()),
            },
        ]));
        assert!(matches!(
            classify_error(&NetError::from(referral)),
            CheckResult::Failed(Failure::Inconclusive(_))
        ));
        let servfail = NetError::Dns(DnsError::ResponseCode(ResponseCode::ServFail));
        assert!(matches!(
            classify_error(&servfail),
            CheckResult::Failed(Failure::ServerError(_))
        ));
        assert_eq!(classify_error(&NetError::Timeout), failed());
        let io = NetError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(matches!(
            classify_error(&io),
            CheckResult::Failed(Failure::Network(_))
        ));
    }

    #[test]
    fn failures_become_unresolvable_only_at_the_threshold() {
        let mut counter = FailureCounter::new(3);
        assert_eq!(counter.observe(&failed()), None);
        assert_eq!(counter.observe(&failed()), None);
        assert_eq!(counter.observe(&failed()), Some(Verdict::Unresolvable));
        assert_eq!(counter.observe(&failed()), Some(Verdict::Unresolvable));
        assert_eq!(counter.consecutive(), 4);
    }

    #[test]
    fn an_answer_resets_the_failure_count() {
        let mut counter = FailureCounter::new(2);
        assert_eq!(counter.observe(&failed()), None);
        assert_eq!(counter.observe(&CheckResult::Owner), Some(Verdict::Owner));
        assert_eq!(counter.observe(&failed()), None);
        assert_eq!(
            counter.observe(&CheckResult::NoRecord),
            Some(Verdict::NotOwner)
        );
        assert_eq!(counter.observe(&failed()), None);
        assert_eq!(
            counter.observe(&CheckResult::OtherOwner(vec!["x".into()])),
            Some(Verdict::NotOwner)
        );
        assert_eq!(counter.consecutive(), 0);
    }

    #[test]
    fn ambiguous_records_count_as_failures() {
        let mut counter = FailureCounter::new(2);
        let ambiguous = CheckResult::Failed(Failure::Ambiguous(vec!["a".into(), "b".into()]));
        assert_eq!(counter.observe(&ambiguous), None);
        assert_eq!(counter.observe(&ambiguous), Some(Verdict::Unresolvable));
    }

    #[test]
    fn threshold_zero_means_one() {
        let mut counter = FailureCounter::new(0);
        assert_eq!(counter.observe(&failed()), Some(Verdict::Unresolvable));
    }

    #[test]
    fn labels_are_bounded_and_distinct() {
        let results = [
            CheckResult::Owner,
            CheckResult::OtherOwner(vec![]),
            CheckResult::NoRecord,
            CheckResult::Failed(Failure::Timeout),
            CheckResult::Failed(Failure::ServerError(String::new())),
            CheckResult::Failed(Failure::Network(String::new())),
            CheckResult::Failed(Failure::Inconclusive(String::new())),
            CheckResult::Failed(Failure::Ambiguous(vec![])),
        ];
        let labels: std::collections::HashSet<_> = results.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), results.len());
    }
}
