//! What holds a poller's horizon back, and what `settle: "auto"` may conclude from what the server
//! lists. Pure: the questions are asked in `source::horizon`.
//!
//! - [`HorizonHolder`]: the oldest transaction that holds the commit horizon (an xid cursor) or the
//!   `settle: "auto"` bound: who it is (pid, role, application, or a prepared transaction's gid and
//!   owner), its state and age. Its query text is kept only for an operator's `dbtrigger status`
//!   ([`Audience`]): it may hold values (a password in an `ALTER ROLE`), and the status function,
//!   the watchdog and its alerts reach people who need not see them.
//! - [`settle_auto_refusal`]: a server that is not where the rows are written (a hot standby, a
//!   replica, a Galera node) cannot list the transactions that will still commit rows: there
//!   `settle: "auto"` would be a guess, and it is refused.
//! - [`PreparedHold`]: a prepared transaction (two-phase commit) has no session and no start time
//!   the server reports; its rows carry that start. The bound stays where it was before it was
//!   first seen, until it ends.

use std::collections::BTreeMap;

use chrono::NaiveDateTime;
use serde::Serialize;

/// What a poller's read is held behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Horizon {
    /// An xid cursor's commit horizon: the oldest transaction that holds an xid, anywhere in the
    /// cluster, holds every xid poller of the cluster.
    CommitHorizon,
    /// `settle: "auto"`: the oldest transaction open in the database (PostgreSQL) or the server
    /// (InnoDB), a prepared one included.
    SettleBound,
}

/// Who reads a status: what it may show of other sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// `dbtrigger status`, run by an operator who can reach the database anyway: the holder's
    /// query text (its first characters) is shown.
    Operator,
    /// The status function (anyone with a function key), the watchdog, its log lines and its
    /// alert webhook: never another session's query text.
    Published,
}

/// The oldest open transaction, which holds a poller's horizon back while rows wait behind it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HorizonHolder {
    pub holds: Horizon,
    /// Its session (PostgreSQL `pid`, MySQL thread id); none for a prepared transaction.
    pub pid: Option<i64>,
    /// A prepared transaction's global id (`PREPARE TRANSACTION 'gid'`).
    pub gid: Option<String>,
    /// Its transaction id (PostgreSQL xid, InnoDB `trx_id`), when the server shows one: the same
    /// id at two watchdog runs is the same transaction.
    pub transaction: Option<String>,
    pub database: Option<String>,
    /// The role (user) it runs as; a prepared transaction's owner.
    pub role: Option<String>,
    /// PostgreSQL `application_name`.
    pub application: Option<String>,
    /// How long the transaction has been open (a prepared one: since it was prepared); `None`
    /// when the server hides it from this role (PostgreSQL without `pg_read_all_stats`).
    pub age_seconds: Option<f64>,
    /// `idle in transaction`, `active`, `RUNNING`, `prepared`…
    pub state: Option<String>,
    /// The first characters of its query ([`query_prefix`]), for [`Audience::Operator`] only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
}

/// How many characters of a holder's query an operator's `status` shows.
pub const QUERY_PREFIX_CHARS: usize = 40;

/// The first [`QUERY_PREFIX_CHARS`] characters of a query, its runs of white space made one
/// space, with `…` when it was cut.
pub fn query_prefix(query: &str) -> String {
    let collapsed = query.split_whitespace().collect::<Vec<_>>().join(" ");
    if collapsed.chars().count() <= QUERY_PREFIX_CHARS {
        return collapsed;
    }
    let mut prefix: String = collapsed.chars().take(QUERY_PREFIX_CHARS).collect();
    prefix.push('…');
    prefix
}

impl HorizonHolder {
    /// `pid 4242 (role app, application api, database orders, idle in transaction, open 612 s)`,
    /// or `prepared transaction "t1" (owner app, database orders, prepared 30 s ago)`; then
    /// `: UPDATE orders SET …` when the query is kept.
    pub fn describe(&self) -> String {
        let mut details = Vec::new();
        let who = match (&self.gid, self.pid) {
            (Some(gid), _) => {
                if let Some(owner) = &self.role {
                    details.push(format!("owner {owner}"));
                }
                format!("prepared transaction {gid:?}")
            }
            (None, pid) => {
                if let Some(role) = &self.role {
                    details.push(format!("role {role}"));
                }
                if let Some(application) = self.application.as_deref().filter(|name| !name.is_empty()) {
                    details.push(format!("application {application}"));
                }
                pid.map(|pid| format!("pid {pid}")).unwrap_or_else(|| "a session".to_string())
            }
        };
        if let Some(database) = &self.database {
            details.push(format!("database {database}"));
        }
        if let Some(state) = self.state.as_deref().filter(|_| self.gid.is_none()) {
            details.push(state.to_string());
        }
        details.push(match (self.age_seconds, &self.gid) {
            (Some(age), Some(_)) => format!("prepared {} s ago", age.round() as i64),
            (Some(age), None) => format!("open {} s", age.round() as i64),
            (None, _) => "open for a time this role cannot see (grant it pg_read_all_stats)".to_string(),
        });
        let query = self.query.as_deref().map(|query| format!(": {query}")).unwrap_or_default();
        format!("{who} ({}){query}", details.join(", "))
    }

