//! The JSON Schema (draft 2020-12) of a dbtrigger function.json, written from the field table
//! ([`super::fields`]) and the host's bindings, for editors to validate and complete with. The
//! loader stays the judge: the schema says what a single file can say (types, ranges, choices,
//! which fields take `%NAME%`), not what needs the app settings or the database.
//!
//! Where the two differ, the schema is the stricter: it refuses keys the loader ignores (an
//! unknown top-level key, two sections in one file) since they are mistakes. It never refuses a
//! file the loader accepts: the config tests check every accepted document against it.

use serde_json::{Map, Value, json};

use super::fields::{self, Field, Kind, Rule, Section, TextRule};

/// The file `dbtrigger new` writes at the app root, which every function.json refers to.
pub const SCHEMA_FILE_NAME: &str = "function.schema.json";

/// What a function.json's `$schema` says: the schema file, one folder up (the app root).
pub const SCHEMA_REFERENCE: &str = "../function.schema.json";

/// Text whose `%` come in pairs: what the loader's substitution accepts (`%%` is a literal `%`).
pub const PAIRED_PERCENT: &str = "^(?:[^%]|%[^%]*%)*$";

/// Text with at least one `%NAME%` reference (and its `%` in pairs): its value is known only once
/// the setting is read, so no other rule applies.
pub const SETTING_REFERENCE: &str = "^(?:[^%]|%[^%]*%)*%[^%]+%(?:[^%]|%[^%]*%)*$";

/// An app setting's name, as the loader takes it (`looks_like_a_setting_name`).
pub const SETTING_NAME: &str = "^[A-Za-z0-9_.:-]{1,256}$";

const IDENTIFIER: &str = "[A-Za-z_][A-Za-z0-9_$]{0,62}";

/// The JSON Schema of a function.json.
pub fn function_json_schema() -> Value {
    let mut properties = Map::new();
    properties.insert(
        "$schema".into(),
        json!({"type": "string", "description": "The schema editors validate this file against (the host and dbtrigger ignore it).", "examples": [SCHEMA_REFERENCE]}),
    );
    properties.insert(
        "bindings".into(),
        json!({
            "type": "array",
            "description": "The host's bindings: a timerTrigger for a poller or a watchdog; an httpTrigger and an http output for a status function.",
            "items": {"$ref": "#/$defs/binding"}
        }),
    );
    let mut sections_required = Vec::new();
    for section in fields::sections() {
        sections_required.push(json!({"required": [section.name]}));
        properties.insert(section.name.into(), section_schema(&section));
    }
    properties.insert(
        "retry".into(),
        json!({
            "type": "object",
            "description": "The host's retry policy for a failed invocation (strategy fixedDelay or exponentialBackoff, maxRetryCount, delayInterval, minimumInterval, maximumInterval): dbtrigger logs the retry it is.",
            "properties": {
                "strategy": {"type": "string", "examples": ["fixedDelay", "exponentialBackoff"]},
                "maxRetryCount": {"type": "integer", "minimum": -1}
            }
        }),
    );
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "dbtrigger function.json",
        "description": "A function of a dbtrigger app: its bindings and one of the sections `poller`, `watchdog` or `status`. Text fields take %NAME% (replaced by app setting NAME), except the fields that name a setting (connection, secret), which take the name itself.",
        "type": "object",
        "required": ["bindings"],
        "additionalProperties": false,
        "properties": properties,
        "oneOf": sections_required,
        "allOf": [
            {
                "if": {"anyOf": [{"required": ["poller"]}, {"required": ["watchdog"]}]},
                "then": {"properties": {"bindings": {"contains": {"$ref": "#/$defs/isTimerTrigger"}}}}
            },
            {
                "if": {"required": ["status"]},
                "then": {"properties": {"bindings": {"allOf": [
                    {"contains": {"$ref": "#/$defs/isHttpTrigger"}},
                    {"contains": {"$ref": "#/$defs/isHttpOutput"}}
                ]}}}
            }
        ],
        "$defs": bindings_definitions()
    })
}

