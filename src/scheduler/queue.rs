//! The router's admission queue (DESIGN §13): requests that the fleet has no room for wait
//! here, in priority bands, until a worker has room, their deadline passes or their client
//! goes away. No I/O: the driver (the ingress, the replay bench) pushes tickets with `now_ms`,
//! asks for the next one when room may have opened, and removes tickets that expire or whose
//! client left; the payload `T` is whatever the driver needs to resume the request.
//!
//! Order:
//! - **Bands are strict**: while a ticket of a higher band waits, no lower band's ticket is
//!   offered.
//! - **Tenants within a band share by work**: deficit round robin over tokens, in its limit of
//!   a one-token quantum (start-time fair queueing, Goyal, Vin, Cheng, SIGCOMM 1996). Each
//!   backlogged tenant carries a tag, the tokens it has been served since it became
//!   backlogged, offset so that a tenant arriving starts level with the least-served one (no
//!   credit banked while idle). The tenant with the lowest tag goes next, and its tag grows by
//!   the ticket's work. Two tenants backlogged from the same moment are therefore never more
//!   than one request's work apart in what they were served, whatever their request sizes
//!   or rates (a request-count round robin would give a tenant of 8k-token prompts 8× the
//!   GPU time of one sending 1k).
//! - Within a tenant, first come first served.
//!
//! Everything is bounded: each band holds at most `max_queued` tickets; a tenant's state is
//! dropped when its last ticket leaves, so memory follows what is queued, apart from the
//! charge of a tenant that left ahead of the band's level, kept until the level reaches it
//! (at most [`MAX_IDLE_TENANTS`] a band).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

/// Idle tenants a band remembers the charge of, at most.
pub const MAX_IDLE_TENANTS: usize = 10_000;

/// Limits of one priority band.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BandConfig {
    /// Most tickets waiting in the band; beyond it a request is refused at once (429).
    pub max_queued: usize,
    /// Longest a ticket waits before it is refused (429 with `Retry-After`), ms.
    pub ttl_ms: u64,
    /// Share of each worker's work budget this band's requests may fill, 0..=1: below 1,
    /// the rest stays free for higher bands (a best-effort band at 0.5 never leaves a
    /// premium request waiting behind more than half a budget of its work).
    pub budget_share: f64,
}

impl Default for BandConfig {
    /// llm-d 1.0's flow-control defaults: 5,000 requests a band, 60 s; the whole budget.
    fn default() -> Self {
        BandConfig {
            max_queued: 5_000,
            ttl_ms: 60_000,
            budget_share: 1.0,
        }
    }
}

/// Settings of the queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Limits of every band not listed in `bands`.
    pub default_band: BandConfig,
    /// Per-band limits, by band (TOML keys are strings: `[scheduler.queue.bands."1"]`).
    pub bands: BTreeMap<i32, BandConfig>,
    /// Lowest band a request may name; lower values are raised to it.
    pub lowest_band: i32,
    /// Highest band a request may name; higher values are lowered to it.
    pub highest_band: i32,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            default_band: BandConfig::default(),
            bands: BTreeMap::new(),
            lowest_band: -10,
            highest_band: 10,
        }
    }
}

/// A queue configuration that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueueConfigError {
    /// `lowest_band` above `highest_band`.
    #[error("scheduler.queue: lowest_band {lowest} is above highest_band {highest}")]
    BandRange {
        /// The lowest band.
        lowest: i32,
        /// The highest band.
        highest: i32,
    },
    /// A band that holds nothing, forgets at once, or has a budget share outside 0..=1.
    #[error(
        "scheduler.queue band {band:?}: max_queued and ttl_ms must be at least 1, budget_share in (0, 1]"
    )]
    EmptyBand {
        /// The band (`None`: the default).
        band: Option<i32>,
    },
    /// Limits for a band no request can be in (every band is clamped to the range).
    #[error(
        "scheduler.queue: limits for band {band}, outside the bands requests get ({lowest} to {highest}): they would never apply"
    )]
    OutOfRange {
        /// The band.
        band: i32,
        /// The lowest band.
        lowest: i32,
        /// The highest band.
        highest: i32,
    },
}