    /// What stays the same while the same transaction holds: the watchdog's memory of it.
    pub fn identity(&self) -> String {
        let part = |value: Option<String>| value.unwrap_or_default();
        format!(
            "pid={};transaction={};gid={}",
            part(self.pid.map(|pid| pid.to_string())),
            part(self.transaction.clone()),
            part(self.gid.clone())
        )
    }

    /// The holder as `audience` may see it.
    pub fn for_audience(mut self, audience: Audience) -> HorizonHolder {
        if audience == Audience::Published {
            self.query = None;
        }
        self
    }
}

/// What a server says of its place in a replication set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerSigns {
    /// PostgreSQL `pg_is_in_recovery()`: a standby replaying a primary's WAL.
    pub in_recovery: bool,
    /// MySQL/MariaDB `read_only`: a replica, as a rule (a primary takes no ordinary writes then).
    pub read_only: bool,
    /// MySQL/MariaDB replication threads running here (`Slave_running`, `Slaves_running`).
    pub replicating: bool,
    /// `wsrep_on`: a Galera node, whose rows also come from the other nodes' transactions.
    pub galera: bool,
}

/// Why `settle: "auto"` cannot bound this server's rows, or `None` where it can: the bound reads
/// the open transactions of the server it is connected to, which proves something only where every
/// row is written by a transaction of that server.
pub fn settle_auto_refusal(signs: ServerSigns) -> Option<String> {
    const WAY_OUT: &str = "connect the poller to the primary, or use an xid cursor (PostgreSQL), or a fixed settleSeconds with \
                           the late-arrival detector on (a guess, see docs/sources.md)";
    let why = if signs.in_recovery {
        "the server is a hot standby (pg_is_in_recovery()): its pg_stat_activity lists its own sessions, not the primary's \
         transactions whose rows it replays"
    } else if signs.galera {
        "the server is a Galera node (wsrep_on): rows also come from other nodes' transactions, which its INNODB_TRX does not list"
    } else if signs.replicating {
        "the server is a replica (its replication threads run): its INNODB_TRX shows the applier's start, while the rows carry \
         the primary's stamps"
    } else if signs.read_only {
        "the server is read_only (a replica, as a rule): the transactions that write its rows run elsewhere, unlisted here"
    } else {
        return None;
    };
    Some(format!("settle \"auto\" is refused: {why}; {WAY_OUT}"))
}

/// Where a bound read lets rows through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Rows with a cursor below this.
    Below(NaiveDateTime),
    /// None past the checkpoint: a prepared transaction of unknown start is open.
    Everything,
}

/// What a source remembers between its bound reads, to bound a prepared transaction it cannot
/// see the start of. A transaction first listed as prepared at a read was, at the read before,
/// either open (its start was at or above that read's bound) or not started (later than that
/// read): either way its rows are at or above the previous read's bound, which it keeps until it
/// ends. A prepared transaction seen at a source's first read may have started at any time: the
/// source then lets nothing through until it ends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreparedHold {
    /// The bound the database computed at the previous read (its sessions and now, less the margin).
    previous: Option<NaiveDateTime>,
    /// Each prepared transaction listed, by id, and the bound it keeps (`None`: unknown).
    held: BTreeMap<String, Option<NaiveDateTime>>,
}

