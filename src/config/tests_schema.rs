//! The field table (src/config/fields.rs), the JSON Schema and docs/configuration.md held to the
//! loader, so that none of them drifts: the same fields as the raw types at every level, with the
//! same types, nullability, ranges, defaults and setting-name fields; the committed schema file and
//! docs regenerated and compared; and the schema checked by a real validator (boon, draft 2020-12)
//! against the templates, against every document the config tests load, and against mistakes it
//! must refuse. Other branches add fields: these failures say what to add, and where.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{Value, json};

use super::fields::{self, BINLOG_ONLY, Field, Kind, QUEUE_ONLY};
use super::function_json::{POLLER_SETTING_NAME_FIELDS, RawPoller, WATCHDOG_SETTING_NAME_FIELDS};
use super::schema::{SCHEMA_FILE_NAME, SCHEMA_REFERENCE, function_json_schema};
use super::status::RawStatus;
use super::watchdog::{RawWatchdog, WatchdogConfig, build_watchdog};
use super::*;

const REGENERATE: &str = "and regenerate the committed copies afterwards: `cargo run -- schema > function_templates/function.schema.json` \
     and `cargo run -- schema --markdown > docs/configuration.md`";

/// The schema, compiled once (boon checks it against the draft 2020-12 meta-schema as it compiles).
fn compiled() -> &'static (boon::Schemas, boon::SchemaIndex) {
    static COMPILED: OnceLock<(boon::Schemas, boon::SchemaIndex)> = OnceLock::new();
    COMPILED.get_or_init(|| {
        let mut schemas = boon::Schemas::new();
        let mut compiler = boon::Compiler::new();
        compiler.add_resource("/function.schema.json", function_json_schema()).expect("a schema location");
        let index = compiler
            .compile("/function.schema.json", &mut schemas)
            .unwrap_or_else(|error| panic!("the schema is not a valid draft 2020-12 schema: {error:#}"));
        (schemas, index)
    })
}

/// Why the schema refuses `document`, or `None` when it validates.
pub(super) fn schema_refusal(document: &Value) -> Option<String> {
    let (schemas, index) = compiled();
    schemas.validate(document, *index).err().map(|error| format!("{error}"))
}

/// Panics unless the schema takes `document` (which the loader accepted).
pub(super) fn assert_schema_takes(document: &Value) {
    if let Some(refusal) = schema_refusal(document) {
        panic!(
            "the loader accepts this function.json and the schema refuses it: loosen src/config/fields.rs or schema.rs \
             ({REGENERATE})\n{refusal}\n{document:#}"
        );
    }
}

fn settings() -> Settings {
    Settings::from_pairs([
        ("ORDERS_DB", "sqlite://orders.db"),
        ("BINLOG_DB", "mysql://reader@127.0.0.1:3306/shop"),
        ("ORDERS_URL", "http://127.0.0.1:9/hook"),
        ("ORDERS_SECRET", "whsec_c2NoZW1hLXRlc3Qtc2lnbmluZy1rZXktMzItYnl0ZXM="),
        ("STATE", "file:state"),
        ("AzureWebJobsStorage", "UseDevelopmentStorage=true"),
    ])
}

const APP_ROOT: &str = "/nonexistent-app-root";

fn timer() -> Value {
    json!([{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}])
}

/// What the loader makes of `body` as section `section`, as text to compare (or its error).
fn load(section: &str, body: &Value) -> Result<String, ConfigError> {
    let root = Path::new(APP_ROOT);
    let file = root.join("f/function.json");
    let at = Located { file: &file };
    let document = json!({"bindings": timer(), section: body});
    match section {
        "poller" => PollerConfig::from_document(&document, root, "f", &settings(), None, &at)
            // Whether settleSeconds was written only changes a log line (an integer cursor ignores it).
            .map(|config| format!("{config:?}").replace("settle_configured: true", "settle_configured: false")),
        "watchdog" => {
            build_watchdog(&document, "f", &settings(), root, &at).map(|config: WatchdogConfig| format!("{config:?}"))
        }
        other => panic!("no loader for section {other}"),
    }
}

