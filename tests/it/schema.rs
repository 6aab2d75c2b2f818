//! The JSON Schema and the help, through the real binary (issue 28): `new` writes the schema its
//! functions refer to and every function it writes validates against it; `package` leaves the
//! schema out (the host never reads it); the harness's fixtures validate; every command's
//! `--help` has its purpose and an example, and `dbtrigger --help` groups the commands.

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::harness::AppRoot;

/// Why `schema` refuses `document`, or `None` when it validates (boon, draft 2020-12).
pub fn schema_refusal(schema: &Value, document: &Value) -> Option<String> {
    let mut schemas = boon::Schemas::new();
    let mut compiler = boon::Compiler::new();
    compiler.add_resource("/function.schema.json", schema.clone()).unwrap();
    let index = compiler.compile("/function.schema.json", &mut schemas).unwrap();
    schemas.validate(document, index).err().map(|error| format!("{error}"))
}

/// Panics unless `document` validates against the schema this build prints.
pub fn assert_valid_function_json(document: &Value) {
    let schema = dbtrigger::config::schema::function_json_schema();
    if let Some(refusal) = schema_refusal(&schema, document) {
        panic!(
            "a fixture function.json does not validate against the schema: {refusal}\n{document:#}\n\
             If the loader takes it, the schema is behind: describe the field in src/config/fields.rs \
             (`cargo test --lib config::tests_schema` names every key missing there and the function to add it to), \
             or write a deliberately broken fixture with `AppRoot::write_invalid`."
        );
    }
}

fn dbtrigger(arguments: &[&str], app_root: Option<&Path>, settings: &[(&str, &str)]) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dbtrigger"));
    command.args(arguments).env_remove("FUNCTIONS_APP_ROOT_PATH").stdin(Stdio::null());
    if let Some(root) = app_root {
        command.arg("--app-root").arg(root);
    }
    for (name, value) in settings {
        command.env(name, value);
    }
    let output = command.output().unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{}: {error}", path.display())))
        .unwrap()
}

/// `new` writes `<app root>/function.schema.json` (what `schema` prints), each function.json it
/// writes refers to it and validates against it, `check` accepts the `$schema` key, and `package`
/// leaves the schema out.
#[test]
fn new_writes_the_schema_its_functions_refer_to_and_package_leaves_it_out() {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path().join("app");
    let functions = [("orders", "webhook"), ("shipments", "queue"), ("status", "status"), ("watchdog", "watchdog")];
    for (index, (function, template)) in functions.iter().enumerate() {
        let (ok, stdout, stderr) = dbtrigger(&["new", function, "--template", template], Some(&root), &[]);
        assert!(ok, "{stdout}{stderr}");
        // Written once: a second function finds it up to date.
        assert_eq!(stdout.contains("function.schema.json"), index == 0, "{stdout}");
    }
    let (ok, printed, _) = dbtrigger(&["schema"], None, &[]);
    assert!(ok);
    let schema_file = root.join("function.schema.json");
    assert_eq!(std::fs::read_to_string(&schema_file).unwrap(), printed, "the file is what `schema` prints");
    let schema = read_json(&schema_file);
    for (function, _) in functions {
        let folder = root.join(function);
        let document = read_json(&folder.join("function.json"));
        let reference = document["$schema"].as_str().expect("a $schema");
        assert_eq!(
            folder.join(reference).canonicalize().unwrap(),
            schema_file.canonicalize().unwrap(),
            "{function}: $schema points at the app root's schema file"
        );
        if let Some(refusal) = schema_refusal(&schema, &document) {
            panic!("{function}/function.json, as `new` wrote it, does not validate: {refusal}");
        }
    }

    let settings = [
        ("ORDERS_DB", "sqlite://orders.db"),
        ("ORDERS_SCHEDULE", "0 */1 * * * *"),
        ("ORDERS_WEBHOOK_URL", "http://127.0.0.1:9/hook"),
        ("ORDERS_WEBHOOK_SECRET", "a-long-random-secret-of-32-bytes"),
        ("SHIPMENTS_DB", "sqlite://orders.db"),
        ("SHIPMENTS_SCHEDULE", "0 */1 * * * *"),
        ("AzureWebJobsStorage", "UseDevelopmentStorage=true"),
    ];
    let (ok, stdout, _) = dbtrigger(&["check"], Some(&root), &settings);
    assert!(ok && stdout.contains("ok: "), "the loader takes `$schema`: {stdout}");
    let zip_path = directory.path().join("app.zip");
    let (ok, stdout, stderr) = dbtrigger(&["package", "--out", zip_path.to_str().unwrap()], Some(&root), &settings);
    assert!(ok, "{stdout}{stderr}");
    let archive = zip::ZipArchive::new(std::fs::File::open(&zip_path).unwrap()).unwrap();
    let names: Vec<String> = archive.file_names().map(|name| name.unwrap().into_owned()).collect();
    assert!(names.iter().any(|name| name == "orders/function.json"), "{names:?}");
    assert!(!names.iter().any(|name| name.contains("schema")), "the host never reads the schema: {names:?}");
    assert!(stdout.contains("left out") && stdout.contains("  function.schema.json"), "{stdout}");
}

