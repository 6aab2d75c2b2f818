//! Operator commands through the real binary answer on stdout and keep stderr for what went wrong:
//! no INFO start-up lines ("app opened", "poller ready") unless asked for with `-v`; the handler's
//! own commands (`tick` here) keep their log.

use crate::harness::{AppRoot, Orders, Receiver, dbtrigger_command, output_of};

/// Runs the real binary with `RUST_LOG` unset (the default level is what is under test).
fn run(app: &AppRoot, settings: &[(String, String)], arguments: &[&str]) -> (bool, String, String) {
    output_of(dbtrigger_command(app, settings, arguments).env_remove("RUST_LOG"))
}

fn has_startup_lines(stderr: &str) -> bool {
    stderr.contains("INFO") || stderr.contains("poller ready") || stderr.contains("app opened")
}

/// Regression (issue 40): `dbtrigger status` printed two INFO lines under its table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_print_no_startup_lines_unless_verbose() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=3, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let settings = app.settings(&orders, &receiver);

    // `tick` is the handler's own code path from a shell: it keeps its log.
    let (ok, stdout, stderr) = run(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("poller ready") || stdout.contains("INFO"), "tick logs what it does: {stdout}{stderr}");

    let commands: [&[&str]; 6] = [
        &["status"],
        &["status", "--json"],
        &["inspect", "orders"],
        &["quarantine", "list", "orders"],
        &["reset", "orders", "--to-beginning", "--dry-run"],
        &["check"],
    ];
    for command in commands {
        let (ok, stdout, stderr) = run(&app, &settings, command);
        assert!(ok, "{command:?}: {stdout}{stderr}");
        assert!(!stdout.is_empty(), "{command:?} answers on stdout");
        assert!(!has_startup_lines(&stderr), "{command:?} is quiet by default, stderr: {stderr}");
        assert!(!has_startup_lines(&stdout), "{command:?}: no log lines in its answer: {stdout}");
    }

    // -v (before or after the command) brings the INFO lines back, on stderr.
    for arguments in [&["-v", "status"][..], &["status", "-v"][..], &["inspect", "orders", "--verbose"][..]] {
        let (ok, stdout, stderr) = run(&app, &settings, arguments);
        assert!(ok, "{arguments:?}: {stderr}");
        assert!(stderr.contains("INFO") && stderr.contains("poller ready"), "{arguments:?} -v: {stderr}");
        assert!(!has_startup_lines(&stdout), "{arguments:?}: logs stay off stdout: {stdout}");
    }
}
