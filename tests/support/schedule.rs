//! Seeded, reproducible fault schedules: a seed gives the same schedule on every machine.
//!
//! The generator draws from its own SplitMix64, never from a library whose sequence may change
//! between versions.

use std::fmt;

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and the same everywhere.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.range(0, 99) < percent
    }

    /// An index drawn with the given weights.
    pub fn weighted(&mut self, weights: &[u64]) -> usize {
        let total: u64 = weights.iter().sum();
        let mut x = self.range(0, total - 1);
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}

/// One fault (or harness action) of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The owner record names another seed.
    RecordOther,
    /// The owner record is deleted (NXDOMAIN).
    RecordDeleted,
    /// The owner record names us again.
    RecordUs,
    /// The DNS server answers SERVFAIL until healed.
    DnsServFail,
    /// The DNS server reads queries and never answers until healed.
    DnsSilent,
    /// The DNS server stops (port closed) until healed.
    DnsStop,
    /// DNS answers normally again (server running, zone as it is).
    DnsHeal,
    /// The store refuses connections and open ones are cut.
    StoreDown,
    /// Every chunk to and from the store is delayed this many ms.
    StoreSlow(u64),
    /// The store accepts connections and never answers.
    StoreBlackhole,
    /// The store performs every request and its answers are lost (the connection is cut at the
    /// answer's first byte) until healed.
    StoreLoseAnswers,
    /// Every answer of the store arrives this many ms late (past the sidecars'
    /// `snapshot.timeout`, so the store completes what the client gave up on) until healed.
    StoreLate(u64),
    /// The store passes traffic again.
    StoreHeal,
    /// SIGKILL the sidecar of `member`; the kubelet starts it again after `down_ms`.
    SidecarKill { member: usize, down_ms: u64 },
    /// Wait (up to 3 s) until the sidecar's `/status` first shows `deactivated`, then SIGKILL it
    /// at once; restarted after `down_ms`.
    SidecarKillWhenDeactivated { member: usize, down_ms: u64 },
    /// SIGKILL etcd inside `member`'s pod; the kubelet starts it again.
    EtcdKill { member: usize },
    /// `POST /snapshot/full` to `member`'s sidecar.
    HttpFull { member: usize },
    /// `POST /snapshot/full?final=true` to `member`'s sidecar.
    HttpFinal { member: usize },
    /// `POST /snapshot/delta` to `member`'s sidecar.
    HttpDelta { member: usize },
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::RecordOther => write!(f, "record→other"),
            Fault::RecordDeleted => write!(f, "record deleted"),
            Fault::RecordUs => write!(f, "record→us"),
            Fault::DnsServFail => write!(f, "dns SERVFAIL"),
            Fault::DnsSilent => write!(f, "dns silent"),
            Fault::DnsStop => write!(f, "dns stopped"),
            Fault::DnsHeal => write!(f, "dns healed"),
            Fault::StoreDown => write!(f, "store down"),
            Fault::StoreSlow(ms) => write!(f, "store slow {ms}ms/chunk"),
            Fault::StoreBlackhole => write!(f, "store blackholed"),
            Fault::StoreLoseAnswers => write!(f, "store loses answers"),
            Fault::StoreLate(ms) => write!(f, "store answers {ms}ms late"),
            Fault::StoreHeal => write!(f, "store healed"),
            Fault::SidecarKill { member, down_ms } => {
                write!(f, "SIGKILL sidecar m{member} (down {down_ms}ms)")
            }
            Fault::SidecarKillWhenDeactivated { member, down_ms } => {
                write!(
                    f,
                    "SIGKILL sidecar m{member} once deactivated (down {down_ms}ms)"
                )
            }
            Fault::EtcdKill { member } => write!(f, "SIGKILL etcd m{member}"),
            Fault::HttpFull { member } => write!(f, "POST m{member} /snapshot/full"),
            Fault::HttpFinal { member } => write!(f, "POST m{member} /snapshot/full?final=true"),
            Fault::HttpDelta { member } => write!(f, "POST m{member} /snapshot/delta"),
        }
    }
}