/// The fixture every integration test starts from validates against the schema (the harness
/// checks each document it writes: see `AppRoot::write`).
#[test]
fn the_harness_fixture_validates_against_the_schema() {
    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(10));
    assert_valid_function_json(&read_json(&app.root.join("orders/function.json")));
}

/// Every command the library defines, as a path of subcommand names.
fn command_paths(command: &clap::Command, prefix: &[String], into: &mut Vec<Vec<String>>) {
    for subcommand in command.get_subcommands().filter(|subcommand| subcommand.get_name() != "help") {
        let path = [prefix, &[subcommand.get_name().to_string()]].concat();
        into.push(path.clone());
        command_paths(subcommand, &path, into);
    }
}

/// Every command's `--help`, from the real binary, opens with a one-line purpose and ends with an
/// example that runs it; `dbtrigger --help` lists every command once under Run, Operate or Set up,
/// and keeps the disclosure sentence.
#[test]
fn every_help_has_a_purpose_and_an_example_and_the_commands_are_grouped() {
    let (ok, top, _) = dbtrigger(&["--help"], None, &[]);
    assert!(ok);
    assert!(top.contains(dbtrigger::cli::DISCLOSURE), "the disclosure sentence: {top}");
    let mut paths = Vec::new();
    command_paths(&dbtrigger::cli::command(), &[], &mut paths);
    let top_level: Vec<&String> = paths.iter().filter(|path| path.len() == 1).map(|path| &path[0]).collect();
    assert!(top_level.len() >= 14, "{top_level:?}");
    let group_of = |name: &str| {
        let mut group = None;
        for line in top.lines() {
            if !line.starts_with(' ') && line.ends_with(':') {
                group = Some(line.trim_end_matches(':').to_string());
            } else if line.split_whitespace().next() == Some(name) && line.starts_with("  ") {
                return group;
            }
        }
        None
    };
    for name in &top_level {
        let group = group_of(name);
        assert!(
            matches!(group.as_deref(), Some("Run" | "Operate" | "Set up")),
            "{name} is listed under {group:?} in dbtrigger --help:\n{top}"
        );
    }
    for (name, group) in [("tick", "Run"), ("reset", "Operate"), ("schema", "Set up")] {
        assert_eq!(group_of(name).as_deref(), Some(group), "{name}");
    }
    for path in &paths {
        let arguments: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
        let (ok, help, stderr) = dbtrigger(&arguments, None, &[]);
        let shown = path.join(" ");
        assert!(ok, "dbtrigger {shown} --help: {stderr}");
        let purpose = help.lines().next().unwrap_or_default();
        assert!(purpose.len() > 10 && !purpose.starts_with("Usage"), "`{shown}` opens with its purpose: {help}");
        let example = help.split("Example:\n").nth(1).unwrap_or_default();
        assert!(
            example.trim_start().starts_with(&format!("dbtrigger {shown}")),
            "`dbtrigger {shown} --help` ends with an example of it:\n{help}"
        );
    }
}
