//! `inbox-admin` run as an operator runs it, against a real PostgreSQL: migrate, purge, stats and
//! the errors a typo gets.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::process::{Command, Output};
use std::time::Duration;

use inbox_postgres::testkit::TestDb;

const DAY: Duration = Duration::from_secs(24 * 3600);

fn admin(args: &[&str]) -> Output {
    admin_with(args, &[])
}

/// `inbox-admin` with these environment variables; stdout and stderr are pipes.
fn admin_with(args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inbox-admin"))
        .args(args)
        .env_remove("INBOX_ADMIN_PROGRESS_EVERY")
        .envs(envs.iter().copied())
        .output()
        .expect("the inbox-admin binary runs")
}

/// Stdout as the one JSON object it must be, on one line.
fn json_object(out: &Output) -> serde_json::Value {
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "not one line:\n{stdout}");
    let value: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stdout}"));
    assert!(value.is_object(), "{value}");
    value
}

/// Progress redrawn in place (a carriage return, an escape sequence) has no place in a pipe.
fn assert_no_redrawing(out: &Output) {
    for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        let output = text(bytes);
        assert!(
            !output.contains(['\r', '\x1b']),
            "{name} has a carriage return or an escape: {output:?}"
        );
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn migrate_creates_the_table_in_the_named_schema_with_the_key_mode() {
    let db = TestDb::new().await;
    let args = [
        "migrate",
        "--schema",
        &db.schema,
        "--table",
        "orders_inbox",
        "--key-mode",
        "uuid",
    ];
    let out = admin(&args);
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).contains("orders_inbox"), "{out:?}");
    let key_type: String = sqlx::query_scalar(
        "SELECT data_type FROM information_schema.columns
         WHERE table_schema = $1 AND table_name = 'orders_inbox' AND column_name = 'message_id'",
    )
    .bind(&db.schema)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(key_type, "uuid");

    // Running it again changes nothing and succeeds.
    let again = admin(&args);
    assert!(again.status.success(), "{again:?}");
    db.drop().await;
}

#[tokio::test]
async fn purge_deletes_expired_rows_batch_by_batch_and_keeps_fresh_ones() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 2_500, 20 * DAY).await;
    db.insert_aged_rows("billing", 10, DAY).await;

    let out = admin(&[
        "purge",
        "--schema",
        &db.schema,
        "--older-than",
        "14d",
        "--batch",
        "1000",
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    for line in [
        "batch 1: 1000 rows",
        "batch 2: 1000 rows",
        "batch 3: 500 rows",
        "deleted 2500 rows older than 14d",
    ] {
        assert!(stdout.contains(line), "`{line}` missing from:\n{stdout}");
    }
    assert_eq!(db.inbox_rows().await, 10);
    db.drop().await;
}

#[tokio::test]
async fn stats_exits_2_when_a_consumer_remembers_less_than_the_minimum_window() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 30, 20 * DAY).await;

    let long_enough = admin(&["stats", "--schema", &db.schema, "--min-window", "7d"]);
    assert_eq!(long_enough.status.code(), Some(0), "{long_enough:?}");
    let stdout = text(&long_enough.stdout);
    assert!(stdout.contains("rows         30"), "{stdout}");
    assert!(stdout.contains("billing"), "{stdout}");
    assert!(!stdout.contains("SHORTER"), "{stdout}");

    db.insert_aged_rows("shipping", 5, 2 * DAY).await;
    let short = admin(&["stats", "--schema", &db.schema, "--min-window", "7d"]);
    assert_eq!(short.status.code(), Some(3), "{short:?}");
    let stdout = text(&short.stdout);
    let shipping = stdout.lines().find(|l| l.starts_with("shipping")).unwrap();
    assert!(shipping.contains("SHORTER THAN --min-window"), "{shipping}");
    let billing = stdout.lines().find(|l| l.starts_with("billing")).unwrap();
    assert!(!billing.contains("SHORTER"), "{billing}");
    assert!(text(&short.stderr).contains("less than 7d"), "{short:?}");
    db.drop().await;
}

