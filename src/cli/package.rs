//! `dbtrigger package`: a zip for zip deploy. It refuses an app with a configuration error (the
//! same validation the handler does at start-up, settings resolved as `dev` resolves them), then
//! writes host.json, every function folder and the binary, the binary with its executable bit in
//! the zip's Unix attributes (zip deploy runs it as it finds it). Local-only files
//! (local.settings.json, state directories, `.tools/`) are never in it: only what the host reads
//! is taken, by name.

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
    let entries = entries(app_root, &config, &binary)?;
    write_zip(out, &entries)?;
    println!("packaged {} files into {}:", entries.len(), out.display());
    for entry in &entries {
        println!("  {}{}", entry.name, if entry.executable { "  (executable)" } else { "" });
    }
    Ok(ExitCode::SUCCESS)
}

/// host.json, each function folder (every file under it), and the binary under the name host.json
/// starts it by.
fn entries(app_root: &Path, config: &AppConfig, binary: &Path) -> anyhow::Result<Vec<Entry>> {
    let host_json = app_root.join("host.json");
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
    for function in config.functions.keys() {
        let folder = app_root.join(function);
        let mut files = Vec::new();
        collect_files(&folder, &mut files)?;
        files.sort();
        for file in files {
            let relative = file.strip_prefix(app_root).expect("under the app root");
            let name =
                relative.components().map(|part| part.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/");
            entries.push(Entry { name, source: file, executable: false });
        }
    }
    entries.push(Entry { name: executable_name.to_string(), source: binary.to_path_buf(), executable: true });
    Ok(entries)
}

fn collect_files(folder: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(folder).with_context(|| format!("{}: cannot read", folder.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect_files(&path, files)?;
        } else {
            files.push(path);
        }
    }
    Ok(())
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
