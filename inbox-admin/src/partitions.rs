//! `partition` (a plain table converted to the partitioned layout) and `partitions` (the list),
//! and what `purge` says about partitions. Each returns its lines, so tests read what an operator
//! reads.

use std::time::SystemTime;

use inbox_postgres::{Conversion, PartitionInfo, PartitionRange, Partitions, PgInbox, PurgeReport};

use crate::args::{ListPartitions, Partition};
use crate::CliError;

/// `partition`: the conversion's outcome (lines, or one JSON object), or
/// [`CliError::Refused`].
pub(crate) async fn convert(inbox: PgInbox, args: &Partition) -> Result<Vec<String>, CliError> {
    let inbox =
        inbox.partitioned(Partitions::every(args.partition_every).ahead(args.partitions_ahead));
    let t = inbox.table().to_string();
    let conversion = inbox.migrate_to_partitioned(args.window).await?;
    if args.json {
        let (converted, ranges_from, created, moved_rows) = match &conversion {
            Conversion::AlreadyPartitioned => (false, None, &[][..], 0),
            Conversion::Converted {
                created,
                ranges_from,
                moved_rows,
            } => (true, Some(utc(*ranges_from)), &created[..], *moved_rows),
            other => return Err(refused(&t, other)),
        };
        let partitions: Vec<_> = inbox
            .partitions()
            .await?
            .iter()
            .map(|p| partition_json(&t, p))
            .collect();
        let object = serde_json::json!({
            "table": t,
            "converted": converted,
            "ranges_from": ranges_from,
            "created_partitions": created,
            "moved_rows": moved_rows,
            "partitions": partitions,
        });
        return Ok(vec![object.to_string()]);
    }
    match conversion {
        Conversion::AlreadyPartitioned => {
            Ok(vec![format!("{t} is partitioned already; nothing changed")])
        }
        Conversion::Converted {
            created,
            ranges_from,
            moved_rows,
        } => {
            let mut lines = vec![
                format!(
                    "converted {t}: the plain table is now its default partition; ranges from {} on",
                    utc(ranges_from)
                ),
                format!(
                    "{} range partitions created, {moved_rows} rows moved into them",
                    created.len()
                ),
            ];
            lines.extend(list_lines(&inbox).await?);
            Ok(lines)
        }
        other => Err(refused(&t, &other)),
    }
}

fn refused(t: &str, conversion: &Conversion) -> CliError {
    CliError::Refused(match conversion {
        Conversion::Refused { reason } => format!("cannot partition {t}: {reason}"),
        other => format!("cannot partition {t}: {other:?}"),
    })
}

/// `partitions`: a table, or one JSON object per partition.
pub(crate) async fn list(inbox: &PgInbox, args: &ListPartitions) -> Result<Vec<String>, CliError> {
    if !args.json {
        return list_lines(inbox).await;
    }
    let t = inbox.table().to_string();
    Ok(inbox
        .partitions()
        .await?
        .iter()
        .map(|p| partition_json(&t, p).to_string())
        .collect())
}

/// One partition as `partitions --json` prints it.
fn partition_json(t: &str, p: &PartitionInfo) -> serde_json::Value {
    let (from, to) = match &p.range {
        PartitionRange::Time { from, to } => (Some(utc(*from)), Some(utc(*to))),
        _ => (None, None),
    };
    serde_json::json!({
        "table": t,
        "name": p.name,
        "from": from,
        "to": to,
        "default": p.range == PartitionRange::Default,
        "approx_rows": p.approx_rows,
        "bytes": p.bytes,
    })
}

async fn list_lines(inbox: &PgInbox) -> Result<Vec<String>, CliError> {
    let t = inbox.table();
    let parts = inbox.partitions().await?;
    if parts.is_empty() {
        return Ok(vec![format!(
            "{t} is plain: no partitions (convert it with `inbox-admin partition --window <purge window>`)"
        )]);
    }
    let mut lines = vec![
        format!("table {t}: {} partitions", parts.len()),
        format!(
            "{:<32} {:<21} {:<21} {:>12} {:>14}",
            "partition", "from (UTC)", "to (UTC)", "~rows", "bytes"
        ),
    ];
    for p in parts {
        let (from, to) = match &p.range {
            PartitionRange::Time { from, to } => (utc(*from), utc(*to)),
            PartitionRange::Default => ("DEFAULT".to_owned(), String::new()),
            PartitionRange::Other(bounds) => (bounds.clone(), String::new()),
            _ => ("?".to_owned(), String::new()),
        };
        lines.push(format!(
            "{:<32} {from:<21} {to:<21} {:>12} {:>14}",
            p.name, p.approx_rows, p.bytes
        ));
    }
    Ok(lines)
}