#[tokio::test]
async fn purge_refuses_a_window_below_one_hour_unless_forced() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 40, 2 * DAY).await;

    for (window, named) in [("0s", "`--older-than 0s`"), ("14m", "`--older-than 14m`")] {
        let out = admin(&["purge", "--schema", &db.schema, "--older-than", window]);
        assert_eq!(out.status.code(), Some(2), "{window}: {out:?}");
        let stderr = text(&out.stderr);
        for expected in [named, "1h", "--force"] {
            assert!(
                stderr.contains(expected),
                "{window}: `{expected}` missing from:\n{stderr}"
            );
        }
        assert_eq!(db.inbox_rows().await, 40, "{window} purged without --force");
    }

    let forced = admin(&[
        "purge",
        "--schema",
        &db.schema,
        "--older-than",
        "14m",
        "--force",
    ]);
    assert!(forced.status.success(), "{forced:?}");
    assert!(
        text(&forced.stdout).contains("deleted 40 rows"),
        "{forced:?}"
    );
    assert_eq!(db.inbox_rows().await, 0);

    // `--yes` is the same confirmation, and the floor itself is not below the floor.
    db.insert_aged_rows("billing", 3, 2 * DAY).await;
    for flags in [
        &["--older-than", "30m", "--yes"][..],
        &["--older-than", "1h"][..],
    ] {
        let mut args = vec!["purge", "--schema", &db.schema];
        args.extend_from_slice(flags);
        let out = admin(&args);
        assert!(out.status.success(), "{flags:?}: {out:?}");
    }
    assert_eq!(db.inbox_rows().await, 0);
    db.drop().await;
}

#[tokio::test]
async fn help_as_a_value_or_a_stray_word_never_reports_success() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 30, 20 * DAY).await;

    // `help` taken as the schema's name: there is no inbox in a schema `help`.
    let out = admin(&["purge", "--older-than", "14d", "--schema", "help"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("help"), "{out:?}");

    let usage_errors: [&[&str]; 3] = [
        &["purge", "--schema", &db.schema, "--older-than", "help"],
        &[
            "purge",
            "--schema",
            &db.schema,
            "--older-than",
            "14d",
            "help",
        ],
        &["stats", "--schema", &db.schema, "--min-window", "help"],
    ];
    for args in usage_errors {
        let out = admin(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(text(&out.stderr).contains("help"), "{args:?}: {out:?}");
    }
    assert_eq!(db.inbox_rows().await, 30);
    db.drop().await;
}

#[tokio::test]
async fn purge_takes_weeks_and_other_humantime_durations() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 7, 20 * DAY).await;
    db.insert_aged_rows("billing", 3, 10 * DAY).await;
    db.insert_aged_rows("billing", 2, DAY).await;

    let out = admin(&["purge", "--schema", &db.schema, "--older-than", "2w"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(db.inbox_rows().await, 5);
    let out = admin(&["purge", "--schema", &db.schema, "--older-than", "5days 12h"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(db.inbox_rows().await, 2);
    db.drop().await;
}

#[tokio::test]
async fn stats_json_prints_one_object_per_consumer_and_keeps_the_alarm_status() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 30, 20 * DAY).await;
    db.insert_aged_rows("shipping", 5, 2 * DAY).await;

    let out = admin(&[
        "stats",
        "--schema",
        &db.schema,
        "--min-window",
        "7d",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("`{l}` is not JSON: {e}")))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let billing = &lines[0];
    assert_eq!(billing["consumer"], "billing");
    assert_eq!(billing["rows"], 30);
    let window = billing["window_seconds"].as_u64().unwrap();
    assert!(window >= 20 * DAY.as_secs() - 60, "{billing}");
    assert_eq!(billing["shorter_than_min_window"], false);
    let shipping = &lines[1];
    assert_eq!(shipping["consumer"], "shipping");
    assert_eq!(shipping["rows"], 5);
    assert_eq!(shipping["shorter_than_min_window"], true);
    assert!(text(&out.stderr).contains("less than 7d"), "{out:?}");
    db.drop().await;
}

#[test]
fn usage_errors_exit_2_and_name_the_input() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["migrate", "--key-mode", "sha1"],
            "invalid value 'sha1' for '--key-mode",
        ),
        (&["purge"], "--older-than"),
        (&["purge", "--older-than", "14"], "`14` is not a duration"),
        (&["stats", "--min-windw", "7d"], "'--min-windw'"),
        (&["purge", "--older-than", "14d", "--batch", "0"], "--batch"),
    ];
    for (args, expected) in cases {
        let out = admin(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(expected),
            "{args:?}: `{expected}` missing from:\n{stderr}"
        );
    }
}