/// A section with every optional object present, the sink a webhook or (for a queue field) a queue.
fn base(section: &str, path: &str) -> Value {
    match section {
        "poller" => {
            let sink = match path.strip_prefix("sink.") {
                Some(name) if QUEUE_ONLY.contains(&name) => json!({"type": "queue", "queueName": "orders-changes"}),
                _ => json!({"type": "webhook", "url": "%ORDERS_URL%"}),
            };
            let source = match path.strip_prefix("source.") {
                Some(name) if BINLOG_ONLY.contains(&name) => {
                    json!({"kind": "binlog", "connection": "BINLOG_DB", "tables": ["shop.orders"]})
                }
                _ => json!({"connection": "ORDERS_DB", "table": "orders", "cursor": "updated_at", "pk": ["id"],
                            "generation": {"query": "SELECT max(load_id) FROM load_log"}, "lateArrivals": {}}),
            };
            json!({
                "source": source,
                "batch": {},
                "sink": sink,
                "lease": {},
                "poison": {},
                "state": {"connection": "STATE"}
            })
        }
        "watchdog" => json!({"alert": {"url": "%ORDERS_URL%"}, "state": {"connection": "STATE"}}),
        other => panic!("no base for section {other}"),
    }
}

fn set(document: &mut Value, path: &str, value: Value) {
    let pointer = format!("/{}", path.replace('.', "/"));
    let (parent, name) = pointer.rsplit_once('/').expect("a path");
    let parent = document.pointer_mut(parent).unwrap_or_else(|| panic!("the base document lacks the parent of {path}"));
    parent.as_object_mut().expect("an object").insert(name.to_string(), value);
}

fn remove(document: &mut Value, path: &str) {
    let pointer = format!("/{}", path.replace('.', "/"));
    let (parent, name) = pointer.rsplit_once('/').expect("a path");
    if let Some(parent) = document.pointer_mut(parent).and_then(Value::as_object_mut) {
        parent.remove(name);
    }
}

/// Every field of `fields`, nested ones included, with its dotted path.
fn flatten<'a>(prefix: &str, fields: &'a [Field], into: &mut Vec<(String, &'a Field)>) {
    for field in fields {
        let path = format!("{prefix}{}", field.name);
        if let Kind::Object { fields: inner, .. } = &field.kind {
            flatten(&format!("{path}."), inner, into);
        }
        into.push((path, field));
    }
}

/// Deserializes `value` placed at `path` of a raw `section`: the path serde reports and its message.
fn probe(section: &str, path: &[&str], value: Value) -> Option<(String, String)> {
    let mut document = value;
    for part in path.iter().rev() {
        document = json!({ *part: document });
    }
    fn error_of<T: serde::de::DeserializeOwned>(document: &Value) -> Option<(String, String)> {
        serde_path_to_error::deserialize::<_, T>(document)
            .err()
            .map(|error| (error.path().to_string(), error.into_inner().to_string()))
    }
    match section {
        "poller" => error_of::<RawPoller>(&document),
        "watchdog" => error_of::<RawWatchdog>(&document),
        "status" => error_of::<RawStatus>(&document),
        other => panic!("no raw type for section {other}"),
    }
}

const UNKNOWN: &str = "zz_not_a_field";

/// The fields the raw type at `path` accepts (serde's deny_unknown_fields lists them), or `None`
/// when it is not an object.
fn accepted_fields(section: &str, path: &[&str]) -> Option<BTreeSet<String>> {
    let (_, message) = probe(section, path, json!({UNKNOWN: 0}))?;
    let listed = message.strip_prefix(&format!("unknown field `{UNKNOWN}`, "))?;
    Some(listed.split('`').skip(1).step_by(2).map(str::to_string).collect())
}

/// The function of src/config/fields.rs that lists the fields of the object at `path`: named after
/// the object (`source()` for `poller.source`, `state()` for either section's `state`), or after the
/// section at the top level.
fn table_function(section: &str, path: &[&str]) -> String {
    format!("fn {}()", path.last().copied().unwrap_or(section))
}