/// A pattern matching any of `words` without regard to case, as the host matches binding types
/// and directions (JSON Schema's patterns have no flag for it).
fn any_case(words: &[&str]) -> String {
    let alternatives: Vec<String> = words
        .iter()
        .map(|word| {
            word.chars()
                .map(|character| {
                    if character.is_ascii_alphabetic() {
                        format!("[{}{}]", character.to_ascii_uppercase(), character.to_ascii_lowercase())
                    } else {
                        character.to_string()
                    }
                })
                .collect()
        })
        .collect();
    format!("^(?:{})$", alternatives.join("|"))
}

/// A binding of type `kind` (and direction `direction`, when it has one), as `binding_is` tells.
fn binding_of(kind: &str, direction: &str) -> Value {
    json!({
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"pattern": any_case(&[kind])}, "direction": {"pattern": any_case(&[direction])}}
    })
}

fn bindings_definitions() -> Value {
    json!({
        "binding": {
            "type": "object",
            "required": ["type", "name"],
            "properties": {
                "type": {
                    "type": "string",
                    "description": "The binding's type, matched without regard to case as the host does.",
                    "examples": ["timerTrigger", "httpTrigger", "http"]
                },
                "direction": {"type": "string", "pattern": any_case(&["in", "out", "inout"]), "examples": ["in", "out"]},
                "name": {
                    "type": "string",
                    "description": "The binding's name: a letter, then letters and digits.",
                    "pattern": "^(?:[A-Za-z][A-Za-z0-9]*|\\$return)$"
                }
            },
            "allOf": [
                {"if": {"$ref": "#/$defs/isTimerTrigger"}, "then": {"$ref": "#/$defs/timerTrigger"}},
                {"if": {"$ref": "#/$defs/isHttpTrigger"}, "then": {"$ref": "#/$defs/httpTrigger"}},
                {"if": {"$ref": "#/$defs/isHttpOutput"}, "then": {"$ref": "#/$defs/httpOutput"}}
            ]
        },
        "isTimerTrigger": binding_of("timerTrigger", "in"),
        "isHttpTrigger": binding_of("httpTrigger", "in"),
        "isHttpOutput": binding_of("http", "out"),
        "timerTrigger": {
            "required": ["schedule"],
            "properties": {
                "schedule": {
                    "type": "string",
                    "description": "NCRONTAB with six fields (0 */1 * * * * is every minute) or five, or a hh:mm:ss time span; %NAME% is read from app settings. Evaluated in WEBSITE_TIME_ZONE when set, else UTC.",
                    "examples": ["0 */1 * * * *", "%ORDERS_SCHEDULE%"]
                },
                "runOnStartup": {"type": "boolean", "default": false, "description": "Also run when the host starts."},
                "useMonitor": {"type": "boolean", "description": "Whether the host keeps the schedule's status in storage, so that a missed occurrence runs late (default true for schedules of more than a minute)."},
                "functionName": {"not": {}, "description": "Must not be set: the host adds its own and fails on a duplicate."}
            }
        },
        "httpTrigger": {
            "properties": {
                "authLevel": {
                    "type": "string",
                    "description": "function (a function key) or admin; never anonymous: status shows checkpoints, lease owners and errors.",
                    "pattern": any_case(&["function", "admin"]),
                    "default": "function",
                    "examples": ["function", "admin"]
                },
                "methods": {"type": "array", "items": {"type": "string", "pattern": any_case(&["get", "post", "head"])}, "examples": [["get"]]},
                "route": {"type": "string"}
            }
        },
        "httpOutput": {
            "properties": {"name": {"description": "Name it (e.g. res): the answer goes in Outputs.<name>.", "not": {"const": "$return"}}}
        }
    })
}

fn section_schema(section: &Section) -> Value {
    let mut schema = object_schema(&section.fields, &section.rules);
    schema["description"] = Value::from(section.description);
    schema
}

fn object_schema(fields: &[Field], rules: &[Rule]) -> Value {
    let mut properties = Map::new();
    let mut required = Vec::new();
    for field in fields {
        properties.insert(field.name.to_string(), field_schema(field));
        if field.required {
            required.push(Value::from(field.name));
        }
    }
    let mut schema = json!({"type": "object", "additionalProperties": false, "properties": properties});
    if !required.is_empty() {
        schema["required"] = Value::Array(required);
    }
    if !rules.is_empty() {
        schema["allOf"] = rules.iter().map(|rule| rule.schema.clone()).collect();
    }
    schema
}