#[test]
fn migrate_print_sql_prints_the_statements_without_a_database() {
    // Nothing listens on port 1: a connection attempt would fail the command.
    let nowhere = "postgres://nobody:secret@127.0.0.1:1/none";
    let args = [
        "migrate",
        "--print-sql",
        "--database-url",
        nowhere,
        "--schema",
        "billing",
        "--key-mode",
        "uuid",
    ];
    let out = admin(&args);
    assert!(out.status.success(), "{out:?}");
    assert!(out.stderr.is_empty(), "{out:?}");
    let sql = text(&out.stdout);
    assert!(sql.starts_with("-- "), "stdout is not only SQL:\n{sql}");
    for expected in [
        r#"CREATE TABLE IF NOT EXISTS "billing"."inbox_consumers" ("#,
        r#"CREATE TABLE IF NOT EXISTS "billing"."inbox" ("#,
        "message_id uuid NOT NULL",
        "USING brin (processed_minute);",
    ] {
        assert!(sql.contains(expected), "`{expected}` missing from:\n{sql}");
    }
    assert!(!sql.contains("PARTITION"), "{sql}");

    let out = admin(&[
        "migrate",
        "--print-sql",
        "--partitioned",
        "--database-url",
        nowhere,
    ]);
    assert!(out.status.success(), "{out:?}");
    let sql = text(&out.stdout);
    for expected in [
        r#"CREATE TABLE IF NOT EXISTS "inbox" ("#,
        "PARTITION BY RANGE (message_id);",
        r#"CREATE TABLE "inbox_default" PARTITION OF "inbox" DEFAULT;"#,
    ] {
        assert!(sql.contains(expected), "`{expected}` missing from:\n{sql}");
    }
}

#[test]
fn runtime_errors_exit_1_and_name_the_input() {
    let args = ["stats", "--table", "inbox; DROP TABLE x"];
    let out = admin(&args);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    let expected = "table name `inbox; DROP TABLE x` is not a plain SQL identifier";
    assert!(
        stderr.contains(expected),
        "`{expected}` missing from:\n{stderr}"
    );
}

