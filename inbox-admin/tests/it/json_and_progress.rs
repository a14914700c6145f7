//! `inbox-admin --json` against the database it reports on, and its progress where stdout or
//! stderr is a pipe: plain lines, never a carriage return.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_conformance::TestDb;

use crate::common;
use common::*;

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