/// What the owner record says once the schedule is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Another seed: a hand-off, so a final snapshot must appear.
    Other,
    /// Deleted: also a hand-off.
    Deleted,
    /// Us again.
    Us,
    /// Another seed; once that hand-off settled, the record names us again, `etcd-warden
    /// reclaim` undoes the hand-off, the sidecars restart and serve with writes, and the record
    /// names another seed again: a second hand-off, whose final must be the one readers see.
    Reclaim,
}

impl Ending {
    /// Whether the record ends naming someone else (or no one): a hand-off.
    pub fn hands_off(self) -> bool {
        self != Ending::Us
    }
}

/// A store fault played after the record's final change, timed to meet the final's upload (the
/// flip is seen after about two `owner.interval`s; the kill and `kill.settle` take a second or
/// more), then healed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndStore {
    /// `StoreLoseAnswers` or `StoreLate`.
    pub fault: Fault,
    /// From the record's change to the fault.
    pub after_ms: u64,
    /// From the fault to healing it.
    pub for_ms: u64,
}

/// Which member dies for good right after its fence marker is listed in the final hand-off
/// (its sidecar and its etcd are SIGKILLed and never started again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Burial {
    /// The member that takes the final: the one with the lowest etcd member ID.
    Taker,
    /// Member `i`, whichever it is.
    Member(usize),
}

/// One step: wait, then inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub wait_ms: u64,
    pub fault: Fault,
}

/// A whole schedule, reproducible from `seed` and `members`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub seed: u64,
    pub members: usize,
    /// `owner.interval` (and `owner.timeout`) of the sidecars, ms.
    pub interval_ms: u64,
    pub steps: Vec<Step>,
    pub ending: Ending,
    /// A second writer puts keys on etcd leases of 1–3 s that nobody keeps alive, all through the
    /// run: their expiry moves the revision after a kill without any client write.
    pub leases: bool,
    /// A store fault right after the final change of the record.
    pub end_store: Option<EndStore>,
    /// A member killed for good after its fence in the final hand-off (3 members only).
    pub burial: Option<Burial>,
}

