//! `dbtrigger package`: a zip for zip deploy. It refuses an app with a configuration error (the
//! same validation the handler does at start-up, settings resolved as `dev` resolves them), then
//! writes exactly what the host reads: host.json, each function's function.json, and the binary,
//! the binary with its executable bit in the zip's Unix attributes (zip deploy runs it as it finds
//! it). Nothing else in the app root or in a function folder is taken (a `.env`, a
//! local.settings.json, a `file:` state directory, a SQLite database), and no symbolic link is
//! followed: a link where a packed file should be is refused. The command lists what it packed
//! and what it left out.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::Value;
use zip::write::SimpleFileOptions;

use crate::config::AppConfig;

/// What the package holds, in the order it is written.
#[derive(Debug)]
struct Entry {
    /// Path inside the zip, `/`-separated.
    name: String,
    source: PathBuf,
    executable: bool,
}

/// What goes into the zip, and what was seen and left out (names relative to the app root; a
/// folder left out ends with `/` and is not looked into).
#[derive(Debug)]
struct Plan {
    entries: Vec<Entry>,
    left_out: Vec<String>,
}

pub fn run(app_root: &Path, out: &Path, binary: Option<&Path>) -> anyhow::Result<ExitCode> {
    let settings = crate::config::Settings::for_app_root(app_root)?;
    let config = AppConfig::load(app_root, &settings)?;
    let mut errors = Vec::new();
    for parsed in config.functions.values() {
        if let Err(error) = parsed {
            errors.push(error.to_string());
        }
    }
    if config.functions.is_empty() {
        bail!("{}: no function folder with a function.json: nothing to package", app_root.display());
    }
    if !errors.is_empty() {
        bail!(
            "refusing to package an app with configuration errors (settings come from the environment, then local.settings.json):\n  {}",
            errors.join("\n  ")
        );
    }
    let binary = match binary {
        Some(path) => path.to_path_buf(),
        None => std::env::current_exe().context("cannot find this program's own executable; give --binary")?,
    };
    let plan = plan(app_root, &config, &binary)?;
    write_zip(out, &plan.entries)?;
    println!("packaged {} files into {}:", plan.entries.len(), out.display());
    for entry in &plan.entries {
        println!("  {}{}", entry.name, if entry.executable { "  (executable)" } else { "" });
    }
    if !plan.left_out.is_empty() {
        println!("left out (the host reads none of it; local settings, state and data stay on this machine):");
        for name in &plan.left_out {
            println!("  {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// host.json, each function's function.json, and the binary under the name host.json starts it
/// by; everything else in the app root and in the function folders is listed as left out.
fn plan(app_root: &Path, config: &AppConfig, binary: &Path) -> anyhow::Result<Plan> {
    let host_json = app_root.join("host.json");
    refuse_link(&host_json, "host.json")?;
    let host: Value = serde_json::from_str(
        &std::fs::read_to_string(&host_json).with_context(|| format!("{}: cannot read", host_json.display()))?,
    )
    .with_context(|| format!("{}: invalid JSON", host_json.display()))?;
    let executable_name =
        host.pointer("/customHandler/description/defaultExecutablePath").and_then(Value::as_str).with_context(
            || format!("{}: customHandler.description.defaultExecutablePath is missing", host_json.display()),
        )?;
    if executable_name.contains('/') || executable_name.contains('\\') || executable_name.starts_with('.') {
        bail!(
            "{}: customHandler.description.defaultExecutablePath {executable_name:?}: expected a file name at the app root",
            host_json.display()
        );
    }
    let mut entries = vec![Entry { name: "host.json".into(), source: host_json, executable: false }];
    let mut left_out = Vec::new();
    for function in config.functions.keys() {
        let folder = app_root.join(function);
        refuse_link(&folder, function)?;
        let function_json = folder.join("function.json");
        let name = format!("{function}/function.json");
        refuse_link(&function_json, &name)?;
        entries.push(Entry { name, source: function_json, executable: false });
        for other in folder_entries(&folder)? {
            if other != "function.json" {
                left_out.push(format!("{function}/{other}"));
            }
        }
    }
    for other in folder_entries(app_root)? {
        let packed = other == "host.json" || config.functions.contains_key(other.trim_end_matches('/'));
        if !packed && other != executable_name {
            left_out.push(other);
        }
    }
    left_out.sort();
    entries.push(Entry { name: executable_name.to_string(), source: binary.to_path_buf(), executable: true });
    Ok(Plan { entries, left_out })
}

/// A packed file must be the file itself: a symbolic link could carry anything on this machine
/// into the zip.
fn refuse_link(path: &Path, name: &str) -> anyhow::Result<()> {
    let metadata = std::fs::symlink_metadata(path).with_context(|| format!("{}: cannot read", path.display()))?;
    if metadata.file_type().is_symlink() {
        bail!("{name} is a symbolic link ({}): package never follows links; put the file itself there", path.display());
    }
    Ok(())
}

/// The names in `folder`, a folder's (or a link's to one) with a trailing `/`; links are never
/// followed, only named.
fn folder_entries(folder: &Path) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(folder).with_context(|| format!("{}: cannot read", folder.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let file_type = entry.file_type()?;
        if file_type.is_symlink() {
            names.push(format!("{name} (symbolic link, not followed)"));
        } else if file_type.is_dir() {
            names.push(format!("{name}/"));
        } else {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

fn write_zip(out: &Path, entries: &[Entry]) -> anyhow::Result<()> {
    let file = File::create(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let mut zip = zip::ZipWriter::new(file);
    for entry in entries {
        let mode = if entry.executable { 0o755 } else { 0o644 };
        let options =
            SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated).unix_permissions(mode);
        zip.start_file(entry.name.as_str(), options).with_context(|| format!("{}: cannot add", entry.name))?;
        let mut bytes = Vec::new();
        File::open(&entry.source)
            .and_then(|mut source| source.read_to_end(&mut bytes))
            .with_context(|| format!("{}: cannot read", entry.source.display()))?;
        zip.write_all(&bytes)?;
    }
    zip.finish().context("cannot finish the zip")?;
    Ok(())
}