/// Walks the table and the raw types together, noting every difference.
fn compare(section: &str, path: &[&str], fields: &[Field], problems: &mut Vec<String>) {
    let shown = |name: &str| [&[section], path, &[name]].concat().join(".");
    let Some(accepted) = accepted_fields(section, path) else {
        problems.push(format!("{}: the schema says an object, the loader does not take one here", shown("")));
        return;
    };
    let described: BTreeSet<String> = fields.iter().map(|field| field.name.to_string()).collect();
    let table = table_function(section, path);
    for name in accepted.difference(&described) {
        let here = [path, &[name.as_str()]].concat();
        let what = match accepted_fields(section, &here) {
            Some(inner) => format!(
                "a `Kind::Object` whose fields are {}",
                inner.iter().map(|inner| format!("`{inner}`")).collect::<Vec<_>>().join(", ")
            ),
            None => "its `Kind`, default and range from the loader's `defaults` and `ranges`".to_string(),
        };
        problems.push(format!(
            "{}: the loader accepts it and the schema does not describe it: add `field(\"{name}\", …)` to `{table}` \
             in src/config/fields.rs ({what}, a description and an example)",
            shown(name)
        ));
    }
    for name in described.difference(&accepted) {
        problems.push(format!(
            "{}: src/config/fields.rs describes it and the loader refuses it: remove it from `{table}` in fields.rs",
            shown(name)
        ));
    }
    for field in fields.iter().filter(|field| accepted.contains(field.name)) {
        let here = [path, &[field.name]].concat();
        let null_taken = probe(section, &here, Value::Null).is_none_or(|(at, _)| at != here.join("."));
        if null_taken != field.nullable {
            problems.push(format!(
                "{}: the loader {} null and `{table}` in src/config/fields.rs says nullable: {}",
                shown(field.name),
                if null_taken { "takes" } else { "refuses" },
                field.nullable
            ));
        }
        if let Kind::Object { fields: inner, .. } = &field.kind {
            compare(section, &here, inner, problems);
            continue;
        }
        let Some((_, message)) = probe(section, &here, json!({UNKNOWN: 0})) else {
            problems.push(format!("{}: the loader takes an object here", shown(field.name)));
            continue;
        };
        let expected = match field.kind {
            Kind::Integer { .. } => {
                ["expected u8", "expected u16", "expected u32", "expected u64", "expected usize"].as_slice()
            }
            Kind::Boolean { .. } => &["expected a boolean"],
            Kind::Text { .. } | Kind::Choice { .. } | Kind::SettingName { .. } => &["expected a string"],
            Kind::List { .. } => &["expected a sequence"],
            Kind::Object { .. } => unreachable!("handled above"),
        };
        if message.starts_with("unknown field") {
            problems.push(format!(
                "{}: the loader takes an object here: make it a `Kind::Object` in `{table}` of src/config/fields.rs",
                shown(field.name)
            ));
        } else if !expected.iter().any(|text| message.contains(text)) {
            problems.push(format!(
                "{}: `{table}` in src/config/fields.rs and the loader disagree on its type: the loader says {message:?}",
                shown(field.name)
            ));
        }
    }
}

/// Every field the loader accepts is in the schema, with its type, and nothing else, at every level.
#[test]
fn the_schema_has_exactly_the_fields_the_loader_accepts() {
    let mut problems = Vec::new();
    for section in fields::sections() {
        compare(section.name, &[], &section.fields, &mut problems);
    }
    assert!(problems.is_empty(), "the schema and the loader differ ({REGENERATE}):\n{}", problems.join("\n"));
}

/// Other branches add keys to the loader (issue 28 asks that the table cannot fall behind): a key
/// missing from the table fails the test above with its dotted path and the function of fields.rs
/// to add it to, and a missing object with the fields it needs.
#[test]
fn a_key_missing_from_the_table_is_named_with_where_to_add_it() {
    let cases: [(&str, &[&str], &str, &str); 3] = [
        (
            "poller",
            &["source"],
            "settleSeconds",
            "poller.source.settleSeconds: the loader accepts it and the schema does not describe it: \
             add `field(\"settleSeconds\", …)` to `fn source()` in src/config/fields.rs (its `Kind`",
        ),
        (
            "poller",
            &["source"],
            "generation",
            "poller.source.generation: the loader accepts it and the schema does not describe it: \
             add `field(\"generation\", …)` to `fn source()` in src/config/fields.rs \
             (a `Kind::Object` whose fields are `onChange`, `query`,",
        ),
        (
            "watchdog",
            &[],
            "kick",
            "watchdog.kick: the loader accepts it and the schema does not describe it: \
             add `field(\"kick\", …)` to `fn watchdog()` in src/config/fields.rs (its `Kind`",
        ),
    ];
    for (section_name, path, left_out, expected) in cases {
        let mut section = fields::sections().into_iter().find(|section| section.name == section_name).unwrap();
        let mut fields = &mut section.fields;
        for part in path {
            let holder = fields.iter_mut().find(|field| field.name == *part).unwrap();
            let Kind::Object { fields: inner, .. } = &mut holder.kind else { panic!("{part} is an object") };
            fields = inner;
        }
        fields.retain(|field| field.name != left_out);
        let mut problems = Vec::new();
        compare(section_name, &[], &section.fields, &mut problems);
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(problems[0].starts_with(expected), "{}\ndoes not start with\n{expected}", problems[0]);
    }
}

