//! A `metrics` recorder for tests that check a gauge: it keeps each gauge's last value by name
//! and labels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};

/// Gauges set through the `metrics` facade in this process, by `name{label=value,…}`.
#[derive(Debug, Clone, Default)]
pub struct Gauges(Arc<Mutex<HashMap<String, f64>>>);

impl Gauges {
    /// The gauge `name{label=value,…}`, as last set.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.all().get(key).copied()
    }

    fn all(&self) -> MutexGuard<'_, HashMap<String, f64>> {
        crate::lock(&self.0)
    }
}

struct GaugeCell {
    key: String,
    gauges: Gauges,
}

impl metrics::GaugeFn for GaugeCell {
    fn increment(&self, value: f64) {
        *self.gauges.all().entry(self.key.clone()).or_default() += value;
    }
    fn decrement(&self, value: f64) {
        self.increment(-value);
    }
    fn set(&self, value: f64) {
        self.gauges.all().insert(self.key.clone(), value);
    }
}

struct GaugeRecorder(Gauges);

impl metrics::Recorder for GaugeRecorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        metrics::Gauge::from_arc(Arc::new(GaugeCell {
            key: format!("{}{{{}}}", key.name(), labels.join(",")),
            gauges: self.0.clone(),
        }))
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Installs a global `metrics` recorder that keeps the gauges (once per process; counters and
/// histograms go nowhere) and returns them.
///
/// # Panics
/// When another global recorder was installed first.
pub fn install_gauge_recorder() -> Gauges {
    static GAUGES: OnceLock<Gauges> = OnceLock::new();
    static INSTALL: Once = Once::new();
    let gauges = GAUGES.get_or_init(Gauges::default).clone();
    INSTALL.call_once(|| {
        metrics::set_global_recorder(GaugeRecorder(gauges.clone()))
            .expect("no other global metrics recorder in this process");
    });
    gauges
}