impl Schedule {
    /// The schedule of `seed` for a cluster of `members`.
    pub fn generate(seed: u64, members: usize) -> Schedule {
        // Mix the member count in so that one seed gives unrelated single and cluster schedules.
        let mut rng = SplitMix64::new(seed ^ (members as u64).wrapping_mul(0xA24B_AED4_963E_E407));
        let interval_ms = rng.range(200, 300);
        let count = rng.range(4, 10);
        let mut steps = Vec::new();
        let mut last_flip = false;
        for _ in 0..count {
            // Mostly tens to hundreds of ms; sometimes long enough for the sidecars to act.
            let wait_ms = if rng.chance(20) {
                rng.range(800, 2000)
            } else {
                rng.range(20, 600)
            };
            let member = rng.range(0, members as u64 - 1) as usize;
            let down_ms = rng.range(0, 800);
            // The "worst moment" kill only makes sense right after the record stopped naming us.
            let fault = if last_flip && rng.chance(35) {
                Fault::SidecarKillWhenDeactivated { member, down_ms }
            } else {
                let weights = [
                    10, // record other
                    4,  // record deleted
                    8,  // record us
                    5,  // servfail
                    3,  // silent
                    3,  // dns stop
                    6,  // dns heal
                    4,  // store down
                    3,  // store slow
                    3,  // store blackhole
                    6,  // store heal
                    5,  // sidecar kill
                    6,  // etcd kill
                    4,  // http full
                    6,  // http final
                    4,  // http delta
                ];
                match rng.weighted(&weights) {
                    0 => Fault::RecordOther,
                    1 => Fault::RecordDeleted,
                    2 => Fault::RecordUs,
                    3 => Fault::DnsServFail,
                    4 => Fault::DnsSilent,
                    5 => Fault::DnsStop,
                    6 => Fault::DnsHeal,
                    7 => Fault::StoreDown,
                    8 => Fault::StoreSlow(rng.range(5, 80)),
                    9 => Fault::StoreBlackhole,
                    10 => Fault::StoreHeal,
                    11 => Fault::SidecarKill { member, down_ms },
                    12 => Fault::EtcdKill { member },
                    13 => Fault::HttpFull { member },
                    14 => Fault::HttpFinal { member },
                    _ => Fault::HttpDelta { member },
                }
            };
            last_flip = matches!(fault, Fault::RecordOther | Fault::RecordDeleted);
            steps.push(Step { wait_ms, fault });
        }
        let mut ending = match rng.range(0, 99) {
            0..=64 => Ending::Other,
            65..=79 => Ending::Deleted,
            _ => Ending::Us,
        };
        // The faults added for issue 28 come from a second stream, so the faults above stay what
        // they were for every seed (the CI seeds chosen before keep their steps and ending).
        let mut x = SplitMix64::new(
            seed ^ (members as u64).wrapping_mul(0xA24B_AED4_963E_E407) ^ 0x28_28_28_28_28_28_28,
        );
        let late = |x: &mut SplitMix64| Fault::StoreLate(x.range(3500, 6000));
        if x.chance(20) {
            let at = x.range(0, steps.len() as u64) as usize;
            let wait_ms = x.range(20, 600);
            steps.insert(
                at,
                Step {
                    wait_ms,
                    fault: Fault::StoreLoseAnswers,
                },
            );
        }
        if x.chance(15) {
            let at = x.range(0, steps.len() as u64) as usize;
            let wait_ms = x.range(20, 600);
            let fault = late(&mut x);
            steps.insert(at, Step { wait_ms, fault });
        }
        let leases = x.chance(35);
        if ending == Ending::Other && x.chance(25) {
            ending = Ending::Reclaim;
        }
        let end_store = if x.chance(30) {
            let fault = if x.chance(50) {
                Fault::StoreLoseAnswers
            } else {
                late(&mut x)
            };
            Some(EndStore {
                fault,
                after_ms: x.range(800, 3000),
                for_ms: x.range(500, 3000),
            })
        } else {
            None
        };
        let burial = if members == 3 && matches!(ending, Ending::Other | Ending::Deleted) {
            x.chance(30).then(|| {
                if x.chance(70) {
                    Burial::Taker
                } else {
                    Burial::Member(x.range(0, members as u64 - 1) as usize)
                }
            })
        } else {
            None
        };
        Schedule {
            seed,
            members,
            interval_ms,
            steps,
            ending,
            leases,
            end_store,
            burial,
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "schedule seed={:#018x} members={} owner.interval={}ms ending={:?}",
            self.seed, self.members, self.interval_ms, self.ending
        )?;
        let mut t = 0;
        for (i, s) in self.steps.iter().enumerate() {
            t += s.wait_ms;
            writeln!(f, "  {i:2}. +{:4}ms (~{:5}ms) {}", s.wait_ms, t, s.fault)?;
        }
        if self.leases {
            writeln!(f, "  all through: keys on 1–3 s leases, never kept alive")?;
        }
        write!(
            f,
            "  then heal everything, record → {:?}, settle",
            self.ending
        )?;
        if let Some(e) = self.end_store {
            write!(
                f,
                "\n  after the record's change: +{}ms {} for {}ms, healed",
                e.after_ms, e.fault, e.for_ms
            )?;
        }
        if let Some(b) = self.burial {
            write!(
                f,
                "\n  after its fence: bury {b:?} (sidecar and etcd, never restarted)"
            )?;
        }
        Ok(())
    }
}
