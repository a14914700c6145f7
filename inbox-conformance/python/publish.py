"""Publishes messages with a broker's standard Python client, for the foreign-ID tests.

Reads one JSON document on stdin:

    {"target": {"broker": "kafka" | "rabbitmq" | "sqs" | "redis" | "nats", ...where...},
     "messages": [{"body": "...", "headers": {"name": "text"}, "content_type": "...",
                   "message_id": "...", "dedup_id": "...", "group_id": "..."}]}

and publishes each message in order, waiting for the broker to confirm every one. Only what a
message names is set: a message without "message_id" has no AMQP message_id property.
"""

import json
import os
import sys


def kafka(target, messages):
    from confluent_kafka import Producer

    # One record per batch, as the suite's own producers on Tansu (`Kafka::one_record_per_batch`):
    # Tansu answers a fetch from inside a batch with the batches after it, so a consumer resuming
    # from a commit in mid-batch would skip the rest of the batch.
    producer = Producer(
        {"bootstrap.servers": target["brokers"], "acks": "all", "batch.num.messages": 1}
    )
    failed = []

    def delivered(err, _msg):
        if err is not None:
            failed.append(err)

    for m in messages:
        headers = [(k, v.encode()) for k, v in m.get("headers", {}).items()]
        if "content_type" in m:
            headers.append(("content-type", m["content_type"].encode()))
        producer.produce(
            target["topic"], value=m["body"].encode(), headers=headers, on_delivery=delivered
        )
    left = producer.flush(30)
    if left or failed:
        sys.exit(f"kafka: {left} unsent, failures {failed}")


def rabbitmq(target, messages):
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(target["url"]))
    channel = connection.channel()
    channel.confirm_delivery()
    for m in messages:
        properties = pika.BasicProperties(
            delivery_mode=2,
            message_id=m.get("message_id"),
            content_type=m.get("content_type"),
            headers=m.get("headers") or None,
        )
        channel.basic_publish(
            exchange="",
            routing_key=target["queue"],
            body=m["body"].encode(),
            properties=properties,
            mandatory=True,
        )
    connection.close()


def sqs(target, messages):
    import boto3

    url = target["queue_url"]
    endpoint = "/".join(url.split("/")[:3])
    client = boto3.client(
        "sqs",
        endpoint_url=endpoint,
        region_name=os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1")),
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "test"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "test"),
    )
    for m in messages:
        request = {"QueueUrl": url, "MessageBody": m["body"]}
        attributes = {
            k: {"DataType": "String", "StringValue": v} for k, v in m.get("headers", {}).items()
        }
        if attributes:
            request["MessageAttributes"] = attributes
        if "dedup_id" in m:
            request["MessageDeduplicationId"] = m["dedup_id"]
        if url.endswith(".fifo"):
            request["MessageGroupId"] = m.get("group_id", "credits")
        client.send_message(**request)


def redis(target, messages):
    import redis as redis_py

    client = redis_py.Redis.from_url(target["url"])
    for m in messages:
        fields = dict(m.get("headers", {}))
        fields["payload"] = m["body"]
        client.xadd(target["stream"], fields)


def nats(target, messages):
    import asyncio

    import nats as nats_py

    async def publish():
        connection = await nats_py.connect(target["url"])
        jetstream = connection.jetstream()
        for m in messages:
            # Each publish waits for JetStream's acknowledgement.
            await jetstream.publish(
                target["subject"], m["body"].encode(), headers=m.get("headers") or None
            )
        await connection.close()

    asyncio.run(publish())


def main():
    job = json.load(sys.stdin)
    target = job["target"]
    publish = {"kafka": kafka, "rabbitmq": rabbitmq, "sqs": sqs, "redis": redis, "nats": nats}[
        target["broker"]
    ]
    publish(target, job["messages"])


if __name__ == "__main__":
    main()
