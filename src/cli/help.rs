//! What `--help` shows beyond each command's doc comment: the commands grouped by what they are for
//! (clap lists subcommands in one block, and `help_heading` groups arguments only), and an example
//! for every command. The purpose lines come from the commands themselves, so the grouped list
//! cannot drift from them; the tests hold every command to a group and an example.

use clap::CommandFactory;

use super::Cli;

/// The top-level commands by what they are for.
pub const GROUPS: [(&str, &[&str]); 3] = [
    ("Run", &["serve", "tick", "dev", "demo"]),
    ("Operate", &["status", "inspect", "reset", "clone", "fingerprint", "quarantine"]),
    ("Set up", &["new", "check", "sql", "package", "schema"]),
];

/// An example for every command, by its path of subcommand names.
pub const EXAMPLES: [(&str, &str); 20] = [
    ("serve", "dbtrigger serve --app-root /home/site/wwwroot --port 7071"),
    ("tick", "dbtrigger tick orders --app-root ./app"),
    ("dev", "dbtrigger dev --app-root ./app"),
    ("demo", "dbtrigger demo --rows 10000"),
    ("status", "dbtrigger status --app-root ./app --poller orders"),
    ("inspect", "dbtrigger inspect orders --app-root ./app"),
    ("reset", "dbtrigger reset orders --to-cursor 2024-05-01T00:00:00Z --pk id=0 --reason \"replay May\""),
    ("clone", "dbtrigger clone orders orders-backfill --from-beginning --yes --reason backfill"),
    ("fingerprint", "dbtrigger fingerprint accept orders --reason \"added a column\""),
    ("fingerprint accept", "dbtrigger fingerprint accept orders --dry-run"),
    ("quarantine", "dbtrigger quarantine list orders"),
    ("quarantine list", "dbtrigger quarantine list orders --json"),
    ("quarantine show", "dbtrigger quarantine show orders q_3f2a9c01e5b7d468"),
    ("quarantine replay", "dbtrigger quarantine replay orders --all --yes --reason \"receiver fixed\""),
    ("quarantine purge", "dbtrigger quarantine purge orders q_3f2a9c01e5b7d468 --reason \"test row\""),
    ("new", "dbtrigger new orders --template webhook --set source.table=public.orders --set source.cursor=updated_at"),
    ("check", "dbtrigger check --app-root ./app"),
    ("sql", "dbtrigger sql orders --app-root ./app > orders.sql"),
    ("package", "dbtrigger package --app-root ./app --out app.zip"),
    ("schema", "dbtrigger schema > function.schema.json"),
];

/// The command line, with the grouped list of commands and an example under each command's help.
pub fn command() -> clap::Command {
    let command = with_examples(Cli::command(), "");
    let listing = grouped_listing(&command);
    command.help_template(format!(
        "{{about-with-newline}}\n{{usage-heading}} {{usage}}\n\n{listing}\nOptions:\n{{options}}{{after-help}}"
    ))
}

fn with_examples(command: clap::Command, path: &str) -> clap::Command {
    command.mut_subcommands(|subcommand| {
        let name = subcommand.get_name().to_string();
        let sub_path = if path.is_empty() { name } else { format!("{path} {name}") };
        let subcommand = match EXAMPLES.iter().find(|(example_path, _)| *example_path == sub_path) {
            Some((_, example)) => subcommand.after_help(format!("Example:\n  {example}")),
            None => subcommand,
        };
        with_examples(subcommand, &sub_path)
    })
}

/// "Run:", "Operate:", "Set up:", each with its commands and their purpose line; a command in no
/// group is listed under "Other" rather than hidden.
fn grouped_listing(command: &clap::Command) -> String {
    let width = command.get_subcommands().map(|subcommand| subcommand.get_name().len()).max().unwrap_or(0);
    let line = |name: &str| {
        let about = command
            .find_subcommand(name)
            .and_then(|subcommand| subcommand.get_about())
            .map(ToString::to_string)
            .unwrap_or_default();
        format!("  {name:width$}  {about}\n")
    };
    let mut listing = String::new();
    for (group, names) in GROUPS {
        listing.push_str(&format!("{group}:\n"));
        for name in names {
            listing.push_str(&line(name));
        }
        listing.push('\n');
    }
    let grouped: Vec<&str> = GROUPS.iter().flat_map(|(_, names)| names.iter().copied()).collect();
    let others: Vec<String> = command
        .get_subcommands()
        .map(|subcommand| subcommand.get_name().to_string())
        .filter(|name| name != "help" && !grouped.contains(&name.as_str()))
        .collect();
    if !others.is_empty() {
        listing.push_str("Other:\n");
        for name in &others {
            listing.push_str(&line(name));
        }
        listing.push('\n');
    }
    listing.push_str(
        "`dbtrigger help <command>` or `dbtrigger <command> --help` shows a command's options and an example.\n",
    );
    listing
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command's path of subcommand names (the `help` subcommands clap adds left out).
    fn paths(command: &clap::Command, prefix: &str, into: &mut Vec<String>) {
        for subcommand in command.get_subcommands().filter(|subcommand| subcommand.get_name() != "help") {
            let path = format!("{prefix}{}", subcommand.get_name());
            into.push(path.clone());
            paths(subcommand, &format!("{path} "), into);
        }
    }

    #[test]
    fn every_command_is_in_one_group_and_has_an_example_of_itself() {
        let command = command();
        let top: Vec<&str> =
            command.get_subcommands().map(clap::Command::get_name).filter(|name| *name != "help").collect();
        for name in &top {
            let groups = GROUPS.iter().filter(|(_, names)| names.contains(name)).count();
            assert_eq!(groups, 1, "`{name}` must be in exactly one of help::GROUPS");
        }
        let grouped = GROUPS.iter().flat_map(|(_, names)| names.iter());
        for name in grouped {
            assert!(top.contains(name), "help::GROUPS lists `{name}`, which is no command");
        }
        let mut all = Vec::new();
        paths(&command, "", &mut all);
        for path in &all {
            let example = EXAMPLES.iter().find(|(example_path, _)| example_path == path);
            let Some((_, example)) = example else { panic!("`{path}` has no example in help::EXAMPLES") };
            assert!(example.starts_with(&format!("dbtrigger {path}")), "the example of `{path}` runs it: {example}");
            // The example parses: its options exist and its values fit.
            let words = example.split(" > ").next().unwrap_or_default();
            let arguments: Vec<String> = shell_words(words);
            if let Err(error) = command.clone().try_get_matches_from(&arguments) {
                panic!("the example of `{path}` does not parse: {error}");
            }
        }
        for (path, _) in EXAMPLES {
            assert!(all.iter().any(|known| known == path), "help::EXAMPLES has `{path}`, which is no command");
        }
    }

    /// Words as a shell splits them, for the double quotes the examples use.
    fn shell_words(text: &str) -> Vec<String> {
        let mut words = Vec::new();
        let mut word = String::new();
        let mut quoted = false;
        for character in text.chars() {
            match character {
                '"' => quoted = !quoted,
                ' ' if !quoted => {
                    if !word.is_empty() {
                        words.push(std::mem::take(&mut word));
                    }
                }
                other => word.push(other),
            }
        }
        if !word.is_empty() {
            words.push(word);
        }
        words
    }
}