/// What a purge did to partitions, a line each.
pub(crate) fn purge_lines(report: &PurgeReport) -> Vec<String> {
    let created = report
        .created()
        .iter()
        .map(|name| format!("created partition {name}"));
    let dropped = report.dropped().iter().map(|d| {
        format!(
            "dropped partition {} (~{} rows; detached in {} ms)",
            d.name,
            d.approx_rows,
            d.lock_wait.as_millis()
        )
    });
    let postponed = report.postponed().iter().map(|name| {
        format!("postponed partition {name}: claims held the table past the lock timeout; the next purge tries again")
    });
    created.chain(dropped).chain(postponed).collect()
}

fn utc(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use inbox_conformance::TestDb;
    use inbox_postgres::{KeyMode, TableName};

    use super::*;

    fn store(db: &TestDb, table: &str, mode: KeyMode) -> PgInbox {
        PgInbox::new(db.pool.clone())
            .with_table(TableName::qualified(&db.schema, table).unwrap())
            .with_key_mode(mode)
    }

    #[tokio::test]
    async fn a_plain_table_is_listed_as_plain_converted_then_listed_with_its_ranges() {
        let db = TestDb::new().await;
        let inbox = store(&db, "orders", KeyMode::Uuid);
        inbox.migrate().await.unwrap();
        let plain = list(&inbox, &ListPartitions { json: false }).await.unwrap();
        assert!(plain[0].contains("is plain: no partitions"), "{plain:?}");

        let args = Partition {
            window: Duration::from_secs(2 * 86_400),
            partition_every: Duration::from_secs(86_400),
            partitions_ahead: 1,
            json: false,
        };
        let lines = convert(inbox.clone(), &args).await.unwrap();
        assert!(lines[0].starts_with("converted "), "{lines:?}");
        assert!(
            lines[1].starts_with("4 range partitions created, 0 rows moved"),
            "{lines:?}"
        );
        let listed = list(&inbox, &ListPartitions { json: false }).await.unwrap();
        assert!(listed[0].ends_with(": 5 partitions"), "{listed:?}");
        assert!(listed[2].starts_with("orders_p"), "{listed:?}");
        assert!(listed[2].contains("T00:00:00Z"), "{listed:?}");
        assert!(listed[6].starts_with("orders_default") && listed[6].contains("DEFAULT"));

        let json = list(&inbox, &ListPartitions { json: true }).await.unwrap();
        let objects: Vec<serde_json::Value> = json
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(objects.len(), 5);
        assert_eq!(objects[4]["default"], true);
        assert_eq!(objects[4]["name"], "orders_default");
        assert!(objects[0]["from"].as_str().unwrap().ends_with("T00:00:00Z"));

        let again = convert(inbox, &args).await.unwrap();
        assert_eq!(again.len(), 1);
        assert!(again[0].contains("is partitioned already"), "{again:?}");

        let hashed = store(&db, "hashed", KeyMode::Hashed);
        hashed.migrate().await.unwrap();
        let refused = convert(hashed, &args).await.unwrap_err().to_string();
        assert!(refused.contains("cannot partition"), "{refused}");
        assert!(refused.contains("not stored"), "{refused}");
        db.drop().await;
    }

    #[tokio::test]
    async fn partition_json_is_one_object_with_the_conversion_and_the_partitions() {
        let db = TestDb::new().await;
        let inbox = store(&db, "payments", KeyMode::Uuid);
        inbox.migrate().await.unwrap();
        let args = Partition {
            window: Duration::from_secs(2 * 86_400),
            partition_every: Duration::from_secs(86_400),
            partitions_ahead: 1,
            json: true,
        };
        let lines = convert(inbox.clone(), &args).await.unwrap();
        assert_eq!(lines.len(), 1, "{lines:?}");
        let object: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!(object["converted"], true, "{object}");
        assert_eq!(object["moved_rows"], 0, "{object}");
        assert_eq!(object["table"], inbox.table().to_string());
        assert!(object["ranges_from"]
            .as_str()
            .unwrap()
            .ends_with("T00:00:00Z"));
        let created = object["created_partitions"].as_array().unwrap();
        assert_eq!(created.len(), 4, "{object}");
        let partitions = object["partitions"].as_array().unwrap();
        assert_eq!(partitions.len(), 5, "{object}");
        assert_eq!(partitions[4]["name"], "payments_default");
        assert_eq!(partitions[4]["default"], true);

        let again = convert(inbox, &args).await.unwrap();
        let object: serde_json::Value = serde_json::from_str(&again[0]).unwrap();
        assert_eq!(object["converted"], false, "{object}");
        assert_eq!(object["created_partitions"], serde_json::json!([]));
        assert!(object["ranges_from"].is_null(), "{object}");
        assert_eq!(object["partitions"].as_array().unwrap().len(), 5);
        db.drop().await;
    }
}