/// Every range the schema states is the loader's: its ends taken, one past them refused there.
#[test]
fn the_schema_ranges_are_the_loaders() {
    let mut problems = Vec::new();
    for section in fields::sections().iter().filter(|section| section.name != "status") {
        let mut leaves = Vec::new();
        flatten("", &section.fields, &mut leaves);
        for (path, field) in leaves {
            let Kind::Integer { range, .. } = &field.kind else { continue };
            let mut tries = vec![(*range.start(), true), (*range.end(), true), (*range.end() + 1, false)];
            if *range.start() > 0 {
                tries.push((*range.start() - 1, false));
            }
            for (value, inside) in tries {
                let mut body = base(section.name, &path);
                set(&mut body, &path, json!(value));
                let result = load(section.name, &body);
                let field_path = format!("{}.{path}", section.name);
                let refused_here =
                    matches!(&result, Err(error) if error.field == field_path && error.reason.contains("out of range"));
                if inside == refused_here {
                    problems.push(format!(
                        "{field_path} = {value}: the schema says {}..={} and the loader {}",
                        range.start(),
                        range.end(),
                        match &result {
                            Ok(_) => "takes it".to_string(),
                            Err(error) => format!("says {error}"),
                        }
                    ));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "use the loader's `ranges` constant in fields.rs ({REGENERATE}):\n{}",
        problems.join("\n")
    );
}

/// Writing a default the schema states is the same, to the loader, as leaving the field out.
#[test]
fn writing_the_schema_default_is_leaving_the_field_out() {
    let mut problems = Vec::new();
    let mut tried = 0;
    for section in fields::sections().iter().filter(|section| section.name != "status") {
        let mut leaves = Vec::new();
        flatten("", &section.fields, &mut leaves);
        for (path, field) in leaves {
            let default = match &field.kind {
                Kind::Integer { default: Some(default), .. } => json!(default),
                Kind::Boolean { default } => json!(default),
                Kind::Text { default: Some(text), .. }
                | Kind::Choice { default: Some(text), .. }
                | Kind::SettingName { default: Some(text) } => json!(text),
                _ => continue,
            };
            tried += 1;
            let mut left_out = base(section.name, &path);
            remove(&mut left_out, &path);
            let mut written = left_out.clone();
            set(&mut written, &path, default.clone());
            match (load(section.name, &left_out), load(section.name, &written)) {
                (Ok(without), Ok(with)) if without == with => {}
                (without, with) => problems.push(format!(
                    "{}.{path}: writing the schema's default {default} differs from leaving it out: {}",
                    section.name,
                    difference(&without, &with)
                )),
            }
        }
    }
    assert!(tried > 20, "only {tried} defaults tried");
    assert!(
        problems.is_empty(),
        "use the loader's `defaults` constant in fields.rs ({REGENERATE}):\n{}",
        problems.join("\n\n")
    );
}

/// What differs between two loads, briefly: the parts of one configuration the other lacks.
fn difference(without: &Result<String, ConfigError>, with: &Result<String, ConfigError>) -> String {
    match (without, with) {
        (Ok(without), Ok(with)) => {
            let parts = |text: &str| text.split(", ").map(str::to_string).collect::<BTreeSet<String>>();
            let (without, with) = (parts(without), parts(with));
            let left_out: Vec<&String> = without.difference(&with).collect();
            let written: Vec<&String> = with.difference(&without).collect();
            format!("left out gives {left_out:?}, written gives {written:?}")
        }
        (without, with) => format!("left out: {without:?}; written: {with:?}"),
    }
}

/// The fields the schema calls setting names are the ones the loader refuses as `%NAME%`.
#[test]
fn the_setting_name_fields_are_the_loaders() {
    for section in fields::sections() {
        let mut leaves = Vec::new();
        flatten("", &section.fields, &mut leaves);
        let described: BTreeSet<String> = leaves
            .iter()
            .filter(|(_, field)| matches!(field.kind, Kind::SettingName { .. }))
            .map(|(path, _)| path.clone())
            .collect();
        let loader: BTreeSet<String> = match section.name {
            "poller" => POLLER_SETTING_NAME_FIELDS.iter().map(|field| field.to_string()).collect(),
            "watchdog" => WATCHDOG_SETTING_NAME_FIELDS.iter().map(|field| field.to_string()).collect(),
            _ => BTreeSet::new(),
        };
        assert_eq!(
            described, loader,
            "{}: fields.rs's SettingName fields and function_json.rs's *_SETTING_NAME_FIELDS differ ({REGENERATE})",
            section.name
        );
    }
}

fn repository() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The committed copies are what the table writes today.
#[test]
fn the_committed_schema_and_docs_are_regenerated() {
    let schema_file = repository().join("function_templates").join(SCHEMA_FILE_NAME);
    let committed: Value = serde_json::from_str(&std::fs::read_to_string(&schema_file).unwrap()).unwrap();
    assert!(committed == function_json_schema(), "{} is out of date: {REGENERATE}", schema_file.display());
    let docs = repository().join("docs/configuration.md");
    let committed = std::fs::read_to_string(&docs).unwrap_or_default();
    assert!(committed == reference::configuration_markdown(), "{} is out of date: {REGENERATE}", docs.display());
}

/// Every template validates, refers to the schema file next to it, and loads.
#[test]
fn every_template_validates_against_the_schema() {
    let templates = repository().join("function_templates");
    let mut seen = 0;
    for entry in std::fs::read_dir(&templates).unwrap() {
        let file = entry.unwrap().path().join("function.json");
        if !file.is_file() {
            continue;
        }
        seen += 1;
        let document: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(document["$schema"], SCHEMA_REFERENCE, "{}", file.display());
        if let Some(refusal) = schema_refusal(&document) {
            panic!("{} does not validate: {refusal}", file.display());
        }
    }
    assert_eq!(seen, 4, "the four templates");
}

/// Regression (found by the harness's check of its fixtures): the loader takes `null` as a field
/// left out, and the schema's rules between fields counted `"table": null` as a table given.
#[test]
fn the_schema_takes_null_as_left_out_as_the_loader_does() {
    let mut queue = base("poller", "sink.queueName");
    queue["sink"]["url"] = Value::Null;
    queue["sink"]["secret"] = Value::Null;
    let mut query = base("poller", "source.query");
    query["source"]["table"] = Value::Null;
    query["source"]["query"] = json!("SELECT id, updated_at FROM orders");
    query["source"]["softDelete"] = Value::Null;
    query["source"]["opColumn"] = json!("op");
    query["source"]["generation"] = Value::Null;
    for poller in [queue, query] {
        assert!(load("poller", &poller).is_ok(), "the loader takes it: {:?}", load("poller", &poller));
        assert_schema_takes(&json!({"bindings": timer(), "poller": poller}));
    }
}

/// A mistake, and how to make it in a good document.
type Mutation = (&'static str, fn(&mut Value));

/// The schema refuses the mistakes it can see: without this, a schema that takes anything passes.
#[test]
fn the_schema_refuses_what_a_single_file_shows_is_wrong() {
    let poller = json!({
        "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "updated_at", "pk": ["id"]},
        "sink": {"type": "webhook", "url": "%ORDERS_URL%"}
    });
    let good = json!({"$schema": SCHEMA_REFERENCE, "bindings": timer(), "poller": poller});
    assert_eq!(schema_refusal(&good), None);
    let mutations: [Mutation; 14] = [
        ("an unknown field", |document| document["poller"]["source"]["cursr"] = json!("x")),
        ("%NAME% in a field that names a setting", |document| {
            document["poller"]["source"]["connection"] = json!("%ORDERS_DB%")
        }),
        ("a number out of range", |document| document["poller"]["batch"] = json!({"size": 0})),
        ("a number as a setting", |document| document["poller"]["batch"] = json!({"size": "%SIZE%"})),
        ("an unknown choice", |document| document["poller"]["poison"] = json!({"mode": "skip"})),
        ("a quoted identifier", |document| document["poller"]["source"]["cursor"] = json!("updated_at\"; --")),
        ("an unmatched %", |document| document["poller"]["source"]["where"] = json!("name LIKE 'a%'")),
        ("both table and query", |document| document["poller"]["source"]["query"] = json!("SELECT 1")),
        ("a queue field on a webhook", |document| document["poller"]["sink"]["queueName"] = json!("orders")),
        ("no timer", |document| document["bindings"] = json!([])),
        ("functionName in the timer", |document| document["bindings"][0]["functionName"] = json!("x")),
        ("two sections", |document| document["status"] = json!({})),
        ("an unknown top-level key", |document| document["poler"] = json!({})),
        ("a duplicate key column", |document| document["poller"]["source"]["pk"] = json!(["id", "id"])),
    ];
    for (mistake, mutate) in mutations {
        let mut document = good.clone();
        mutate(&mut document);
        assert!(schema_refusal(&document).is_some(), "the schema takes {mistake}: {document:#}");
    }
    let status = json!({"bindings": [
        {"type": "HttpTrigger", "direction": "IN", "name": "req", "authLevel": "anonymous"},
        {"type": "http", "direction": "out", "name": "res"}
    ], "status": {}});
    assert!(schema_refusal(&status).is_some(), "an anonymous status function");
    let mut status = status;
    status["bindings"][0]["authLevel"] = json!("Function");
    assert_eq!(schema_refusal(&status), None, "types, directions and levels in any case");
}

/// Every app setting dbtrigger reads by a fixed name is in docs/configuration.md's list, and every
/// fixed name there is still read.
#[test]
fn every_app_setting_read_is_documented() {
    let documented: BTreeSet<&str> =
        reference::APP_SETTINGS.iter().flat_map(|setting| setting.name.split(", ")).collect();
    let mut read = BTreeSet::new();
    let mut sources = vec![repository().join("src")];
    while let Some(path) = sources.pop() {
        if path.is_dir() {
            sources.extend(std::fs::read_dir(&path).unwrap().map(|entry| entry.unwrap().path()));
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with(".rs") || name.starts_with("tests") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // Unit tests sit at the end of a file, after `#[cfg(test)]`: their settings are made up.
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        // Every text between two quotes: a literal, or code between two (which never looks like a name).
        for literal in code.split('"') {
            let fixed_name = ["WEBSITE_", "FUNCTIONS_", "DBTRIGGER_"].iter().any(|prefix| literal.starts_with(prefix))
                && literal.chars().all(|character| character.is_ascii_uppercase() || character == '_');
            if fixed_name
                || ["TZ", "AzureWebJobsStorage", "CONTAINER_NAME", "LEGION_SERVICE_HOST", "MANAGED_ENVIRONMENT"]
                    .contains(&literal)
            {
                read.insert(literal.to_string());
            }
        }
    }
    let missing: Vec<&String> = read.iter().filter(|name| !documented.contains(name.as_str())).collect();
    assert!(
        missing.is_empty(),
        "read but not in reference::APP_SETTINGS (src/config/reference.rs): {missing:?}; {REGENERATE}"
    );
    let fixed: Vec<&&str> =
        documented.iter().filter(|name| !name.contains(['<', '%', ' ']) && *name != &"RUST_LOG").collect();
    let stale: Vec<&&str> = fixed.iter().copied().filter(|name| !read.contains(**name)).collect();
    assert!(stale.is_empty(), "documented in reference::APP_SETTINGS but no longer read: {stale:?}");
}

/// A field's meaning says what leaving it out means once (its `when_absent`), and a default
/// the docs state is one the field takes (`source.serverId` said "derived" twice and `0`, out of
/// its range: issue 45 #10).
#[test]
fn each_default_is_stated_once_and_within_its_range() {
    let mut problems = Vec::new();
    for section in fields::sections() {
        let mut leaves = Vec::new();
        flatten("", &section.fields, &mut leaves);
        for (path, field) in leaves {
            if field.when_absent.is_some() && field.description.contains("Left out:") {
                problems.push(format!("{}.{path}: says `Left out:` beside its when_absent", section.name));
            }
            if let Kind::Integer { range, default: Some(default) } = &field.kind
                && !range.contains(default)
            {
                problems.push(format!("{}.{path}: default {default} is outside {range:?}", section.name));
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}
