//! The liveness and readiness probes follow the consumers they watch.

use std::time::Duration;

use inbox_core::{Consumer, Probes};
use inbox_testkit::{MemoryBroker, MemoryStore, Sum};
use tokio::sync::oneshot;

#[tokio::test]
async fn probes_follow_the_consumer_from_start_to_stop() {
    let broker = MemoryBroker::new();
    broker.publish(Some("a"), "5");
    let store = MemoryStore::<i64>::new();
    let consumer = Consumer::new("probed", broker.source(), store.clone(), Sum);
    let probes = Probes::new().consumer(consumer.health());

    // Built, not running: live, not ready.
    let ready = probes.answer("/readyz").expect("a probe");
    assert_eq!(
        (ready.status, ready.body.as_str()),
        (503, "not ready: consumer #1 starting\n")
    );
    assert_eq!(probes.answer("/healthz").expect("a probe").status, 200);
    assert_eq!(probes.answer("/livez"), probes.answer("/healthz"));
    assert_eq!(probes.answer("/metrics"), None, "not a probe");

    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while probes.ready().status != 200 || store.state().await != 5 {
        assert!(tokio::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(probes.ready().body, "ready\n");
    assert_eq!(probes.live().body, "live\n");

    // Stopped: neither live nor ready, and the body names it.
    let _ = stop.send(());
    running.await.expect("consumer task").expect("consumer ran");
    assert_eq!(
        (probes.ready().status, probes.ready().body),
        (503, "not ready: probed stopped\n".to_owned())
    );
    assert_eq!(probes.live().status, 503);
}

#[test]
fn probes_without_consumers_pass() {
    let probes = Probes::new();
    assert_eq!(probes.live().status, 200);
    assert_eq!(probes.ready().status, 200);
}
