//! docs/configuration.md, written from the field table ([`super::fields`]) and the list of app
//! settings below: `dbtrigger schema --markdown` prints it, and a test fails when the committed file
//! differs, so that the page and the loader cannot drift apart.

use std::fmt::Write as _;

use serde_json::Value;

use super::fields::{self, Field, Kind, Rule};
use super::schema::{SCHEMA_FILE_NAME, SCHEMA_REFERENCE, text_rule_words};

/// An app setting dbtrigger reads.
pub struct AppSetting {
    pub name: &'static str,
    pub default: &'static str,
    pub example: &'static str,
    pub meaning: &'static str,
}

/// Every app setting dbtrigger reads by a fixed name, and the ones function.json names. A test
/// scans the source for the fixed names, so that a new one is documented here.
pub const APP_SETTINGS: [AppSetting; 21] = [
    AppSetting {
        name: "<source.connection>",
        default: "(required)",
        example: "`postgres://app:…@db.example.com:5432/shop?sslmode=verify-full`",
        meaning: "The database URL, in the setting `source.connection` names: `postgres://`, `mysql://` (MariaDB too) or `sqlite://` (relative to the app root).",
    },
    AppSetting {
        name: "<source.connection>__credential, <source.connection>__clientId",
        default: "none",
        example: "`ORDERS_DB__credential=managedidentity`",
        meaning: "`managedidentity`: the database password is a Microsoft Entra token of the app's managed identity (`__clientId` for a user-assigned one); the URL names the user and no password, and must require TLS unless the host is loopback. See docs/identity.md.",
    },
    AppSetting {
        name: "AzureWebJobsStorage",
        default: "(required by the host)",
        example: "`UseDevelopmentStorage=true`",
        meaning: "The Storage account the state documents (and a queue sink) use unless `state.connection` (`sink.connection`) names another setting.",
    },
    AppSetting {
        name: "<state.connection>",
        default: "`AzureWebJobsStorage`",
        example: "`file:state`",
        meaning: "A Storage connection string, `UseDevelopmentStorage=true` (Azurite), or `file:<dir>` for local work (documents at `<dir>/state/{app}/{poller}.json`).",
    },
    AppSetting {
        name: "<NAME>__blobServiceUri, <NAME>__queueServiceUri, <NAME>__accountName, <NAME>__clientId",
        default: "none",
        example: "`ORDERS_STATE__accountName=shop`",
        meaning: "An identity-based Storage connection when setting NAME itself is not set (`__clientId` for a user-assigned identity).",
    },
    AppSetting {
        name: "<sink.secret>, <alert.secret>",
        default: "none",
        example: "`whsec_…` (24 to 64 random bytes in base64)",
        meaning: "The webhook signing key: `whsec_<base64>`, or any text of at least 24 bytes.",
    },
    AppSetting {
        name: "DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE",
        default: "`10`",
        example: "`5`",
        meaning: "The most connections the app (one instance) opens to one database, shared by all its pollers of it; `source.maxConnections` overrides it. See docs/scale-out.md.",
    },
    AppSetting {
        name: "DBTRIGGER_MAX_BYTES_IN_FLIGHT",
        default: "`268435456` (256 MiB)",
        example: "`67108864`",
        meaning: "The bytes of rows all pollers of the app (one instance) hold at once, read and not yet delivered; a read waits for room. See docs/scale-out.md.",
    },
    AppSetting {
        name: "WEBSITE_SITE_NAME",
        default: "none",
        example: "`shop-functions`",
        meaning: "The app's name `{app}` in state paths (set by Azure).",
    },
    AppSetting {
        name: "DBTRIGGER_APP_NAME",
        default: "`local`",
        example: "`shop`",
        meaning: "The app's name when WEBSITE_SITE_NAME is not set.",
    },
    AppSetting {
        name: "AzureWebJobs.<function>.Disabled",
        default: "`false`",
        example: "`true`",
        meaning: "The function is disabled: not ticked, kicked or reported (`AzureWebJobs_<function>_Disabled` too).",
    },
    AppSetting {
        name: "WEBSITE_TIME_ZONE",
        default: "UTC",
        example: "`Europe/Paris`",
        meaning: "The zone schedules are evaluated in (ignored on Linux Consumption and Flex Consumption, as by the host).",
    },
    AppSetting {
        name: "TZ",
        default: "UTC",
        example: "`Europe/Paris`",
        meaning: "The schedules' zone when WEBSITE_TIME_ZONE is not set.",
    },
    AppSetting {
        name: "FUNCTIONS_CUSTOMHANDLER_PORT",
        default: "(set by the host)",
        example: "`7071`",
        meaning: "The port `serve` listens on.",
    },
    AppSetting {
        name: "FUNCTIONS_APP_ROOT_PATH",
        default: "the current directory",
        example: "`/home/site/wwwroot`",
        meaning: "The app root every command reads (`--app-root` overrides it).",
    },
    AppSetting {
        name: "FUNCTIONS_CUSTOMHANDLER_WORKER_ID",
        default: "(set by the host)",
        example: "",
        meaning: "Tells that the host started dbtrigger (and that a plan's default functionTimeout applies).",
    },
    AppSetting {
        name: "WEBSITE_SKU",
        default: "(set by Azure)",
        example: "`Dynamic`",
        meaning: "The hosting plan, for the default functionTimeout a tick budget must fit in.",
    },
    AppSetting {
        name: "WEBSITE_INSTANCE_ID",
        default: "(set by Azure)",
        example: "",
        meaning: "The instance, in the lease owner's id; also a sign of the hosting plan.",
    },
    AppSetting {
        name: "CONTAINER_NAME, LEGION_SERVICE_HOST, WEBSITE_POD_NAME, MANAGED_ENVIRONMENT",
        default: "(set by Azure)",
        example: "",
        meaning: "Signs of the hosting plan, read as the host reads them.",
    },
    AppSetting {
        name: "%NAME% in function.json",
        default: "(required when used)",
        example: "`ORDERS_SCHEDULE=0 */1 * * * *`",
        meaning: "Any setting a text field refers to as `%NAME%`.",
    },
    AppSetting {
        name: "RUST_LOG",
        default: "`info` (operator commands: `warn`, `-v` for `info`)",
        example: "`dbtrigger=debug`",
        meaning: "The log filter.",
    },
];