impl QueueConfig {
    /// Checks the band range and every band's limits.
    pub fn validate(&self) -> Result<(), QueueConfigError> {
        if self.lowest_band > self.highest_band {
            return Err(QueueConfigError::BandRange {
                lowest: self.lowest_band,
                highest: self.highest_band,
            });
        }
        if let Some(&band) = self
            .bands
            .keys()
            .find(|b| !(self.lowest_band..=self.highest_band).contains(*b))
        {
            return Err(QueueConfigError::OutOfRange {
                band,
                lowest: self.lowest_band,
                highest: self.highest_band,
            });
        }
        let bands = std::iter::once((None, &self.default_band))
            .chain(self.bands.iter().map(|(b, c)| (Some(*b), c)));
        for (band, c) in bands {
            if c.max_queued == 0
                || c.ttl_ms == 0
                || !(c.budget_share > 0.0 && c.budget_share <= 1.0)
            {
                return Err(QueueConfigError::EmptyBand { band });
            }
        }
        Ok(())
    }

    /// The band a request asking for `band` gets (clamped to the configured range).
    pub fn clamp(&self, band: i64) -> i32 {
        band.clamp(i64::from(self.lowest_band), i64::from(self.highest_band)) as i32
    }

    /// The limits of `band`.
    pub fn band(&self, band: i32) -> BandConfig {
        self.bands.get(&band).copied().unwrap_or(self.default_band)
    }
}

/// What the queue needs to know of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// Its priority band (already clamped); higher is served first.
    pub band: i32,
    /// Who sent it, for fairness within the band.
    pub tenant: Arc<str>,
    /// Its work, tokens (uncached prefill and expected decode); at least 1 is counted.
    pub work_tokens: u64,
}

/// Names a queued ticket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TicketId(pub u64);

/// Why a ticket was not queued.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    /// The band already holds its limit.
    #[error("priority band {band} already has {limit} requests waiting")]
    Full {
        /// The band.
        band: i32,
        /// Its limit.
        limit: usize,
    },
}

/// A ticket leaving the queue.
#[derive(Debug, PartialEq, Eq)]
pub struct Left<T> {
    /// Its id.
    pub id: TicketId,
    /// The ticket.
    pub ticket: Ticket,
    /// What the driver stored with it.
    pub payload: T,
    /// How long it waited, ms.
    pub waited_ms: u64,
}

#[derive(Debug)]
struct Entry<T> {
    ticket: Ticket,
    payload: T,
    queued_ms: u64,
    deadline_ms: u64,
}

#[derive(Debug, Default)]
struct Tenant {
    /// Its tickets, oldest first.
    tickets: VecDeque<TicketId>,
    /// Tokens served since it became backlogged, offset to the band's level when it did.
    tag: u64,
}

#[derive(Debug, Default)]
struct Band {
    tenants: FxHashMap<Arc<str>, Tenant>,
    /// Backlogged tenants by (tag, arrival order): the first goes next.
    order: BTreeSet<(u64, u64, Arc<str>)>,
    /// The tag of the tenant served last: where a tenant that becomes backlogged starts.
    level: u64,
    queued: usize,
    /// Tenants by when they became backlogged, to break tag ties first come first served.
    arrivals: u64,
    /// Arrival order of each backlogged tenant (its key in `order`).
    arrival_of: FxHashMap<Arc<str>, u64>,
    /// Tenants whose backlog emptied, by the tag they ended at, while it is ahead of
    /// `level`: one that comes back resumes there, keeping the charge of what it was served
    /// (start-time fair queuing's finish tag). Forgotten once `level` reaches it, when
    /// starting level with the band is the same.
    idle: BTreeSet<(u64, Arc<str>)>,
    idle_tag: FxHashMap<Arc<str>, u64>,
}

/// Counters of one band since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BandCounters {
    /// Tickets queued.
    pub queued: u64,
    /// Tickets that left to be served.
    pub admitted: u64,
    /// Tickets refused because the band was full.
    pub refused_full: u64,
    /// Tickets whose deadline passed.
    pub expired: u64,
    /// Tickets whose client went away.
    pub cancelled: u64,
    /// Tickets that gave up their place to a request of a higher band, which found the
    /// router at its limit of requests at once ([`AdmissionQueue::displace`]).
    pub displaced: u64,
}

