//! What a binary log's statement (a Query event) is to a binary-log poller (issue 45): a
//! transaction's bounds, an XA transaction's steps, a `TRUNCATE` of a watched table (delivered as
//! an event), a change logged as a statement that names a watched table (it cannot be turned into
//! rows: the poller stops), or something passed (DDL, savepoints, statements on other tables).
//!
//! A statement-logged change is found by the tables its text names, over-approximated: every name
//! (`t`, `` `t` ``, `"t"`) is taken as a table of the statement's default schema and every
//! `a.b` as table `b` of schema `a`, wherever it stands (a column named like a watched table
//! counts too), case aside; text in single quotes and plain comments is not read, the body of an
//! executable comment (`/*!40101 … */`) is. A wrong match stops the poller (loud); a statement
//! that changes a watched table without naming it (a trigger or a stored function of another
//! table) is not seen: that is said in docs/binlog.md.

use std::collections::HashSet;

/// An XA statement's verb.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XaVerb {
    Start,
    End,
    Prepare,
    Commit,
    Rollback,
}

/// What a statement is to a poller watching some tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Query {
    /// `BEGIN`, `START TRANSACTION`.
    Begin,
    /// `COMMIT`, `ROLLBACK` (not `ROLLBACK TO SAVEPOINT`): the transaction ends.
    End,
    /// An XA statement and its xid as the server wrote it (`X'7831',X'',1`).
    Xa { verb: XaVerb, xid: String },
    /// `TRUNCATE [TABLE]` of a watched table (`database.table`).
    Truncate { table: String },
    /// A change logged as a statement (anything but DDL, transaction control and savepoints)
    /// naming a watched table.
    Statement { table: String },
    /// Passed: DDL (`ALTER TABLE` is followed by the table maps after it; `DROP`, `RENAME`,
    /// `CREATE` deliver nothing), savepoints, a statement that names no watched table.
    Other,
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// An unquoted word (a keyword, a name, a number).
    Word(String),
    /// A name in backticks or double quotes.
    Quoted(String),
    Dot,
    Other,
}

/// Statements that change no row of an existing table through the binary log's statement (DDL and
/// administration): passed, but for `CREATE … SELECT` (the rows of a table created from a
/// query), which is a change.
const DDL: &[&str] = &[
    "alter",
    "analyze",
    "create",
    "drop",
    "flush",
    "grant",
    "install",
    "optimize",
    "rename",
    "repair",
    "revoke",
    "set",
    "uninstall",
    "use",
];

/// What `statement` (its default schema `schema`) is to a poller watching `watched`
/// (`database.table` names).
pub fn classify(statement: &str, schema: &str, watched: &HashSet<String>) -> Query {
    let tokens = tokens(statement);
    let words: Vec<String> = tokens
        .iter()
        .take(3)
        .map(|token| match token {
            Token::Word(word) => word.to_ascii_lowercase(),
            _ => String::new(),
        })
        .collect();
    let word = |index: usize| words.get(index).map(String::as_str).unwrap_or("");
    match word(0) {
        "begin" => return Query::Begin,
        "start" if word(1) == "transaction" => return Query::Begin,
        "commit" => return Query::End,
        "rollback" if word(1) != "to" => return Query::End,
        "savepoint" | "release" => return Query::Other,
        "rollback" => return Query::Other,
        "xa" => {
            let verb = match word(1) {
                "start" | "begin" => XaVerb::Start,
                "end" => XaVerb::End,
                "prepare" => XaVerb::Prepare,
                "commit" => XaVerb::Commit,
                "rollback" => XaVerb::Rollback,
                _ => return Query::Other,
            };
            return Query::Xa { verb, xid: xid_of(statement) };
        }
        "truncate" => {
            return match named_watched(&tokens, schema, watched) {
                Some(table) => Query::Truncate { table },
                None => Query::Other,
            };
        }
        _ => {}
    }
    let ddl = DDL.contains(&word(0));
    let from_query = word(0) == "create"
        && tokens.iter().any(|token| matches!(token, Token::Word(word) if word.eq_ignore_ascii_case("select")));
    if ddl && !from_query {
        return Query::Other;
    }
    match named_watched(&tokens, schema, watched) {
        Some(table) => Query::Statement { table },
        None => Query::Other,
    }
}