fn field_schema(field: &Field) -> Value {
    let mut schema = kind_schema(&field.kind);
    let mut description = field.description.to_string();
    if let Some(meaning) = field.when_absent {
        description.push_str(&format!(" Left out: {meaning}."));
    }
    schema["description"] = Value::from(description);
    schema["examples"] = json!([field.example]);
    if field.nullable {
        // `null` means "left out" to the loader: every other keyword constrains its own type only.
        let own_type = schema["type"].clone();
        schema["type"] = json!([own_type, "null"]);
    }
    schema
}

fn kind_schema(kind: &Kind) -> Value {
    match kind {
        Kind::Integer { range, default } => {
            let mut schema = json!({"type": "integer", "minimum": range.start(), "maximum": range.end()});
            if let Some(default) = default {
                schema["default"] = Value::from(*default);
            }
            schema
        }
        Kind::Boolean { default } => json!({"type": "boolean", "default": default}),
        Kind::Text { rule, default } => {
            let mut schema = text_schema(*rule);
            if let Some(default) = default {
                schema["default"] = Value::from(*default);
            }
            schema
        }
        Kind::Choice { values, default } => {
            let mut schema = json!({"type": "string", "anyOf": [{"enum": values}, {"pattern": SETTING_REFERENCE}]});
            if let Some(default) = default {
                schema["default"] = Value::from(*default);
            }
            schema
        }
        Kind::SettingName { default } => {
            let mut schema = json!({"type": "string", "pattern": SETTING_NAME});
            if let Some(default) = default {
                schema["default"] = Value::from(*default);
            }
            schema
        }
        Kind::List { rule, unique } => {
            json!({"type": "array", "minItems": 1, "uniqueItems": unique, "items": text_schema(*rule)})
        }
        Kind::Object { fields, rules } => object_schema(fields, rules),
    }
}

/// Text under `rule`, or with a `%NAME%` in it (then its value is the setting's, unknown here).
fn text_schema(rule: TextRule) -> Value {
    let checked = match rule {
        TextRule::Any | TextRule::Url => return json!({"type": "string", "pattern": PAIRED_PERCENT}),
        TextRule::Identifier => json!({"pattern": format!("^{IDENTIFIER}$")}),
        TextRule::TableName => json!({"pattern": format!("^{IDENTIFIER}(?:\\.{IDENTIFIER})?$")}),
        TextRule::SlotName => json!({"pattern": "^[a-z0-9_]{1,63}$"}),
        TextRule::PollerName => {
            json!({"pattern": "^[A-Za-z][A-Za-z0-9_-]{0,127}$", "not": {"pattern": any_case(&["host"])}})
        }
        TextRule::StorageName => json!({"pattern": "^[a-z0-9]+(?:-[a-z0-9]+)*$", "minLength": 3, "maxLength": 63}),
        TextRule::TimeZone => json!({"pattern": "^[A-Za-z0-9_/+:-]{1,64}$"}),
    };
    json!({"type": "string", "anyOf": [checked, {"pattern": SETTING_REFERENCE}]})
}

/// What a rule says of text, in words, for the docs.
pub fn text_rule_words(rule: TextRule) -> &'static str {
    match rule {
        TextRule::Any => "any text",
        TextRule::Url => "an http or https URL",
        TextRule::Identifier => "a plain SQL name: `[A-Za-z_][A-Za-z0-9_$]*`, at most 63",
        TextRule::TableName => "`table` or `schema.table`, plain SQL names",
        TextRule::SlotName => "lower-case letters, digits and `_`, at most 63",
        TextRule::PollerName => "a letter, then letters, digits, `_`, `-`; at most 128; not `host`",
        TextRule::StorageName => "3 to 63 lower-case letters, digits and single `-`",
        TextRule::TimeZone => "`UTC`, an offset like `+02:00`, or a zone name like `Europe/Paris`",
    }
}