#[test]
fn no_arguments_prints_usage_and_exits_2() {
    let out = admin(&[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let usage = text(&out.stderr);
    assert!(usage.contains("Usage: inbox-admin"), "{usage}");
    for command in ["migrate", "purge", "stats", "measure-storage"] {
        assert!(usage.contains(command), "{command} missing:\n{usage}");
    }
}

#[test]
fn help_prints_every_command() {
    let out = admin(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    for command in ["migrate", "purge", "stats", "measure-storage"] {
        assert!(stdout.contains(command), "{command} missing:\n{stdout}");
    }
}

#[test]
fn each_command_has_its_own_help_and_the_tool_has_a_version() {
    let cases: [(&str, &[&str]); 4] = [
        ("migrate", &["--key-mode", "--schema", "--print-sql"]),
        ("purge", &["--older-than", "--batch", "--force", "1h"]),
        ("stats", &["--min-window", "--json", "exit status 3"]),
        ("measure-storage", &["--rows", "--runs"]),
    ];
    for (command, expected) in cases {
        let out = admin(&[command, "--help"]);
        assert!(out.status.success(), "{command}: {out:?}");
        let stdout = text(&out.stdout);
        assert!(
            stdout.contains(&format!("Usage: inbox-admin {command}")),
            "{command}:\n{stdout}"
        );
        for word in expected {
            assert!(
                stdout.contains(word),
                "{command}: `{word}` missing:\n{stdout}"
            );
        }
    }

    let out = admin(&["--version"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        text(&out.stdout).trim(),
        concat!("inbox-admin ", env!("CARGO_PKG_VERSION"))
    );
}

#[tokio::test]
async fn purge_json_prints_one_object_whose_figures_match_the_table() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 2_500, 20 * DAY).await;
    db.insert_aged_rows("shipping", 7, 15 * DAY).await;
    db.insert_aged_rows("billing", 10, DAY).await;

    let args = [
        "purge",
        "--schema",
        &db.schema,
        "--older-than",
        "14d",
        "--batch",
        "1000",
        "--json",
    ];
    let out = admin(&args);
    assert!(out.status.success(), "{out:?}");
    assert_no_redrawing(&out);
    let report = json_object(&out);
    assert_eq!(report["deleted_rows"], 2_507, "{report}");
    assert_eq!(db.inbox_rows().await, 10);
    assert_eq!(report["skipped_other_cleaner"], false, "{report}");
    assert_eq!(report["older_than_seconds"], 14 * DAY.as_secs(), "{report}");
    assert_eq!(report["batch_size_rows"], 1000, "{report}");
    assert_eq!(
        report["table"],
        format!(r#""{}"."inbox""#, db.schema),
        "{report}"
    );
    let batches: Vec<u64> = report["batch_deleted_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    assert_eq!(batches.iter().sum::<u64>(), 2_507, "{report}");
    assert_eq!(batches.last(), Some(&0), "{report}");
    assert!(batches.iter().all(|&n| n <= 1000), "{report}");
    assert!(report["elapsed_ms"].is_u64(), "{report}");
    for list in [
        "created_partitions",
        "dropped_partitions",
        "postponed_partitions",
    ] {
        assert!(report[list].is_array(), "{list}: {report}");
    }

    // Nothing left to purge: the same shape, with nothing deleted.
    let again = admin(&args);
    assert!(again.status.success(), "{again:?}");
    let report = json_object(&again);
    assert_eq!(report["deleted_rows"], 0, "{report}");
    assert_eq!(
        report["batch_deleted_rows"],
        serde_json::json!([0]),
        "{report}"
    );
    assert_eq!(db.inbox_rows().await, 10);
    db.drop().await;
}

#[tokio::test]
async fn purge_progress_to_a_pipe_is_plain_lines_and_the_report_is_unchanged() {
    let db = TestDb::new().await;
    db.insert_aged_rows("billing", 20_000, 20 * DAY).await;
    db.insert_aged_rows("billing", 3, DAY).await;

    // Plain lines every 20 ms instead of 10 s, so that this short purge prints some.
    let out = admin_with(
        &[
            "purge",
            "--schema",
            &db.schema,
            "--older-than",
            "14d",
            "--batch",
            "200",
        ],
        &[("INBOX_ADMIN_PROGRESS_EVERY", "20ms")],
    );
    assert!(out.status.success(), "{out:?}");
    assert_no_redrawing(&out);
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("batch 1: 200 rows\n"), "{stdout}");
    assert!(
        stdout
            .contains("batch 100: 200 rows\nbatch 101: 0 rows\ndeleted 20000 rows older than 14d"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("inbox-admin purge:"),
        "progress on stdout:\n{stdout}"
    );
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        !lines.is_empty(),
        "no progress line in 20 ms steps:\n{stderr}"
    );
    for line in &lines {
        assert!(line.starts_with("inbox-admin purge: "), "{line}");
        assert!(line.contains(" rows deleted"), "{line}");
        assert!(line.contains(", elapsed "), "{line}");
    }
    assert_eq!(db.inbox_rows().await, 3);

    // `off`: no progress at all.
    db.insert_aged_rows("billing", 5_000, 20 * DAY).await;
    let out = admin_with(
        &[
            "purge",
            "--schema",
            &db.schema,
            "--older-than",
            "14d",
            "--batch",
            "100",
        ],
        &[("INBOX_ADMIN_PROGRESS_EVERY", "off")],
    );
    assert!(out.status.success(), "{out:?}");
    assert!(out.stderr.is_empty(), "{out:?}");
    assert!(text(&out.stdout).contains("deleted 5000 rows"), "{out:?}");
    db.drop().await;
}

#[test]
fn measure_storage_json_prints_the_bytes_per_row_of_every_layout_and_run() {
    const ROWS: u64 = 2_000;
    const PAGE: f64 = 8192.0;
    let out = admin(&["measure-storage", "--rows", "2000", "--runs", "2", "--json"]);
    assert!(out.status.success(), "{out:?}");
    assert_no_redrawing(&out);
    // The runs are in the object, not on stderr.
    assert!(!text(&out.stderr).contains("run 1/2"), "{out:?}");
    let report = json_object(&out);
    assert_eq!(report["rows_per_run"], ROWS, "{report}");
    assert_eq!(report["runs_per_layout"], 2, "{report}");
    assert!(report["elapsed_ms"].is_u64(), "{report}");
    let layouts = report["layouts"].as_array().unwrap();
    let keys: Vec<&str> = layouts
        .iter()
        .map(|l| l["keys"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["text_v4", "text_v7", "uuid_v4", "uuid_v7", "hashed"]);
    let number = |v: &serde_json::Value, field: &str| {
        v[field]
            .as_f64()
            .unwrap_or_else(|| panic!("{field} is not a number: {v}"))
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6 * b.abs().max(1.0);
    for layout in layouts {
        let runs = layout["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2, "{layout}");
        for run in runs {
            let (heap, index) = (
                number(run, "heap_bytes_per_row"),
                number(run, "index_bytes_per_row"),
            );
            // Relation sizes are whole 8 kB pages: bytes per row x rows is a page count.
            for bytes_per_row in [heap, index] {
                let pages = bytes_per_row * ROWS as f64 / PAGE;
                assert!(pages >= 1.0 && close(pages, pages.round()), "{run}");
            }
            assert!(
                close(number(run, "total_bytes_per_row"), heap + index),
                "{run}"
            );
            assert!(run["elapsed_ms"].is_u64(), "{run}");
        }
        let total = number(layout, "total_bytes_per_row");
        let (heap, index) = (
            number(layout, "heap_bytes_per_row"),
            number(layout, "index_bytes_per_row"),
        );
        // The median of two runs is their mean, so the medians add up.
        assert!(close(total, heap + index), "{layout}");
        assert!((16.0..1000.0).contains(&total), "{layout}");
        assert!(
            close(number(layout, "gb_for_70m_rows"), total * 0.07),
            "{layout}"
        );
        assert!(
            close(number(layout, "gb_for_190m_rows"), total * 0.19),
            "{layout}"
        );
    }
    // 36-character text keys take more room than 16-byte uuids.
    let total = |i: usize| number(&layouts[i], "total_bytes_per_row");
    assert!(total(0) > total(2), "{report}");
}

#[test]
fn measure_storage_to_a_pipe_prints_the_table_and_a_plain_line_per_run() {
    let out = admin(&["measure-storage", "--rows", "500", "--runs", "1"]);
    assert!(out.status.success(), "{out:?}");
    assert_no_redrawing(&out);
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("bytes per remembered ID after VACUUM, 500 rows, median of 1 run(s)"),
        "{stdout}"
    );
    for label in ["text (uuid v4 strings)", "uuid v7", "hashed (16 bytes)"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(label)),
            "{label}:\n{stdout}"
        );
    }
    let stderr = text(&out.stderr);
    let runs = stderr
        .lines()
        .filter(|l| l.contains(" run 1/1: heap "))
        .count();
    assert_eq!(runs, 5, "{stderr}");
}

#[tokio::test]
async fn migrate_json_names_the_table_the_keys_and_the_layout() {
    let db = TestDb::new().await;
    let out = admin(&[
        "migrate",
        "--schema",
        &db.schema,
        "--table",
        "hashed_inbox",
        "--key-mode",
        "hashed",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let object = json_object(&out);
    assert_eq!(
        object,
        serde_json::json!({
            "table": format!(r#""{}"."hashed_inbox""#, db.schema),
            "key_mode": "hashed",
            "layout": "plain",
        })
    );
    db.drop().await;
}