/// The xid of an XA statement: its text after the verb (`XA PREPARE X'31',X'',1` → `X'31',X'',1`),
/// trailing words such as `ONE PHASE` left out.
fn xid_of(statement: &str) -> String {
    let rest = statement.trim();
    let mut parts = rest.splitn(3, char::is_whitespace);
    let _ = parts.next();
    let _ = parts.next();
    let xid = parts.next().unwrap_or("").trim();
    let upper = xid.to_ascii_uppercase();
    let cut = [" ONE PHASE", " JOIN", " RESUME", " SUSPEND", " FOR MIGRATE"]
        .iter()
        .filter_map(|suffix| upper.find(suffix))
        .min()
        .unwrap_or(xid.len());
    xid[..cut].trim().to_string()
}

/// The first watched table the tokens name (see the module's note), as `database.table`.
fn named_watched(tokens: &[Token], schema: &str, watched: &HashSet<String>) -> Option<String> {
    let lowered: HashSet<String> = watched.iter().map(|table| table.to_ascii_lowercase()).collect();
    let find = |database: &str, table: &str| {
        let name = format!("{database}.{table}").to_ascii_lowercase();
        lowered
            .contains(&name)
            .then(|| watched.iter().find(|watched| watched.to_ascii_lowercase() == name).cloned().unwrap_or(name))
    };
    let name = |token: &Token| match token {
        Token::Word(word) | Token::Quoted(word) => Some(word.clone()),
        _ => None,
    };
    for (index, token) in tokens.iter().enumerate() {
        let Some(first) = name(token) else { continue };
        if let Some(found) = find(schema, &first) {
            return Some(found);
        }
        if let (Some(Token::Dot), Some(second)) = (tokens.get(index + 1), tokens.get(index + 2).and_then(name))
            && let Some(found) = find(&first, &second)
        {
            return Some(found);
        }
    }
    None
}

