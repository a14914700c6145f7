//! `docs/dashboards/inbox.json` and `docs/alerts/inbox.rules.yml` parse, have the panels and
//! alerts an operator needs, and query only metrics the library exports (a renamed metric would
//! leave a panel or an alert silently empty).
//!
//! The rules file is checked structurally by hand (no YAML parser among the dependencies):
//! the subset of YAML it is written in, and each rule's fields. `promtool check rules` checks
//! the PromQL itself.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use transactional_inbox::telemetry as t;

const DASHBOARD: &str = include_str!("../../../docs/dashboards/inbox.json");
const RULES: &str = include_str!("../../../docs/alerts/inbox.rules.yml");

/// Every series name the library exports, histogram series included.
fn exported() -> BTreeSet<String> {
    let mut names: BTreeSet<String> = [
        t::MESSAGES_RECEIVED,
        t::MESSAGES_APPLIED,
        t::DUPLICATES_SKIPPED,
        t::RETRIES,
        t::DEAD_LETTERED,
        t::ACK_FAILURES,
        t::COMMITS,
        t::ERRORS,
        t::IN_FLIGHT,
        t::CONSUMER_READY,
        t::CONSUMER_STATE,
        t::RETENTION,
        t::REDELIVERY_WINDOW,
        t::REDELIVERED,
        t::EFFECTS_CONFIRMED,
        t::EFFECTS_SKIPPED_UNKNOWN,
        t::EFFECTS_BUSY,
        t::EFFECTS_FENCED,
        transactional_inbox::postgres::OLDEST_AGE_GAUGE,
        transactional_inbox::postgres::PURGE_LAST_SUCCESS_GAUGE,
        transactional_inbox::postgres::OUTBOX_OLDEST_UNSENT_GAUGE,
        transactional_inbox::postgres::OUTBOX_PUBLISHED_COUNTER,
        transactional_inbox::postgres::OUTBOX_ERRORS_COUNTER,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    for histogram in [
        t::BATCH_SIZE,
        t::CLAIM_DURATION,
        t::HANDLER_DURATION,
        t::COMMIT_DURATION,
        t::ACK_DURATION,
        t::END_TO_END_LAG,
    ] {
        for suffix in ["_bucket", "_sum", "_count"] {
            names.insert(format!("{histogram}{suffix}"));
        }
    }
    names
}

/// The `inbox_…` names a PromQL expression reads.
fn metrics_in(expr: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = expr;
    while let Some(start) = rest.find("inbox_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        // Part of a longer word (a label value, say) is not a metric.
        let before = rest[..start].chars().last();
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '"') {
            found.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    found
}

fn balanced(expr: &str) -> bool {
    let mut stack = Vec::new();
    for c in expr.chars() {
        let opener = match c {
            '(' | '[' | '{' => {
                stack.push(c);
                continue;
            }
            ')' => '(',
            ']' => '[',
            '}' => '{',
            _ => continue,
        };
        if stack.pop() != Some(opener) {
            return false;
        }
    }
    stack.is_empty()
}

#[test]
fn the_dashboard_has_its_panels_and_reads_exported_metrics_only() {
    let dashboard: Value = serde_json::from_str(DASHBOARD).unwrap();
    assert_eq!(dashboard["uid"], "inbox-consumers");
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(variables, ["datasource", "consumer", "outbox"]);

    let panels = dashboard["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    let mut read = BTreeSet::new();
    let mut cells: BTreeMap<(u64, u64), String> = BTreeMap::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap().to_owned();
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "duplicate id: {title}"
        );
        let grid = &panel["gridPos"];
        let (x, y, w, h) = (
            grid["x"].as_u64().unwrap(),
            grid["y"].as_u64().unwrap(),
            grid["w"].as_u64().unwrap(),
            grid["h"].as_u64().unwrap(),
        );
        assert!(
            x + w <= 24 && w > 0 && h > 0,
            "{title} does not fit the grid"
        );
        for cx in x..x + w {
            for cy in y..y + h {
                if let Some(other) = cells.insert((cx, cy), title.clone()) {
                    panic!("{title} overlaps {other}");
                }
            }
        }
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title} has no query");
        for target in targets {
            let expr = target["expr"].as_str().unwrap();
            assert!(balanced(expr), "{title}: unbalanced {expr}");
            // Filtered by the dashboard's variables: per consumer, per outbox, or (the purge,
            // per table) across all.
            let purge = metrics_in(expr)
                == BTreeSet::from([
                    transactional_inbox::postgres::PURGE_LAST_SUCCESS_GAUGE.to_owned()
                ]);
            assert!(
                expr.contains("consumer=~\"$consumer\"")
                    || expr.contains("outbox=~\"$outbox\"")
                    || purge,
                "{title}: {expr}"
            );
            read.extend(metrics_in(expr));
        }
        titles.insert(title);
    }

    let exported = exported();
    let unknown: Vec<&String> = read.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "panels read unknown metrics: {unknown:?}"
    );
    for needed in [
        t::MESSAGES_APPLIED,
        t::DUPLICATES_SKIPPED,
        t::DEAD_LETTERED,
        "inbox_handler_duration_seconds_bucket",
        "inbox_commit_duration_seconds_bucket",
        "inbox_end_to_end_lag_seconds_bucket",
        t::IN_FLIGHT,
        t::CONSUMER_READY,
        t::ACK_FAILURES,
        transactional_inbox::postgres::OLDEST_AGE_GAUGE,
        t::RETENTION,
    ] {
        assert!(read.contains(needed), "no panel shows {needed}");
    }
    for needed in [
        "Applied, skipped and dead-lettered per second",
        "Handler duration",
        "Commit duration",
        "End-to-end lag",
        "In flight",
        "Consumers ready",
        "Ack failures",
        "Inbox window vs retention",
    ] {
        assert!(titles.contains(needed), "no panel {needed:?}: {titles:?}");
    }
}