/// docs/configuration.md.
pub fn configuration_markdown() -> String {
    let mut page = String::new();
    page.push_str("# Configuration reference\n\n");
    page.push_str(
        "<!-- Written by `dbtrigger schema --markdown` from src/config/fields.rs; do not edit by hand: \
         regenerate with `cargo run -- schema --markdown > docs/configuration.md`. -->\n\n",
    );
    let _ = write!(
        page,
        "Every field of function.json's `poller`, `watchdog` and `status` sections, and every app setting \
         dbtrigger reads. The same facts, as a JSON Schema, are printed by `dbtrigger schema`; `dbtrigger new` \
         writes them to `<app root>/{SCHEMA_FILE_NAME}` and each function.json it writes refers to them with \
         `\"$schema\": \"{SCHEMA_REFERENCE}\"`, so that an editor validates and completes the file (the host \
         and dbtrigger ignore `$schema`). `dbtrigger check` remains the judge: it also reads the app settings.\n\n"
    );
    page.push_str(
        "Text fields take `%NAME%`, replaced by the value of app setting NAME (write `%%` for a literal `%`). \
         Fields of type *setting name* (`connection`, `secret`) take the name of a setting itself, never \
         `%NAME%`: dbtrigger reads the value and never shows it. Numbers are plain numbers (a `%NAME%` there is \
         refused). Unknown fields are refused.\n",
    );
    for section in fields::sections() {
        let _ = write!(page, "\n## `{}`\n\n{}\n", section.name, section.description);
        if section.fields.is_empty() {
            continue;
        }
        page.push_str("\n| field | type | default | limits | example | meaning |\n|---|---|---|---|---|---|\n");
        let mut rules = Vec::new();
        rows(&mut page, &mut rules, "", &section.fields, &section.rules);
        if !rules.is_empty() {
            page.push('\n');
            for (path, rule) in rules {
                let _ = writeln!(page, "- `{path}`: {}.", rule.says);
            }
        }
    }
    page.push_str(
        "\n## Bindings\n\nA poller and a watchdog have one `timerTrigger` binding (`schedule`: NCRONTAB with six \
         fields or five, or a `hh:mm:ss` time span, `%NAME%` allowed; `runOnStartup`; `useMonitor`; never \
         `functionName`). A status function has an `httpTrigger` (`authLevel` left out, `function` or `admin`; \
         anything else, `anonymous`, `0` or `\"0\"`, is refused) and an `http` output with a name (not `$return`). Types and directions are matched \
         without regard to case, as the host matches them.\n",
    );
    page.push_str("\n## App settings\n\n| setting | default | example | meaning |\n|---|---|---|---|\n");
    for setting in &APP_SETTINGS {
        let _ = writeln!(
            page,
            "| `{}` | {} | {} | {} |",
            setting.name.replace(", ", "`, `"),
            setting.default,
            setting.example,
            setting.meaning
        );
    }
    page
}

