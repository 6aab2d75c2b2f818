//! `dbtrigger new` writes a function from a template (and, at the app root, the JSON Schema its
//! `$schema` refers to); `dbtrigger check` validates every function.json against the app settings
//! without touching a database or a store (for CI).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::config::schema::{SCHEMA_FILE_NAME, function_json_schema};
use crate::config::{AppConfig, FunctionConfig};

/// The templates this binary carries (the same files as `function_templates/`).
const TEMPLATES: [(&str, &str); 4] = [
    ("webhook", include_str!("../../function_templates/webhook-poller/function.json")),
    ("queue", include_str!("../../function_templates/queue-poller/function.json")),
    ("status", include_str!("../../function_templates/status/function.json")),
    ("watchdog", include_str!("../../function_templates/watchdog/function.json")),
];

/// The host.json `new` writes into an app root that has none. No `extensionBundle`: timer and HTTP
/// triggers are built into the host (azure-functions-host `Binding/CoreExtensionsScriptBindingProvider.cs`,
/// `Binding/WebJobsCoreScriptBindingProvider.cs`), and a bundle makes `func start` download it for nothing.
fn host_json() -> Value {
    json!({
        "version": "2.0",
        "functionTimeout": "00:10:00",
        "logging": {"logLevel": {"default": "Information"}},
        "customHandler": {
            "description": {"defaultExecutablePath": "dbtrigger", "workingDirectory": "", "arguments": ["serve"]},
            "enableForwardingHttpRequest": false
        }
    })
}

pub fn new(app_root: &Path, function: &str, template: &str, sets: &[String]) -> anyhow::Result<ExitCode> {
    let Some((_, text)) = TEMPLATES.iter().find(|(name, _)| *name == template) else {
        bail!(
            "no template {template:?}: choose one of {}",
            TEMPLATES.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(", ")
        );
    };
    // The host's rule for function names, lower case as the host's documentation writes them.
    if !crate::config::is_valid_function_name(function) || function != function.to_ascii_lowercase() {
        bail!(
            "{function:?} is not a valid function name: lower-case letters, digits, '_' and '-', starting with a letter"
        );
    }
    let folder = app_root.join(function);
    let file = folder.join("function.json");
    if file.exists() {
        bail!("{} already exists: refusing to overwrite it", file.display());
    }
    // The template's settings are named for its `orders` example: name them for this function.
    let prefix = function.to_ascii_uppercase().replace('-', "_");
    let text = text
        .replace("ORDERS_", &format!("{prefix}_"))
        .replace("orders-changes", &format!("{}-changes", function.replace('_', "-")));
    let mut document: Value = serde_json::from_str(&text).expect("the templates are valid JSON");
    for pair in sets {
        let (path, value) = pair.split_once('=').with_context(|| format!("--set {pair:?}: expected KEY=VALUE"))?;
        if names_a_setting(path) && value.contains('%') {
            bail!(
                "--set {path}: this field names an app setting: write the name ({}), not %NAME% (which would put \
                 the setting's value, a password or a key, where its name belongs)",
                value.trim_matches('%')
            );
        }
        set(&mut document, path, value)?;
    }
    if !app_root.join("host.json").exists() {
        std::fs::create_dir_all(app_root).with_context(|| format!("{}: cannot create", app_root.display()))?;
        std::fs::write(app_root.join("host.json"), serde_json::to_vec_pretty(&host_json())?)
            .with_context(|| format!("{}: cannot write host.json", app_root.display()))?;
        println!("wrote {}", app_root.join("host.json").display());
    }
    write_schema(app_root)?;
    std::fs::create_dir_all(&folder).with_context(|| format!("{}: cannot create", folder.display()))?;
    std::fs::write(&file, serde_json::to_vec_pretty(&document)?)
        .with_context(|| format!("{}: cannot write", file.display()))?;
    println!("wrote {}", file.display());
    let needed = settings_named(&document);
    if !needed.is_empty() {
        println!("app settings it needs (local.settings.json `Values` for local work, the app's settings in Azure):");
        for name in needed {
            println!("  {name} = {}", example_for(&name));
            if name.ends_with("_DB") {
                println!(
                    "  {name}__credential = managedidentity (optional: the password is then the app's managed identity's \
                     Entra token, the URL names the user and no password; {name}__clientId for a user-assigned identity; \
                     docs/identity.md)"
                );
            }
        }
    }
    println!(
        "`connection` and `secret` fields name an app setting (write NAME, never %NAME%); other fields take %NAME%"
    );
    println!("then: dbtrigger check, and dbtrigger tick {function} (or dbtrigger dev)");
    Ok(ExitCode::SUCCESS)
}

