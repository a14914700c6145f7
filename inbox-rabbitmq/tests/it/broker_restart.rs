//! The conformance suite's broker-restart scenario on RabbitMQ: the broker's application is
//! stopped and started again mid-stream (`rabbitmqctl stop_app`, 3 s, `start_app`). The suite's
//! binary skips it, since every scenario running beside it would fail meanwhile; here it runs
//! alone, in a binary of its own (cargo runs test binaries one after another).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_mid_stream_loses_and_duplicates_nothing() {
    let broker = inbox_conformance::rabbitmq::RabbitMq::default().restarts(true);
    inbox_conformance::scenarios::a_broker_restarted_mid_stream_loses_and_repeats_nothing::<
        _,
        inbox_conformance::TestDb,
    >(&broker)
    .await;
}
