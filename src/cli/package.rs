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
    content: Content,
    executable: bool,
}

/// Where an entry's bytes come from.
#[derive(Debug)]
enum Content {
    /// Read once, from the file itself (never through a link), when the plan was made: what was
    /// checked is what is packed.
    Read(Vec<u8>),
    /// The running binary, read as the zip is written.
    Binary(PathBuf),
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
    let host_bytes = read_packed(&host_json, "host.json")?;
    let host: Value =
        serde_json::from_slice(&host_bytes).with_context(|| format!("{}: invalid JSON", host_json.display()))?;
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
    let executable_name = executable_name.to_string();
    let mut entries = vec![Entry { name: "host.json".into(), content: Content::Read(host_bytes), executable: false }];
    let mut left_out = Vec::new();
    for function in config.functions.keys() {
        let folder = app_root.join(function);
        refuse_link(&folder, function)?;
        let function_json = folder.join("function.json");
        let name = format!("{function}/function.json");
        let bytes = read_packed(&function_json, &name)?;
        entries.push(Entry { name, content: Content::Read(bytes), executable: false });
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
    entries.push(Entry { name: executable_name, content: Content::Binary(binary.to_path_buf()), executable: true });
    Ok(Plan { entries, left_out })
}

/// A packed file's bytes, from one open of the file itself: opened without following a link
/// (`O_NOFOLLOW`: a link there fails the open), and the opened handle checked to be a regular
/// file, then read from that same handle. Nothing is looked up twice, so nothing can be swapped
/// for a link between a check and the read.
fn read_packed(path: &Path, name: &str) -> anyhow::Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path);
    let mut file = match opened {
        Ok(file) => file,
        Err(error) if error.raw_os_error() == Some(libc::ELOOP) => {
            bail!(
                "{name} is a symbolic link ({}): package never follows links; put the file itself there",
                path.display()
            )
        }
        Err(error) => return Err(error).with_context(|| format!("{}: cannot read", path.display())),
    };
    let metadata = file.metadata().with_context(|| format!("{}: cannot read", path.display()))?;
    if !metadata.file_type().is_file() {
        bail!("{name} is not a regular file ({}): package packs only the file itself", path.display());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(metadata.len()).unwrap_or(0));
    file.read_to_end(&mut bytes).with_context(|| format!("{}: cannot read", path.display()))?;
    Ok(bytes)
}

/// A function folder must be the folder itself: a symbolic link could carry anything on this
/// machine into the zip.
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
        match &entry.content {
            Content::Read(bytes) => zip.write_all(bytes)?,
            Content::Binary(path) => {
                let mut bytes = Vec::new();
                File::open(path)
                    .and_then(|mut source| source.read_to_end(&mut bytes))
                    .with_context(|| format!("{}: cannot read", path.display()))?;
                zip.write_all(&bytes)?;
            }
        }
    }
    zip.finish().context("cannot finish the zip")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::read_packed;

    /// Regression (issue 36, section 3): a packed file is opened once, without following a link,
    /// and what was opened is checked: a link (even to a good file), a folder and a FIFO are
    /// refused; the file itself is read from that same open.
    #[test]
    fn a_packed_file_is_opened_once_never_through_a_link() {
        let directory = tempfile::tempdir().unwrap();
        let file = directory.path().join("function.json");
        std::fs::write(&file, b"{}").unwrap();
        assert_eq!(read_packed(&file, "f").unwrap(), b"{}");
        let link = directory.path().join("link.json");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let refused = read_packed(&link, "orders/function.json").unwrap_err().to_string();
        assert!(refused.contains("is a symbolic link"), "{refused}");
        let refused = read_packed(directory.path(), "folder").unwrap_err().to_string();
        assert!(refused.contains("not a regular file"), "{refused}");
        let fifo = directory.path().join("fifo");
        let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let refused = read_packed(&fifo, "fifo").unwrap_err().to_string();
        assert!(refused.contains("not a regular file"), "{refused}");
    }
}