/// `<app root>/function.schema.json`, which the `$schema` of every template refers to (one folder
/// up), so that an editor validates and completes function.json. Written when missing or when this
/// build's schema differs (after an upgrade). The host never reads it, and `package` leaves it out.
fn write_schema(app_root: &Path) -> anyhow::Result<()> {
    let path = app_root.join(SCHEMA_FILE_NAME);
    let text = serde_json::to_string_pretty(&function_json_schema())? + "\n";
    if std::fs::read_to_string(&path).is_ok_and(|written| written == text) {
        return Ok(());
    }
    std::fs::write(&path, text).with_context(|| format!("{}: cannot write", path.display()))?;
    println!("wrote {} (the JSON Schema editors check function.json against)", path.display());
    Ok(())
}

/// Whether a `--set` path is a field that names an app setting (`source.connection`,
/// `sink.secret`, `alert.secret`, …): its value is a name, never `%NAME%`.
fn names_a_setting(path: &str) -> bool {
    matches!(path.rsplit('.').next(), Some("connection" | "secret"))
}

/// Sets `path` (dotted, inside the template's section: `poller`, `watchdog`; `schedule` is the timer's) to `value` (JSON
/// if it is JSON, else the text).
fn set(document: &mut Value, path: &str, value: &str) -> anyhow::Result<()> {
    let value: Value = serde_json::from_str(value).unwrap_or_else(|_| Value::from(value));
    if path == "schedule" {
        let timer = document["bindings"]
            .as_array_mut()
            .and_then(|bindings| bindings.iter_mut().find(|binding| binding["type"] == "timerTrigger"))
            .context("--set schedule: this template has no timer")?;
        timer["schedule"] = value;
        return Ok(());
    }
    let section = ["poller", "watchdog", "status"]
        .into_iter()
        .find(|section| document.get(*section).is_some())
        .expect("every template has a section");
    let mut at = &mut document[section];
    let parts: Vec<&str> = path.split('.').collect();
    if parts.iter().any(|part| part.is_empty()) {
        bail!("--set {path}: expected a dotted path like source.table");
    }
    for part in &parts[..parts.len() - 1] {
        if !at.is_object() {
            bail!("--set {path}: {part:?} is not inside an object");
        }
        at = at.as_object_mut().expect("checked").entry(part.to_string()).or_insert_with(|| json!({}));
    }
    let Some(object) = at.as_object_mut() else {
        bail!("--set {path}: not inside an object");
    };
    object.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// The app settings a function.json names: `%NAME%` values, and the `connection` and `secret`
/// fields (which name settings, never hold values).
fn settings_named(document: &Value) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    fn walk(value: &Value, key: Option<&str>, names: &mut BTreeSet<String>) {
        match value {
            Value::String(text) => {
                if matches!(key, Some("connection" | "secret")) && !text.contains('%') {
                    names.insert(text.clone());
                }
                let mut rest = text.as_str();
                while let Some(start) = rest.find('%') {
                    let after = &rest[start + 1..];
                    let Some(end) = after.find('%') else { break };
                    if end > 0 {
                        names.insert(after[..end].to_string());
                    }
                    rest = &after[end + 1..];
                }
            }
            Value::Array(items) => items.iter().for_each(|item| walk(item, None, names)),
            Value::Object(map) => map.iter().for_each(|(name, item)| walk(item, Some(name), names)),
            _ => {}
        }
    }
    walk(document, None, &mut names);
    names
}