impl PreparedHold {
    /// The bound for a read whose database computed `computed` and listed `prepared` (ids).
    pub fn bound(&mut self, computed: NaiveDateTime, prepared: &[String]) -> Held {
        self.held.retain(|id, _| prepared.contains(id));
        for id in prepared {
            self.held.entry(id.clone()).or_insert(self.previous);
        }
        self.previous = Some(computed);
        let mut bound = computed;
        for kept in self.held.values() {
            match kept {
                None => return Held::Everything,
                Some(kept) => bound = bound.min(*kept),
            }
        }
        Held::Below(bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> NaiveDateTime {
        chrono::DateTime::from_timestamp(1_780_000_000 + seconds, 0).unwrap().naive_utc()
    }

    fn holder() -> HorizonHolder {
        HorizonHolder {
            holds: Horizon::SettleBound,
            pid: Some(4242),
            gid: None,
            transaction: Some("812".into()),
            database: Some("shop".into()),
            role: Some("app".into()),
            application: Some("api".into()),
            age_seconds: Some(611.6),
            state: Some("idle in transaction".into()),
            query: Some(query_prefix("ALTER ROLE app PASSWORD 'very secret password'")),
        }
    }

    /// Issue 36, section 3: pid, role, application, state and age for everyone; the query text
    /// only for an operator.
    #[test]
    fn the_query_text_is_kept_for_an_operator_only() {
        let operator = holder().for_audience(Audience::Operator);
        assert_eq!(
            operator.describe(),
            "pid 4242 (role app, application api, database shop, idle in transaction, open 612 s): ALTER ROLE app PASSWORD 'very secret pas…"
        );
        let published = holder().for_audience(Audience::Published);
        assert_eq!(
            published.describe(),
            "pid 4242 (role app, application api, database shop, idle in transaction, open 612 s)"
        );
        let json = serde_json::to_string(&published).unwrap();
        assert!(!json.contains("query") && !json.contains("secret"), "{json}");
    }

    /// Issue 35, finding 7: an age the server hides is unknown, never 0.
    #[test]
    fn a_hidden_age_is_unknown_and_a_prepared_transaction_is_named_by_its_gid() {
        let mut hidden = holder().for_audience(Audience::Published);
        hidden.age_seconds = None;
        hidden.state = None;
        assert!(
            hidden
                .describe()
                .ends_with("database shop, open for a time this role cannot see (grant it pg_read_all_stats))")
        );
        let prepared = HorizonHolder {
            pid: None,
            gid: Some("t1".into()),
            application: None,
            state: Some("prepared".into()),
            age_seconds: Some(30.2),
            query: None,
            ..holder()
        };
        assert_eq!(prepared.describe(), "prepared transaction \"t1\" (owner app, database shop, prepared 30 s ago)");
        assert_ne!(prepared.identity(), holder().identity());
    }

    #[test]
    fn settle_auto_is_refused_where_the_rows_are_written_elsewhere() {
        assert_eq!(settle_auto_refusal(ServerSigns::default()), None, "a primary");
        let standby = settle_auto_refusal(ServerSigns { in_recovery: true, ..ServerSigns::default() }).unwrap();
        assert!(standby.contains("hot standby") && standby.contains("connect the poller to the primary"), "{standby}");
        let galera =
            settle_auto_refusal(ServerSigns { galera: true, read_only: true, ..ServerSigns::default() }).unwrap();
        assert!(galera.contains("Galera"), "{galera}");
        let replica = settle_auto_refusal(ServerSigns { replicating: true, ..ServerSigns::default() }).unwrap();
        assert!(replica.contains("replica (its replication threads run)"), "{replica}");
        let read_only = settle_auto_refusal(ServerSigns { read_only: true, ..ServerSigns::default() }).unwrap();
        assert!(read_only.contains("read_only"), "{read_only}");
    }

    /// Issue 35, finding 4: a prepared transaction keeps the bound of the read before it was
    /// first listed (its rows are at or above it) until it ends; one listed at the first read
    /// holds everything.
    #[test]
    fn a_prepared_transaction_keeps_the_bound_of_the_read_before_it_was_listed() {
        let mut hold = PreparedHold::default();
        assert_eq!(hold.bound(at(10), &[]), Held::Below(at(10)));
        assert_eq!(hold.bound(at(20), &["7".into()]), Held::Below(at(10)), "kept at the previous read's bound");
        assert_eq!(hold.bound(at(30), &["7".into()]), Held::Below(at(10)), "however long it stays prepared");
        assert_eq!(hold.bound(at(40), &["7".into(), "9".into()]), Held::Below(at(10)), "the oldest holds");
        assert_eq!(hold.bound(at(50), &["9".into()]), Held::Below(at(30)), "7 ended: 9 keeps the read before its own");
        assert_eq!(hold.bound(at(60), &[]), Held::Below(at(60)), "none left");
        let mut fresh = PreparedHold::default();
        assert_eq!(fresh.bound(at(10), &["7".into()]), Held::Everything, "its start is unknown");
        assert_eq!(fresh.bound(at(20), &["7".into()]), Held::Everything);
        assert_eq!(fresh.bound(at(30), &[]), Held::Below(at(30)));
    }
}