/// A band as `/admin/queues` shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BandView {
    /// The band.
    pub band: i32,
    /// Tickets waiting.
    pub depth: usize,
    /// Its limits.
    pub max_queued: usize,
    /// Its deadline, ms.
    pub ttl_ms: u64,
    /// Share of the work budget it may fill.
    pub budget_share: f64,
    /// The oldest ticket's wait so far, ms.
    pub oldest_wait_ms: u64,
    /// Tickets waiting, by tenant.
    pub tenants: BTreeMap<String, usize>,
    /// Since start.
    pub counters: BandCounters,
}

/// The admission queue.
#[derive(Debug)]
pub struct AdmissionQueue<T> {
    config: QueueConfig,
    entries: FxHashMap<TicketId, Entry<T>>,
    /// Bands that hold tickets, highest first.
    bands: BTreeMap<std::cmp::Reverse<i32>, Band>,
    deadlines: BTreeSet<(u64, TicketId)>,
    counters: BTreeMap<i32, BandCounters>,
    next_id: u64,
}

impl<T> AdmissionQueue<T> {
    /// An empty queue (`config` validated by the caller).
    pub fn new(config: QueueConfig) -> Self {
        AdmissionQueue {
            config,
            entries: FxHashMap::default(),
            bands: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            counters: BTreeMap::new(),
            next_id: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// Tickets waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Queues `ticket` (its band clamped to the configured range), or refuses it when its
    /// band is full.
    pub fn push(
        &mut self,
        now_ms: u64,
        mut ticket: Ticket,
        payload: T,
    ) -> Result<TicketId, Refused> {
        ticket.band = self.config.clamp(i64::from(ticket.band));
        ticket.work_tokens = ticket.work_tokens.max(1);
        let limits = self.config.band(ticket.band);
        let counters = self.counters.entry(ticket.band).or_default();
        let band = self
            .bands
            .entry(std::cmp::Reverse(ticket.band))
            .or_default();
        if band.queued >= limits.max_queued {
            counters.refused_full += 1;
            return Err(Refused::Full {
                band: ticket.band,
                limit: limits.max_queued,
            });
        }
        counters.queued += 1;
        self.next_id += 1;
        let id = TicketId(self.next_id);
        let tenant = band.tenants.entry(Arc::clone(&ticket.tenant)).or_default();
        if tenant.tickets.is_empty() {
            // Becoming backlogged: start level with the band (no credit banked while idle),
            // or where it ended if that is still ahead (its last service stays charged).
            let ended = band.idle_tag.remove(&ticket.tenant);
            if let Some(ended) = ended {
                band.idle.remove(&(ended, Arc::clone(&ticket.tenant)));
            }
            tenant.tag = tenant.tag.max(band.level).max(ended.unwrap_or(0));
            band.arrivals += 1;
            band.arrival_of
                .insert(Arc::clone(&ticket.tenant), band.arrivals);
            band.order
                .insert((tenant.tag, band.arrivals, Arc::clone(&ticket.tenant)));
        }
        tenant.tickets.push_back(id);
        band.queued += 1;
        let deadline_ms = now_ms.saturating_add(limits.ttl_ms);
        self.deadlines.insert((deadline_ms, id));
        self.entries.insert(
            id,
            Entry {
                ticket,
                payload,
                queued_ms: now_ms,
                deadline_ms,
            },
        );
        Ok(id)
    }

    /// The ticket that goes next when room opens: the fairest tenant's oldest ticket in the
    /// highest band that has one.
    pub fn peek(&self) -> Option<(TicketId, &Ticket, &T)> {
        let band = self.bands.values().next()?;
        let (_, _, tenant) = band.order.first()?;
        let id = *band.tenants.get(tenant)?.tickets.front()?;
        let entry = self.entries.get(&id)?;
        Some((id, &entry.ticket, &entry.payload))
    }

    /// Takes the ticket [`AdmissionQueue::peek`] offered, to be served: its tenant is charged
    /// its work. `None` if `id` is not the next one (the queue changed since).
    pub fn admit(&mut self, now_ms: u64, id: TicketId) -> Option<Left<T>> {
        if self.peek().map(|(next, _, _)| next) != Some(id) {
            return None;
        }
        self.admit_waiting(now_ms, id)
    }

    /// A waiting ticket and its payload.
    pub fn get(&self, id: TicketId) -> Option<(&Ticket, &T)> {
        self.entries.get(&id).map(|e| (&e.ticket, &e.payload))
    }

    /// The waiting tickets in the order they would go if nothing changed meanwhile: bands
    /// highest first, tenants by fairness, each tenant's oldest first. The first is
    /// [`AdmissionQueue::peek`]'s.
    pub fn in_order(&self) -> impl Iterator<Item = (TicketId, &Ticket, &T)> {
        self.bands.values().flat_map(move |band| {
            band.order.iter().flat_map(move |(_, _, tenant)| {
                band.tenants
                    .get(tenant)
                    .into_iter()
                    .flat_map(|t| t.tickets.iter())
                    .filter_map(move |id| {
                        let e = self.entries.get(id)?;
                        Some((*id, &e.ticket, &e.payload))
                    })
            })
        })
    }

    /// Takes any waiting ticket to be served, charged as [`AdmissionQueue::admit`] charges:
    /// for a driver that lets a ticket go past ones that cannot be served yet (another
    /// model's, whose workers are full).
    pub fn admit_waiting(&mut self, now_ms: u64, id: TicketId) -> Option<Left<T>> {
        let left = self.remove(now_ms, id, true)?;
        self.counters.entry(left.ticket.band).or_default().admitted += 1;
        Some(left)
    }

    /// Counts a request of `band` that found nothing waiting and was routed at once, without
    /// a ticket: queued and admitted, with no wait.
    pub fn passed(&mut self, band: i32) {
        let c = self
            .counters
            .entry(self.config.clamp(i64::from(band)))
            .or_default();
        c.queued += 1;
        c.admitted += 1;
    }

    /// Removes a ticket whose client went away (or that the driver gave up on).
    pub fn cancel(&mut self, now_ms: u64, id: TicketId) -> Option<Left<T>> {
        let left = self.remove(now_ms, id, false)?;
        self.counters.entry(left.ticket.band).or_default().cancelled += 1;
        Some(left)
    }

    /// Removes the ticket that would go last of the lowest band below `band` (that band's
    /// newest), for a request of `band` to take its place: `None` if no band below it holds
    /// one.
    pub fn displace(&mut self, now_ms: u64, band: i32) -> Option<Left<T>> {
        let band = self.config.clamp(i64::from(band));
        let (std::cmp::Reverse(lowest), tickets) = self.bands.iter().next_back()?;
        if *lowest >= band {
            return None;
        }
        let newest = tickets
            .tenants
            .values()
            .filter_map(|t| t.tickets.back())
            .max()
            .copied()?;
        let left = self.remove(now_ms, newest, false)?;
        self.counters.entry(left.ticket.band).or_default().displaced += 1;
        Some(left)
    }

    /// Removes and returns every ticket whose deadline is at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Left<T>> {
        let mut out = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now_ms {
                break;
            }
            if let Some(left) = self.remove(now_ms, id, false) {
                self.counters.entry(left.ticket.band).or_default().expired += 1;
                out.push(left);
            }
        }
        out
    }

