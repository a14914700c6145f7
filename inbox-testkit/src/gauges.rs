//! Gauges a test reads: `metrics-util`'s debugging recorder, read by `name{label=value,…}`.

pub use metrics_util::debugging::{DebuggingRecorder, Snapshotter};

use metrics_util::debugging::DebugValue;

/// The gauge `name{label=value,…}` in a snapshot of `snapshotter`, if it was set. A snapshot sets
/// every gauge of its recorder back to 0 (metrics-util's way): read a gauge once per set.
pub fn gauge(snapshotter: &Snapshotter, key: &str) -> Option<f64> {
    let snapshot = snapshotter.snapshot().into_vec();
    snapshot.into_iter().find_map(|(composite, _, _, value)| {
        let (name, labels) = (composite.key().name(), composite.key().labels());
        let labels: Vec<String> = labels
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        match value {
            DebugValue::Gauge(value) if format!("{name}{{{}}}", labels.join(",")) == key => {
                Some(value.into_inner())
            }
            _ => None,
        }
    })
}