/// A statement's tokens: words, quoted names, dots and the rest; single-quoted text and comments
/// left out (an executable comment's body kept).
fn tokens(statement: &str) -> Vec<Token> {
    let chars: Vec<char> = statement.chars().collect();
    let mut tokens = Vec::new();
    let mut index = 0;
    while index < chars.len() {
        let char = chars[index];
        let next = chars.get(index + 1).copied();
        if char.is_whitespace() {
            index += 1;
        } else if char == '/' && next == Some('*') {
            index += 2;
            let executable = chars.get(index) == Some(&'!')
                || (chars.get(index) == Some(&'M') && chars.get(index + 1) == Some(&'!'));
            if executable {
                // `/*!40101 SET … */`: read on; the version and the closing `*/` are not words.
                index += if chars[index] == 'M' { 2 } else { 1 };
                while chars.get(index).is_some_and(char::is_ascii_digit) {
                    index += 1;
                }
            } else {
                while index < chars.len() && !(chars[index] == '*' && chars.get(index + 1) == Some(&'/')) {
                    index += 1;
                }
                index += 2;
            }
        } else if char == '*' && next == Some('/') {
            index += 2;
        } else if char == '#'
            || (char == '-' && next == Some('-') && chars.get(index + 2).is_none_or(|c| c.is_whitespace()))
        {
            while index < chars.len() && chars[index] != '\n' {
                index += 1;
            }
        } else if char == '\'' {
            index += 1;
            while index < chars.len() {
                match chars[index] {
                    '\\' => index += 2,
                    '\'' if chars.get(index + 1) == Some(&'\'') => index += 2,
                    '\'' => break,
                    _ => index += 1,
                }
            }
            index += 1;
            tokens.push(Token::Other);
        } else if char == '`' || char == '"' {
            let mut name = String::new();
            index += 1;
            while index < chars.len() {
                if chars[index] == char {
                    if chars.get(index + 1) == Some(&char) {
                        name.push(char);
                        index += 2;
                        continue;
                    }
                    break;
                }
                name.push(chars[index]);
                index += 1;
            }
            index += 1;
            tokens.push(Token::Quoted(name));
        } else if char == '.' {
            index += 1;
            tokens.push(Token::Dot);
        } else if char.is_alphanumeric() || char == '_' || char == '$' {
            let mut word = String::new();
            while index < chars.len() && (chars[index].is_alphanumeric() || chars[index] == '_' || chars[index] == '$')
            {
                word.push(chars[index]);
                index += 1;
            }
            tokens.push(Token::Word(word));
        } else {
            index += 1;
            tokens.push(Token::Other);
        }
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watched() -> HashSet<String> {
        ["shop.items", "shop.Orders"].iter().map(|table| table.to_string()).collect()
    }

    fn of(statement: &str) -> Query {
        classify(statement, "shop", &watched())
    }

    fn stops(table: &str) -> Query {
        Query::Statement { table: table.to_string() }
    }

    #[test]
    fn transaction_bounds_and_savepoints() {
        assert_eq!(of("BEGIN"), Query::Begin);
        assert_eq!(of("  begin work"), Query::Begin);
        assert_eq!(of("START TRANSACTION"), Query::Begin);
        assert_eq!(of("COMMIT"), Query::End);
        assert_eq!(of("ROLLBACK"), Query::End);
        assert_eq!(of("ROLLBACK TO SAVEPOINT items"), Query::Other);
        assert_eq!(of("SAVEPOINT items"), Query::Other);
        assert_eq!(of("RELEASE SAVEPOINT a"), Query::Other);
    }

    #[test]
    fn a_statement_naming_a_watched_table_stops_however_it_names_it() {
        assert_eq!(of("UPDATE items SET n = n + 1 WHERE id < 3"), stops("shop.items"));
        assert_eq!(of("update `ITEMS` set n = 1"), stops("shop.items"), "case aside");
        assert_eq!(of("INSERT INTO shop.orders VALUES (1)"), stops("shop.Orders"));
        assert_eq!(of("DELETE FROM `shop`.`items`"), stops("shop.items"));
        assert_eq!(of("REPLACE INTO \"items\" VALUES (1)"), stops("shop.items"));
        assert_eq!(of("INSERT INTO other SELECT * FROM items"), stops("shop.items"), "read from: over-approximated");
        assert_eq!(of("/*!40000 DELETE FROM items */"), stops("shop.items"), "an executable comment is read");
        assert_eq!(of("LOAD DATA INFILE 'x' INTO TABLE items"), stops("shop.items"));
        assert_eq!(of("CREATE TABLE copy SELECT * FROM items"), stops("shop.items"), "CREATE … SELECT is a change");
        // Another schema's table of the same name, or the name in text or a comment: not watched.
        assert_eq!(classify("UPDATE items SET n = 1", "other", &watched()), Query::Other);
        assert_eq!(
            classify("UPDATE other.items SET n = 1", "shop", &watched()),
            stops("shop.items"),
            "over-approximated: `items` alone is the default schema's"
        );
        assert_eq!(classify("UPDATE elsewhere.t SET n = 1", "other", &watched()), Query::Other);
        assert_eq!(of("INSERT INTO other VALUES ('items', 'it''s items')"), Query::Other);
        assert_eq!(of("UPDATE other SET n = 1 /* items */ -- items"), Query::Other);
        assert_eq!(of("UPDATE other SET n = 1 # items"), Query::Other);
    }

    #[test]
    fn ddl_passes_and_a_truncate_of_a_watched_table_is_a_change() {
        assert_eq!(of("ALTER TABLE items ADD COLUMN x INT"), Query::Other);
        assert_eq!(of("DROP TABLE items"), Query::Other);
        assert_eq!(of("CREATE TABLE items2 (id INT)"), Query::Other);
        assert_eq!(of("RENAME TABLE items TO old_items"), Query::Other);
        assert_eq!(of("TRUNCATE TABLE items"), Query::Truncate { table: "shop.items".into() });
        assert_eq!(of("truncate `shop`.`Orders`"), Query::Truncate { table: "shop.Orders".into() });
        assert_eq!(of("TRUNCATE TABLE other"), Query::Other);
    }

    #[test]
    fn xa_statements_carry_their_xid() {
        let xa = |verb, xid: &str| Query::Xa { verb, xid: xid.to_string() };
        assert_eq!(of("XA START X'7831',X'',1"), xa(XaVerb::Start, "X'7831',X'',1"));
        assert_eq!(of("XA END X'7831',X'',1"), xa(XaVerb::End, "X'7831',X'',1"));
        assert_eq!(of("XA PREPARE X'7831',X'',1"), xa(XaVerb::Prepare, "X'7831',X'',1"));
        assert_eq!(of("XA COMMIT X'7831',X'',1"), xa(XaVerb::Commit, "X'7831',X'',1"));
        assert_eq!(of("XA COMMIT X'7831',X'',1 ONE PHASE"), xa(XaVerb::Commit, "X'7831',X'',1"));
        assert_eq!(of("xa rollback X'7831',X'',1"), xa(XaVerb::Rollback, "X'7831',X'',1"));
    }
}