    /// The earliest deadline of a waiting ticket, ms.
    pub fn next_deadline_ms(&self) -> Option<u64> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// Tickets waiting in `band`.
    pub fn depth(&self, band: i32) -> usize {
        self.bands
            .get(&std::cmp::Reverse(band))
            .map_or(0, |b| b.queued)
    }

    /// How long `band`'s oldest ticket has waited, ms (0: none waits).
    pub fn oldest_wait_ms(&self, band: i32, now_ms: u64) -> u64 {
        let Some(b) = self.bands.get(&std::cmp::Reverse(band)) else {
            return 0;
        };
        b.tenants
            .values()
            .filter_map(|t| self.entries.get(t.tickets.front()?))
            .map(|e| now_ms.saturating_sub(e.queued_ms))
            .max()
            .unwrap_or(0)
    }

    /// Every band that holds tickets or ever did, highest first: (band, depth, max queued,
    /// deadline ms). What the gauges need, in O(bands): [`AdmissionQueue::view`] walks
    /// every ticket, and a scrape is open to anyone and comes while the queue is full.
    pub fn depths(&self) -> Vec<(i32, usize, usize, u64)> {
        self.counters
            .keys()
            .rev()
            .map(|band| {
                let limits = self.config.band(*band);
                (*band, self.depth(*band), limits.max_queued, limits.ttl_ms)
            })
            .collect()
    }