fn example_for(name: &str) -> &'static str {
    match name {
        "AzureWebJobsStorage" => "UseDevelopmentStorage=true (Azurite), or a Storage connection string",
        _ if name.ends_with("_DB") => {
            "postgres://user:password@host:5432/db?sslmode=verify-full \
             (or mysql://…?ssl-mode=VERIFY_IDENTITY, sqlite://…)"
        }
        _ if name.ends_with("_SCHEDULE") => "0 */1 * * * * (NCRONTAB: every minute)",
        _ if name.ends_with("_SECRET") => "a long random string, shared with the receiver",
        _ if name.ends_with("_URL") => "https://receiver.example.com/hook",
        _ => "(a value)",
    }
}

/// What the offline check passed: each function it took (`ok:` names it unless the live check
/// finds something missing for its poller), and whether it printed a problem.
pub struct Checked {
    pub failed: bool,
    /// The function as `ok:` names it, and its poller's name.
    pub good: Vec<(String, Option<String>)>,
}

impl Checked {
    /// The verdict after the live check: `ok:` names the functions nothing is missing for (one
    /// verdict per poller: one with a `missing` line is not named `ok`); exit 1 on any problem.
    pub fn verdict(&self, missing: &BTreeSet<String>) -> ExitCode {
        if self.failed {
            return ExitCode::FAILURE;
        }
        let good: Vec<&str> = self
            .good
            .iter()
            .filter(|(_, poller)| poller.as_ref().is_none_or(|poller| !missing.contains(poller)))
            .map(|(shown, _)| shown.as_str())
            .collect();
        if !good.is_empty() {
            println!("ok: {}", good.join(", "));
        }
        if missing.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
    }
}

/// Every function.json of the app against the app settings (environment, then
/// local.settings.json): one line per problem (file: field: reason), exit 1 when there is one.
pub fn check(app_root: &Path) -> anyhow::Result<Checked> {
    let settings = crate::config::Settings::for_app_root(app_root)?;
    let mut problems = Vec::new();
    let host_json = app_root.join("host.json");
    match std::fs::read_to_string(&host_json) {
        Err(error) => problems.push(format!("{}: (file): cannot read: {error}", host_json.display())),
        Ok(text) => match serde_json::from_str::<Value>(&text) {
            Err(error) => problems.push(format!("{}: (document): invalid JSON: {error}", host_json.display())),
            Ok(host) => {
                if host.pointer("/customHandler/description/defaultExecutablePath").and_then(Value::as_str).is_none() {
                    problems.push(format!(
                        "{}: customHandler.description.defaultExecutablePath: missing: the host would not start dbtrigger",
                        host_json.display()
                    ));
                }
            }
        },
    }
    let config = match AppConfig::load(app_root, &settings) {
        Ok(config) => config,
        Err(error) => {
            problems.push(error.to_string());
            for problem in &problems {
                println!("{problem}");
            }
            return Ok(Checked { failed: true, good: Vec::new() });
        }
    };
    if config.functions.is_empty() {
        problems.push(format!("{}: no function folder with a function.json", app_root.display()));
    }
    let mut good = Vec::new();
    let mut warnings = Vec::new();
    for (name, parsed) in &config.functions {
        match parsed {
            Ok(FunctionConfig::Poller(poller)) => {
                let label = match &poller.source.identity {
                    Some(identity) => format!(
                        "{name} (poller {}, logs in by managed identity: {} = managedidentity{})",
                        poller.poller_name,
                        identity.setting,
                        identity.client_id.as_ref().map(|_| ", user-assigned").unwrap_or_default()
                    ),
                    None => format!("{name} (poller {})", poller.poller_name),
                };
                good.push((label, Some(poller.poller_name.clone())));
                if let Some(warning) = crate::config::tls::tls_warning(&poller.source) {
                    warnings.push(format!("warning: {}: poller.source.connection: {warning}", poller.file.display()));
                }
            }
            Ok(FunctionConfig::Status(_)) => good.push((format!("{name} (status)"), None)),
            Ok(FunctionConfig::Watchdog(_)) => good.push((format!("{name} (watchdog)"), None)),
            Err(error) => problems.push(error.to_string()),
        }
    }
    for problem in &problems {
        println!("{problem}");
    }
    // Warnings do not fail the check: a private network may be trusted. They are said every time.
    for warning in &warnings {
        println!("{warning}");
    }
    Ok(Checked { failed: !problems.is_empty(), good })
}