fn rows<'a>(
    page: &mut String,
    rules: &mut Vec<(String, &'a Rule)>,
    prefix: &str,
    fields: &'a [Field],
    object_rules: &'a [Rule],
) {
    for rule in object_rules {
        rules.push((prefix.trim_end_matches('.').to_string(), rule));
    }
    for field in fields {
        let path = format!("{prefix}{}", field.name);
        let (kind, default, limits) = describe(field);
        let mut meaning = field.description.to_string();
        if let Some(absent) = field.when_absent {
            let _ = write!(meaning, " Left out: {absent}.");
        }
        let example = if matches!(field.kind, Kind::Object { .. }) { String::new() } else { code(&field.example) };
        let _ = writeln!(page, "| `{path}` | {kind} | {default} | {limits} | {example} | {} |", escape(&meaning));
        if let Kind::Object { fields: inner, rules: inner_rules } = &field.kind {
            rows(page, rules, &format!("{path}."), inner, inner_rules);
        }
    }
}

/// The type, default and limits columns of a field.
fn describe(field: &Field) -> (String, String, String) {
    let default = |value: Option<String>| match (field.required, value) {
        (true, _) => "required".to_string(),
        (false, Some(value)) => value,
        (false, None) => "—".to_string(),
    };
    match &field.kind {
        Kind::Integer { range, default: value } => (
            "integer".into(),
            default(value.map(|value| format!("`{value}`"))),
            format!("{}..={}", range.start(), range.end()),
        ),
        Kind::Boolean { default: value } => ("boolean".into(), default(Some(format!("`{value}`"))), String::new()),
        Kind::Text { rule, default: value } => {
            ("text, `%NAME%`".into(), default(value.map(|text| format!("`{text}`"))), text_rule_words(*rule).into())
        }
        Kind::Choice { values, default: value } => (
            "choice, `%NAME%`".into(),
            default(value.map(|text| format!("`{text}`"))),
            values.iter().map(|value| format!("`{value}`")).collect::<Vec<_>>().join(", "),
        ),
        Kind::SettingName { default: value } => (
            "setting name".into(),
            default(value.map(|text| format!("`{text}`"))),
            "letters, digits, `_ . : -`; never `%NAME%`".into(),
        ),
        Kind::List { rule, unique } => (
            "list of text, `%NAME%`".into(),
            default(None),
            format!("at least one{}; each {}", if *unique { ", no repeats" } else { "" }, text_rule_words(*rule)),
        ),
        Kind::Object { .. } => ("object".into(), default(None), String::new()),
    }
}

fn code(value: &Value) -> String {
    format!("`{}`", escape(&value.to_string()))
}

/// A table cell: `|` would end it.
fn escape(text: &str) -> String {
    text.replace('|', "\\|")
}
