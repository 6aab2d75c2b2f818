//! The docs hold together: every relative link in README.md and docs/*.md names a file of the
//! repository, and every `#anchor` a heading of the page it points into (as GitHub makes anchors
//! of headings). A page moved or a heading renamed breaks a test, not a reader's click.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page under docs/.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ is readable")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The targets of a page's inline links and images, `[text](target)`, outside code blocks and code
/// spans.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block {
            continue;
        }
        // Code spans hold examples, not links.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("").to_string();
            found.push(target);
            rest = &after[end..];
        }
    }
    found
}

/// GitHub's anchor of a heading: lower case, every character but letters, digits, spaces, `-` and
/// `_` dropped, spaces made `-`; a repeated anchor gets `-1`, `-2`…
fn anchors(text: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#').trim();
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut candidate = slug.clone();
        let mut repeat = 0;
        while anchors.contains(&candidate) {
            repeat += 1;
            candidate = format!("{slug}-{repeat}");
        }
        anchors.insert(candidate);
    }
    anchors
}

/// What is wrong with one link of `page` (`None`: it resolves).
fn broken(page: &Path, target: &str) -> Option<String> {
    if target.is_empty() {
        return Some("an empty link".into());
    }
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (file, anchor) = match target.split_once('#') {
        Some((file, anchor)) => (file, Some(anchor)),
        None => (target, None),
    };
    let resolved = if file.is_empty() { page.to_path_buf() } else { page.parent().unwrap().join(file) };
    if !resolved.exists() {
        return Some(format!("{} does not exist", resolved.display()));
    }
    let anchor = anchor?;
    if resolved.extension().is_none_or(|extension| extension != "md") {
        return None;
    }
    let text = std::fs::read_to_string(&resolved).unwrap();
    if anchors(&text).contains(anchor) {
        None
    } else {
        Some(format!("{} has no heading whose anchor is #{anchor}", resolved.display()))
    }
}

#[test]
fn every_relative_link_of_the_readme_and_the_docs_resolves() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for target in links(&text) {
            checked += 1;
            if let Some(problem) = broken(&page, &target) {
                problems.push(format!("{}: ({target}): {problem}", page.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
    assert!(checked > 20, "only {checked} links found: the link reader is broken");
}

#[test]
fn the_readme_links_every_page_of_the_docs() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let linked: BTreeSet<String> = links(&readme).into_iter().collect();
    for page in pages().into_iter().skip(1) {
        let name = format!("docs/{}", page.file_name().unwrap().to_string_lossy());
        assert!(linked.contains(&name), "README.md does not link {name}");
    }
}

#[test]
fn the_link_reader_finds_links_and_anchors_as_github_makes_them() {
    let text = "# Poison (seed 001 case I)\n## What the database sends for `batch.maxBytes`\n## A\n## A\n\
                see [x](a.md#b) and `[not](c.md)`, ![chart](d.svg)\n```\n[nor](e.md)\n```\n";
    assert_eq!(links(text), vec!["a.md#b".to_string(), "d.svg".to_string()]);
    let found = anchors(text);
    for anchor in ["poison-seed-001-case-i", "what-the-database-sends-for-batchmaxbytes", "a", "a-1"] {
        assert!(found.contains(anchor), "{anchor} in {found:?}");
    }
    assert!(broken(&root().join("README.md"), "docs/no-such-page.md").is_some());
    assert!(broken(&root().join("README.md"), "#no-such-heading").is_some());
}