/// One alerting rule as written in the file.
#[derive(Debug, Default)]
struct Rule {
    alert: String,
    fields: BTreeMap<String, String>,
}

/// Reads the subset of YAML the rules file uses: `groups:`, `- name:`, `rules:`, `- alert:`
/// items with scalar fields, `|` blocks, and the `labels:` and `annotations:` maps.
fn parse_rules(text: &str) -> (Vec<String>, Vec<Rule>) {
    let mut groups = Vec::new();
    let mut rules: Vec<Rule> = Vec::new();
    let mut section = String::new();
    let mut block: Option<(String, usize)> = None;
    let mut seen_groups = false;
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        assert!(!line.contains('\t'), "line {n}: a tab");
        assert_eq!(line.trim_end(), line, "line {n}: trailing space");
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = line.len() - trimmed.len();
        assert_eq!(indent % 2, 0, "line {n}: odd indentation");
        if let Some((key, at)) = &block {
            if indent > *at {
                let rule = rules.last_mut().unwrap();
                let value = rule.fields.entry(key.clone()).or_default();
                value.push_str(trimmed);
                value.push('\n');
                continue;
            }
            block = None;
        }
        let (key, value) = trimmed
            .trim_start_matches("- ")
            .split_once(':')
            .unwrap_or_else(|| panic!("line {n}: no `key:`"));
        let value = value.trim();
        match (indent, key) {
            (0, "groups") => seen_groups = true,
            (2, "name") if trimmed.starts_with("- ") => groups.push(value.to_owned()),
            (4, "rules") => {}
            (6, "alert") if trimmed.starts_with("- ") => rules.push(Rule {
                alert: value.to_owned(),
                ..Rule::default()
            }),
            (8, "labels" | "annotations") if value.is_empty() => section = key.to_owned(),
            (8, _) => {
                let rule = rules.last_mut().expect("a field before any rule");
                if value == "|" {
                    block = Some((key.to_owned(), indent));
                } else {
                    rule.fields.insert(key.to_owned(), value.to_owned());
                }
            }
            (10, _) => {
                let rule = rules.last_mut().expect("a field before any rule");
                let value = value.trim_matches('"');
                assert!(!value.is_empty(), "line {n}: empty {key}");
                rule.fields
                    .insert(format!("{section}.{key}"), value.to_owned());
            }
            _ => panic!("line {n}: unexpected `{key}` at indentation {indent}"),
        }
    }
    assert!(seen_groups, "no `groups:`");
    (groups, rules)
}

#[test]
fn the_alert_rules_cover_what_pages_and_read_exported_metrics_only() {
    let (groups, rules) = parse_rules(RULES);
    assert_eq!(groups, ["inbox"]);
    let exported = exported();
    let mut names = BTreeSet::new();
    for rule in &rules {
        let name = &rule.alert;
        assert!(names.insert(name.clone()), "{name} twice");
        assert!(
            name.starts_with("Inbox") && name.chars().all(|c| c.is_ascii_alphanumeric()),
            "{name} is not an Inbox… CamelCase name"
        );
        let expr = rule
            .fields
            .get("expr")
            .unwrap_or_else(|| panic!("{name}: no expr"));
        assert!(balanced(expr), "{name}: unbalanced {expr}");
        let read = metrics_in(expr);
        assert!(!read.is_empty(), "{name} reads no inbox metric");
        let unknown: Vec<&String> = read.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{name} reads unknown metrics {unknown:?}"
        );
        // No `for`: it fires at the first evaluation (a fenced effect).
        if let Some(wait) = rule.fields.get("for") {
            let (number, unit) = wait.split_at(wait.len() - 1);
            assert!(
                number.parse::<u32>().is_ok() && ["s", "m", "h"].contains(&unit),
                "{name}: for {wait:?} is no duration"
            );
        }
        let severity = rule.fields.get("labels.severity").map(String::as_str);
        assert!(
            matches!(severity, Some("critical" | "warning")),
            "{name}: severity {severity:?}"
        );
        for annotation in ["annotations.summary", "annotations.description"] {
            assert!(
                rule.fields.contains_key(annotation),
                "{name}: no {annotation}"
            );
        }
    }
    let alerted: BTreeSet<String> = rules
        .iter()
        .flat_map(|r| metrics_in(&r.fields["expr"]))
        .collect();
    for (needed, why) in [
        (
            transactional_inbox::postgres::OLDEST_AGE_GAUGE,
            "the inbox window",
        ),
        (t::RETENTION, "the configured retention"),
        (t::DEAD_LETTERED, "dead letters"),
        (t::ACK_FAILURES, "ack failures"),
        (t::CONSUMER_READY, "a consumer not ready"),
        ("inbox_end_to_end_lag_seconds_bucket", "lag"),
    ] {
        assert!(alerted.contains(needed), "no alert on {why} ({needed})");
    }
}

#[test]
fn the_checks_catch_what_they_look_for() {
    assert_eq!(
        metrics_in("rate(inbox_messages_applied_totl{consumer=\"inbox_x\"}[5m])"),
        BTreeSet::from(["inbox_messages_applied_totl".to_owned()])
    );
    assert!(!exported().contains("inbox_messages_applied_totl"));
    assert!(!balanced("sum(rate(x[5m])"));
    let (_, rules) = parse_rules(
        "groups:\n  - name: g\n    rules:\n      - alert: InboxX\n        expr: |\n          a\n          and b\n        for: 5m\n",
    );
    assert_eq!(rules[0].fields["expr"], "a\nand b\n");
    assert_eq!(rules[0].fields["for"], "5m");
}