    /// Every band that holds tickets or ever did, highest first.
    pub fn view(&self, now_ms: u64) -> Vec<BandView> {
        let mut oldest: BTreeMap<i32, u64> = BTreeMap::new();
        let mut tenants: BTreeMap<i32, BTreeMap<String, usize>> = BTreeMap::new();
        for e in self.entries.values() {
            let wait = now_ms.saturating_sub(e.queued_ms);
            let o = oldest.entry(e.ticket.band).or_default();
            *o = (*o).max(wait);
            *tenants
                .entry(e.ticket.band)
                .or_default()
                .entry(e.ticket.tenant.to_string())
                .or_default() += 1;
        }
        self.counters
            .iter()
            .rev()
            .map(|(band, counters)| {
                let limits = self.config.band(*band);
                BandView {
                    band: *band,
                    depth: self.depth(*band),
                    max_queued: limits.max_queued,
                    ttl_ms: limits.ttl_ms,
                    budget_share: limits.budget_share,
                    oldest_wait_ms: oldest.get(band).copied().unwrap_or(0),
                    tenants: tenants.remove(band).unwrap_or_default(),
                    counters: *counters,
                }
            })
            .collect()
    }

    /// The counters of `band`.
    pub fn counters(&self, band: i32) -> BandCounters {
        self.counters.get(&band).copied().unwrap_or_default()
    }

    fn remove(&mut self, now_ms: u64, id: TicketId, charge: bool) -> Option<Left<T>> {
        let entry = self.entries.remove(&id)?;
        self.deadlines.remove(&(entry.deadline_ms, id));
        let key = std::cmp::Reverse(entry.ticket.band);
        let band = self
            .bands
            .get_mut(&key)
            .expect("invariant: a queued ticket's band exists");
        band.queued -= 1;
        let name = &entry.ticket.tenant;
        let tenant = band
            .tenants
            .get_mut(name)
            .expect("invariant: a queued ticket's tenant exists");
        let arrival = *band
            .arrival_of
            .get(name)
            .expect("invariant: a backlogged tenant has an arrival");
        band.order.remove(&(tenant.tag, arrival, Arc::clone(name)));
        if charge {
            // The band's virtual time is the start tag of the ticket in service. A ticket
            // served out of order (another model's went past one that must wait) starts
            // later than the backlogged tenants ahead of it: the level goes no further than
            // the lowest of their tags, so that a tenant arriving now does not start behind
            // them, and it never goes back.
            let ahead = band.order.first().map_or(tenant.tag, |(tag, _, _)| *tag);
            band.level = band.level.max(tenant.tag.min(ahead));
            tenant.tag += entry.ticket.work_tokens;
        }
        if let Some(at) = tenant.tickets.iter().position(|t| *t == id) {
            tenant.tickets.remove(at);
        }
        if tenant.tickets.is_empty() {
            if tenant.tag > band.level {
                band.idle.insert((tenant.tag, Arc::clone(name)));
                band.idle_tag.insert(Arc::clone(name), tenant.tag);
            }
            band.tenants.remove(name);
            band.arrival_of.remove(name);
        } else {
            band.order.insert((tenant.tag, arrival, Arc::clone(name)));
        }
        // Forgotten once the level reaches them, and the nearest to it first past a bound:
        // the level stands still while a tenant ahead is held back (its model's workers
        // full), and tenant names come from clients. One forgotten early comes back level
        // with the band, credited at most its lead over the level.
        while let Some((ended, name)) = band.idle.first().cloned()
            && (ended <= band.level || band.idle.len() > MAX_IDLE_TENANTS)
        {
            band.idle.pop_first();
            band.idle_tag.remove(&name);
        }
        if band.queued == 0 {
            // Nobody waits: nothing to be fair between until a backlog forms again.
            self.bands.remove(&key);
        }
        Some(Left {
            id,
            waited_ms: now_ms.saturating_sub(entry.queued_ms),
            ticket: entry.ticket,
            payload: entry.payload,
        })
    }
}

#[cfg(test)]
mod tests;
