"""moto's SQS server, with SendMessage and ReceiveMessage made independent of the queue's length.

moto 5.2 reads single queue attributes (ContentBasedDeduplication on every SendMessage,
MessageRetentionPeriod for every message a ReceiveMessage returns) through `Queue.attributes`,
which computes every attribute, including three approximate message counts that each scan the
whole queue. With 10,000 messages in a queue, publishing them takes minutes and a receive of
10 takes seconds.

Here, while one of those two reads runs, the three counts are not computed (they read 0; the
two reads never look at them). And the SQS model reads the clock with `time.time()` instead of
building two datetimes per call: the same POSIX seconds, read once per message on every scan.
Everything else, GetQueueAttributes included, is moto unchanged.

Usage: python3 moto_server.py [moto_server arguments, e.g. -H 127.0.0.1 -p 4566]
"""

import sys
import threading
import time

from moto.server import main
from moto.sqs import models

_counts_off = threading.local()


def _count_unless_off(prop):
    def get(queue):
        if getattr(_counts_off, "active", False):
            return 0
        return prop.fget(queue)

    return property(get)


def _without_counts(method):
    def run(*args, **kwargs):
        _counts_off.active = True
        try:
            return method(*args, **kwargs)
        finally:
            _counts_off.active = False

    return run


for _name in (
    "approximate_number_of_messages",
    "approximate_number_of_messages_delayed",
    "approximate_number_of_messages_not_visible",
):
    setattr(models.Queue, _name, _count_unless_off(getattr(models.Queue, _name)))

_unix_time = models.unix_time
_unix_time_millis = models.unix_time_millis


def _now(dt=None):
    return time.time() if dt is None else _unix_time(dt)


def _now_millis(dt=None):
    return time.time() * 1000.0 if dt is None else _unix_time_millis(dt)


models.unix_time = _now
models.unix_time_millis = _now_millis
models.SQSBackend.send_message = _without_counts(models.SQSBackend.send_message)
models.SQSBackend.is_message_valid_based_on_retention_period = _without_counts(
    models.SQSBackend.is_message_valid_based_on_retention_period
)

if __name__ == "__main__":
    main(sys.argv[1:])
